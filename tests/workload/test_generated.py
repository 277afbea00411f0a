"""The routing issue's generated workloads: sharing structure, lengths, determinism by seed."""

from __future__ import annotations

import itertools
import statistics
from collections import Counter
from pathlib import Path

import pytest

from radixmesh.workload import Schedule, WorkloadSpec, agentic, build, chat, hotprefix, rag
from radixmesh.workload.build import generate
from radixmesh.workload.corpus import Corpus
from radixmesh.workload.generated import KINDS, interleave
from radixmesh.workload.request import Request

MMLU_DIR = Path("/work/shared/data/mmlu")
needs_mmlu = pytest.mark.skipif(not MMLU_DIR.is_dir(), reason="no MMLU copy on this machine")
WORDS = Corpus.words()


@pytest.mark.parametrize("kind", KINDS)
def test_deterministic_by_seed_exact_count_unique_ids(kind: str) -> None:
    a = generate(kind, 60, seed=5, corpus=WORDS, scale=0.5, nodes=4)
    b = generate(kind, 60, seed=5, corpus=WORDS, scale=0.5, nodes=4)
    c = generate(kind, 60, seed=6, corpus=WORDS, scale=0.5, nodes=4)
    assert a == b
    assert [r.text for r in a] != [r.text for r in c]
    assert len(a) == 60 and len({r.id for r in a}) == 60
    assert all(r.group and r.prefix_chars and 0 < r.prefix_chars < len(r.text) for r in a)


@pytest.mark.parametrize("kind", KINDS)
def test_scale_multiplies_lengths_and_scale_1_fits_the_tiny_context(kind: str) -> None:
    full = [len(r.text) for r in generate(kind, 80, seed=1, corpus=WORDS, scale=1.0, nodes=4)]
    small = [len(r.text) for r in generate(kind, 80, seed=1, corpus=WORDS, scale=0.3, nodes=4)]
    assert statistics.mean(small) < 0.55 * statistics.mean(full)
    assert max(full) < 3900  # byte tokens + chat template stay inside 4,096 with room to answer
    assert statistics.mean(full) > 1200


def test_chat_turns_resend_the_growing_history() -> None:
    reqs = chat.requests(300, seed=2, corpus=WORDS, scale=1.0, nodes=4)
    by_conv: dict[str, list[Request]] = {}
    for r in reqs:
        by_conv.setdefault(r.group or "", []).append(r)
    assert len(by_conv) >= 20
    for turns in by_conv.values():
        for k, (prev, cur) in enumerate(itertools.pairwise(turns), start=1):
            assert cur.id.endswith(f"/t{k}")
            assert prev.messages is not None and cur.messages is not None
            # the new prompt = the previous prompt + that turn's answer + a new user message
            assert cur.messages[: len(prev.messages)] == prev.messages
            assert [m.role for m in cur.messages[len(prev.messages) :]] == ["assistant", "user"]
            assert cur.prefix_chars == sum(len(m.content) for m in cur.messages[:-1])
            assert cur.after == prev.id  # sent once the previous turn was answered
        assert turns[0].after is None
    # one system preamble shared by every conversation, shorter than any conversation
    systems = {r.messages[0] for r in reqs if r.messages}
    assert len(systems) == 1 and next(iter(systems)).role == "system"
    # conversations interleave, entries are random over the nodes
    assert len({r.group for r in reqs[:12]}) >= 4
    entries = Counter(r.entry for r in reqs)
    assert set(entries) == {0, 1, 2, 3} and max(entries.values()) < 0.4 * len(reqs)
    first = by_conv[reqs[0].group or ""]
    assert len({r.entry for r in first}) > 1 or len(first) == 1
    assert all(sum(len(m.content) for m in r.messages or ()) <= chat.MAX_CHARS for r in reqs)


def test_rag_documents_zipf_popular_questions_short() -> None:
    reqs = rag.requests(2000, seed=3, corpus=WORDS, scale=1.0)
    docs = Counter(r.group for r in reqs)
    assert len(docs) <= rag.DOCUMENTS and len(docs) >= 24  # a few dozen documents
    counts = sorted(docs.values(), reverse=True)
    weights = rag.zipf_weights(rag.DOCUMENTS)
    assert counts[0] / len(reqs) == pytest.approx(weights[0], abs=0.04)  # ~22 % on the top one
    assert counts[0] > 8 * statistics.median(counts[len(counts) // 2 :])
    for r in reqs[:200]:
        assert r.prompt is not None and r.prompt.startswith(rag.HEADER)
        assert r.prefix_chars is not None and r.prompt[: r.prefix_chars].endswith("Question: ")
        assert len(r.prompt) - r.prefix_chars < 0.2 * len(r.prompt)  # short question
    # one document = one prefix, whatever the question
    same = [r for r in reqs if r.group == reqs[0].group][:5]
    assert len({(r.prompt or "")[: r.prefix_chars] for r in same}) == 1
    assert len({r.prompt for r in same}) == len(same)


def test_agentic_one_system_prompt_and_growing_scratchpads() -> None:
    reqs = agentic.requests(300, seed=4, corpus=WORDS, scale=1.0)
    system = agentic.system_prompt(4, WORDS, 1.0)
    assert len(system) > 1200 and all((r.prompt or "").startswith(system) for r in reqs)
    assert all(r.prefix_chars == len(system) for r in reqs)
    tasks: dict[str, list[Request]] = {}
    for r in reqs:
        tasks.setdefault(r.group or "", []).append(r)
    assert len(tasks) >= 30 and len({r.group for r in reqs[:12]}) >= 4
    grew = 0
    for steps in tasks.values():
        for prev, cur in itertools.pairwise(steps):
            head = (prev.prompt or "").removesuffix("Thought:")
            assert (cur.prompt or "").startswith(head) and len(cur.prompt or "") > len(head)
            assert "\nObservation: " in (cur.prompt or "")[len(head) :]
            assert cur.after == prev.id  # the next step once this one's tool answered
            grew += 1
        assert steps[0].after is None
    assert grew > 100
    assert all(len(r.prompt or "") <= agentic.MAX_CHARS for r in reqs)


def test_hot_prefix_one_prefix_for_everything() -> None:
    reqs = hotprefix.requests(200, seed=0, corpus=WORDS, scale=1.0)
    assert {r.group for r in reqs} == {"hot"}
    cut = reqs[0].prefix_chars or 0
    assert cut > 1500 and len({(r.prompt or "")[:cut] for r in reqs}) == 1
    assert len({r.prompt for r in reqs}) == 200
    assert all((r.prompt or "").endswith("\nAnswer:") for r in reqs)


@needs_mmlu
def test_mmlu_corpus_gives_real_text_and_a_real_hot_subject() -> None:
    corpus = Corpus.from_mmlu(MMLU_DIR)
    assert corpus.name == "mmlu" and len(corpus.passages) == 14042
    import random

    text = corpus.text(random.Random(0), 500)
    assert 400 < len(text) <= 500 and text.split()[0] in " ".join(corpus.passages)
    reqs = hotprefix.requests(300, seed=1, corpus=corpus, scale=1.0)
    prefix = (reqs[0].prompt or "")[: reqs[0].prefix_chars]
    subject = next(s for s in corpus.subjects if s.prefix == prefix)
    assert prefix.startswith("The following are multiple choice questions")
    assert abs(len(subject.prefix) - hotprefix.PREFIX_CHARS) < 600
    # the questions come from many subjects, behind the one prefix
    stems = {(r.prompt or "")[len(prefix) :].split("\n")[0] for r in reqs}
    assert len(stems) > 280 and len({r.prompt for r in reqs}) == 300


@needs_mmlu
def test_build_with_mmlu_dir_uses_its_text() -> None:
    reqs = build(WorkloadSpec(kind="rag", requests=50, mmlu_dir=str(MMLU_DIR)), nodes=4)
    words = build(WorkloadSpec(kind="rag", requests=50), nodes=4)
    assert len(reqs) == len(words) == 50
    assert reqs[0].text != words[0].text and "the" in reqs[0].text.split()


def test_workload_spec_builds_generated_kinds_with_schedule_and_admission() -> None:
    w = WorkloadSpec(kind="chat", requests=40, seed=1, synthetic_scale=0.5)
    reqs = build(w, nodes=3)
    assert len(reqs) == 40 and all(r.entry in (0, 1, 2) and r.t is None for r in reqs)
    assert w.source == "chat" and w.generated
    agent = build(WorkloadSpec(kind="agentic", requests=8), nodes=2)
    assert [r.entry for r in agent] == [0, 1] * 4  # round-robin as in the paper's schedule
    timed = build(WorkloadSpec(kind="rag", requests=20, rate=5.0, schedule=Schedule.POISSON), 2)
    assert all(r.t is not None for r in timed)
    # --load: untimed until the runner measured the capacity
    loaded = build(WorkloadSpec(kind="hotprefix", requests=10, load=0.5), nodes=2)
    assert all(r.t is None for r in loaded)
    short = build(WorkloadSpec(kind="rag", requests=30), nodes=2, fits=lambda r: len(r.text) < 2600)
    assert 0 < len(short) < 30  # admission drops what does not fit


def test_workload_spec_rejects_what_a_generated_workload_cannot_do() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        WorkloadSpec(kind="nope")
    with pytest.raises(ValueError, match="no skew"):
        WorkloadSpec(kind="rag", skewed=True)
    with pytest.raises(ValueError, match="request count"):
        WorkloadSpec(kind="chat", requests=None)
    with pytest.raises(ValueError, match="fraction"):
        WorkloadSpec(load=0.5, rate=2.0)
    with pytest.raises(ValueError, match="scale"):
        generate("chat", 5, 0, WORDS, scale=0)


def test_interleave_keeps_session_order_and_replaces_finished_sessions() -> None:
    import random

    def session(i: int):  # type: ignore[no-untyped-def]
        for k in range(i % 3 + 1):
            yield Request(id=f"s{i}/{k}", prompt="x", group=f"s{i}")

    out = interleave(session, 50, width=4, rng=random.Random(0))
    assert len(out) == 50
    seen: dict[str, int] = {}
    for r in out:
        g, k = r.id.split("/")
        assert int(k) == seen.get(g, -1) + 1
        seen[g] = int(k)
    assert len(seen) > 20


@pytest.mark.parametrize("scale", [0.25, 1.0])
def test_sessions_still_grow_at_small_scales(scale: float) -> None:
    steps = Counter(r.group for r in agentic.requests(200, seed=0, corpus=WORDS, scale=scale))
    turns = Counter(r.group for r in chat.requests(200, seed=0, corpus=WORDS, scale=scale))
    assert statistics.mean(steps.values()) >= 2.5  # scratchpads grow step by step
    assert statistics.mean(turns.values()) >= 3.0  # histories grow turn by turn
