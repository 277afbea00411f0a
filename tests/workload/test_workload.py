"""Workload: MMLU loader, synthetic shape, skew ratio, schedules, JSONL traces."""

from __future__ import annotations

import io
import itertools
import json
from collections import Counter
from pathlib import Path

import pytest

from radixmesh.workload import Request, Schedule, WorkloadSpec, build, mmlu, schedule, skew, trace
from radixmesh.workload.request import Message
from radixmesh.workload.synthetic import MMLU_GROUP_SIZES, synthetic_groups

MMLU_DIR = Path("/work/shared/data/mmlu")


@pytest.fixture(scope="module")
def mmlu_groups() -> dict[str, list[Request]]:
    return mmlu.load_groups(MMLU_DIR)


@pytest.fixture(scope="module")
def synth() -> dict[str, list[Request]]:
    return synthetic_groups(seed=3)


def test_mmlu_loader_shape(mmlu_groups: dict[str, list[Request]]) -> None:
    assert len(mmlu_groups) == 57
    assert sum(len(v) for v in mmlu_groups.values()) == 14042
    sizes = sorted(len(v) for v in mmlu_groups.values())
    assert (sizes[0], sizes[28], sizes[-1]) == (100, 173, 1534)
    assert tuple(len(mmlu_groups[k]) for k in sorted(mmlu_groups)) == MMLU_GROUP_SIZES


def test_mmlu_prompt_format(mmlu_groups: dict[str, list[Request]]) -> None:
    r = mmlu_groups["high_school_physics"][0]
    assert r.prompt is not None and r.max_tokens == 1 and r.id == "high_school_physics/0"
    assert r.prompt.startswith(
        "The following are multiple choice questions (with answers) about high school physics.\n\n"
    )
    assert r.prompt.endswith("\nAnswer:")
    assert r.prompt.count("\nAnswer: ") == 5  # the five dev shots carry their answers
    assert "\nA. " in r.prompt and "\nD. " in r.prompt
    # every question of a subject shares exactly the prefix
    other = mmlu_groups["high_school_physics"][1]
    assert r.prefix_chars is not None
    assert other.prompt is not None and other.prompt[: r.prefix_chars] == r.prompt[: r.prefix_chars]
    assert other.prompt[r.prefix_chars :] != r.prompt[r.prefix_chars :]


def test_mmlu_prefix_share_matches_guide(mmlu_groups: dict[str, list[Request]]) -> None:
    reqs = [r for v in mmlu_groups.values() for r in v]
    total = sum(len(r.text) for r in reqs)
    prefix = sum(r.prefix_chars or 0 for r in reqs)
    assert round(total / len(reqs)) == 3024
    assert prefix / total == pytest.approx(0.846, abs=0.001)


def test_mmlu_bad_layout(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        mmlu.load_groups(tmp_path)
    (tmp_path / "dev").mkdir()
    (tmp_path / "test").mkdir()
    (tmp_path / "dev" / "x_dev.csv").write_text("q,a,b,c,d,Z\n")
    (tmp_path / "test" / "x_test.csv").write_text("q,a,b,c,d,A\n")
    with pytest.raises(ValueError, match="answer"):
        mmlu.load_groups(tmp_path)


def test_synthetic_shape(synth: dict[str, list[Request]]) -> None:
    assert len(synth) == 57
    assert [len(v) for v in synth.values()] == list(MMLU_GROUP_SIZES)
    reqs = [r for v in synth.values() for r in v]
    total = sum(len(r.text) for r in reqs)
    prefix = sum(r.prefix_chars or 0 for r in reqs)
    assert 0.82 <= prefix / total <= 0.88
    assert 2500 <= total / len(reqs) <= 3600
    for v in synth.values():
        p = v[0].prefix_chars
        assert p is not None and all(r.text[:p] == v[0].text[:p] for r in v)
    firsts = [v[0].text[v[0].prefix_chars or 0 :] for v in synth.values()]
    assert len(set(firsts)) == 57


def test_synthetic_is_seeded_and_scaled() -> None:
    a = synthetic_groups(seed=1, max_per_group=3)
    b = synthetic_groups(seed=1, max_per_group=3)
    c = synthetic_groups(seed=2, max_per_group=3)
    assert a == b and a != c
    small = synthetic_groups(seed=1, scale=0.25, max_per_group=20)
    mean = sum(len(r.text) for v in small.values() for r in v) / sum(map(len, small.values()))
    assert mean < 1200


def test_uniform_is_a_seeded_permutation(synth: dict[str, list[Request]]) -> None:
    a = skew.uniform(synth, 500, seed=7)
    assert a == skew.uniform(synth, 500, seed=7) != skew.uniform(synth, 500, seed=8)
    assert len({r.id for r in a}) == 500
    assert len({r.group for r in a}) > 40


def test_skew_ratio(synth: dict[str, list[Request]]) -> None:
    reqs = skew.skewed(synth, 1000, seed=5)
    hot = set(skew.hot_groups(list(synth), 0.2, seed=5))
    assert len(hot) == 11
    assert sum(r.group in hot for r in reqs) == 800
    assert len({r.id for r in reqs}) == 1000
    assert reqs == skew.skewed(synth, 1000, seed=5)
    assert set(skew.hot_groups(list(synth), 0.2, seed=6)) != hot


def test_skew_recycles_with_unique_ids() -> None:
    groups = {
        "a": [Request(id=f"a/{i}", prompt="x") for i in range(3)],
        "b": [Request(id=f"b/{i}", prompt="y") for i in range(3)],
    }
    reqs = skew.skewed(groups, 20, seed=0, hot_fraction=0.5, hot_share=0.8)
    assert len({r.id for r in reqs}) == 20
    assert Counter(r.id.split("/")[0] for r in reqs).most_common(1)[0][1] == 16


def test_schedules() -> None:
    reqs = [Request(id=str(i), prompt="p") for i in range(8)]
    seq = schedule.sequential(reqs, nodes=4)
    assert [r.entry for r in seq] == [0, 1, 2, 3, 0, 1, 2, 3] and all(r.t is None for r in seq)
    po = schedule.poisson(reqs, nodes=4, rate=10.0, seed=1)
    times = [r.t for r in po]
    assert times[0] == 0.0 and times == sorted(times)  # type: ignore[type-var]
    pinned = schedule.round_robin([reqs[0].with_entry(3), reqs[1]], nodes=4)
    assert [r.entry for r in pinned] == [3, 1]
    big = schedule.poisson([Request(id=str(i), prompt="p") for i in range(2000)], 4, 50.0, 2)
    assert big[-1].t is not None and big[-1].t / 1999 == pytest.approx(1 / 50, rel=1e-9)


def test_random_entries_replace_every_entry_seeded_and_spread() -> None:
    reqs = [Request(id=str(i), prompt="p") for i in range(400)]
    pinned = [reqs[0].with_entry(3), *reqs[1:]]
    drawn = schedule.random_entries(pinned, nodes=4, seed=7)
    entries = [r.entry for r in drawn]
    assert entries == [r.entry for r in schedule.random_entries(pinned, nodes=4, seed=7)]
    assert entries != [r.entry for r in schedule.random_entries(pinned, nodes=4, seed=8)]
    counts = Counter(entries)
    assert set(counts) == {0, 1, 2, 3} and min(counts.values()) > 60  # uniform, roughly
    assert entries != [i % 4 for i in range(400)]
    # random entries survive the schedules (they only fill in missing ones)
    assert [r.entry for r in schedule.poisson(drawn, 4, 5.0, 1)] == entries
    assert "workload's entries" in schedule.describe(schedule.sequential(drawn, 4))["schedule_text"]
    assert "round-robin" in schedule.describe(schedule.sequential(reqs, 4))["schedule_text"]
    with pytest.raises(ValueError, match="nodes"):
        schedule.random_entries(reqs, nodes=0, seed=1)
    assert schedule.Entry.parse(" Random ") is schedule.Entry.RANDOM
    with pytest.raises(ValueError, match="given, random"):
        schedule.Entry.parse("roundrobin")


def test_build_with_random_entry_keeps_the_requests_and_redraws_entries() -> None:
    given = WorkloadSpec(requests=60, mmlu_dir=str(MMLU_DIR), seed=1)
    rand = WorkloadSpec(requests=60, mmlu_dir=str(MMLU_DIR), seed=1, entry=schedule.Entry.RANDOM)
    a, b = build(given, nodes=4), build(rand, nodes=4)
    assert [r.id for r in a] == [r.id for r in b]
    assert [r.entry for r in a] == [i % 4 for i in range(60)] != [r.entry for r in b]
    assert set(r.entry for r in b) == {0, 1, 2, 3}


@pytest.mark.parametrize("seed", range(20))
def test_poisson_offers_the_rate_asked_for_even_in_short_runs(seed: int) -> None:
    reqs = [Request(id=str(i), prompt="p") for i in range(60)]
    timed = schedule.poisson(reqs, nodes=4, rate=1.4, seed=seed)
    gaps = [b.t - a.t for a, b in itertools.pairwise(timed)]  # type: ignore[operator]
    assert schedule.describe(timed, rate=1.4)["offered_rate"] == pytest.approx(1.4, rel=1e-9)
    assert all(g >= 0 for g in gaps) and len(set(gaps)) == len(gaps)  # random, not a metronome
    assert max(gaps) > 3 * min(gaps)


def test_trace_round_trip(tmp_path: Path) -> None:
    spec = WorkloadSpec(requests=30, skewed=True, seed=2, schedule=Schedule.POISSON, rate=5.0)
    chat = Request(
        id="chat", messages=(Message("system", "s"), Message("user", "u")), max_tokens=4, t=99.0
    )
    reqs = [*build(spec, nodes=4), chat]
    path = tmp_path / "t.jsonl"
    assert trace.save(reqs, path) == 31
    back = trace.load(path)
    assert [(r.id, r.text, r.max_tokens, r.group, r.entry, r.t) for r in back] == [
        (r.id, r.text, r.max_tokens, r.group, r.entry, r.t) for r in reqs
    ]
    assert back[-1].messages == reqs[-1].messages
    replay = build(WorkloadSpec(trace=str(path), requests=None), nodes=2)
    assert [r.entry for r in replay] == [r.entry for r in reqs[:-1]] + [0]


@pytest.mark.parametrize(
    ("line", "msg"),
    [
        ("not json", "2:"),
        ('{"id": "a"}', "exactly one of prompt or messages"),
        ('{"prompt": "x", "max_tokens": "3"}', "max_tokens"),
        ('{"prompt": "x", "entry": -1}', "entry"),
        ('{"messages": [{"role": "user"}]}', "content"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_trace_errors_name_the_line(line: str, msg: str) -> None:
    text = json.dumps({"id": "ok", "prompt": "p"}) + "\n" + line + "\n"
    with pytest.raises(trace.TraceError, match=msg):
        trace.read(io.StringIO(text))


def test_trace_duplicate_ids() -> None:
    with pytest.raises(trace.TraceError, match="unique"):
        trace.read(io.StringIO('{"id": "a", "prompt": "p"}\n{"id": "a", "prompt": "q"}\n'))


def test_build_from_mmlu_dir() -> None:
    spec = WorkloadSpec(requests=100, mmlu_dir=str(MMLU_DIR), seed=1)
    reqs = build(spec, nodes=4)
    assert len(reqs) == 100 and spec.source == "mmlu"
    assert all(r.entry == i % 4 for i, r in enumerate(reqs))
    assert reqs == build(spec, nodes=4)


def test_build_filters_with_fits() -> None:
    spec = WorkloadSpec(requests=200, mmlu_dir=str(MMLU_DIR), seed=1)
    reqs = build(spec, nodes=4, fits=lambda r: len(r.text.encode()) < 4000)
    assert len(reqs) == 200 and all(len(r.text.encode()) < 4000 for r in reqs)
    groups = {r.group for r in reqs}
    assert "professional_law" not in groups and "high_school_european_history" not in groups
