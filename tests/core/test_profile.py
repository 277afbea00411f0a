"""Step-time profiles: the formula against a reference, the TOML format, validation, the shipped
profiles against the published figures they cite, and ``radixmesh profile``."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixmesh.cli import main as cli_main
from radixmesh.core.profile import (
    CAPACITIES,
    COEFFICIENTS,
    OPTIONAL_TIMES,
    Check,
    Profile,
    dumps,
    resolve,
    shipped,
)
from radixmesh.core.scheduler import Scheduler

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = {"cpu-tiny", "h100-llama3-8b", "a100-llama3-8b", "a10g-llama3-8b", "h100-qwen2.5-0.5b",
            "vllm-cpu-tiny"}


@dataclass(frozen=True)
class Chunk:
    seq: int
    start: int
    tokens: int
    last: bool = False


@dataclass(frozen=True)
class Slot:
    seq: int
    context: int


@dataclass(frozen=True)
class FakeStep:  # the scheduler's Step, as far as step_s reads it
    prefills: tuple[Chunk, ...]
    decodes: tuple[Slot, ...]


def _base(**changes: Any) -> dict[str, Any]:
    data = resolve("h100-llama3-8b").to_dict()
    data.update(changes)
    return data


# ------------------------------------------------------------------------------- step time
chunks = st.builds(Chunk, st.integers(0, 99), st.integers(0, 50_000), st.integers(1, 8192))
slots = st.builds(Slot, st.integers(0, 99), st.integers(0, 130_000))
steps = st.builds(
    FakeStep, st.lists(chunks, max_size=4).map(tuple), st.lists(slots, max_size=64).map(tuple)
)


@given(steps)
def test_step_s_matches_the_documented_formula(step: FakeStep) -> None:
    p = resolve("h100-llama3-8b")
    # reference: each prefill token at position i attends to i + 1 keys -> sum = t*(s + t/2) + t/2
    attn = sum(c.tokens * (c.start + c.tokens / 2) for c in step.prefills)
    expected = (
        p.step_base_s
        + p.prefill_token_s * sum(c.tokens for c in step.prefills)
        + p.prefill_attn_s * attn
        + p.decode_seq_s * len(step.decodes)
        + p.decode_kv_s * sum(d.context for d in step.decodes)
    )
    assert p.step_s(step) == pytest.approx(expected, rel=1e-12)


@given(steps, chunks, slots)
def test_more_work_never_takes_less_time(step: FakeStep, chunk: Chunk, slot: Slot) -> None:
    for name in sorted(EXPECTED):
        p = resolve(name)
        t = p.step_s(step)
        assert t >= p.step_base_s > 0
        assert p.step_s(replace(step, prefills=(*step.prefills, chunk))) > t
        assert p.step_s(replace(step, decodes=(*step.decodes, slot))) > t
        longer = replace(slot, context=slot.context + 1000)
        assert p.step_s(replace(step, decodes=(*step.decodes, longer))) >= p.step_s(
            replace(step, decodes=(*step.decodes, slot))
        )


def test_ttft_is_chunked_by_step_tokens_and_shortened_by_cache() -> None:
    p = replace(resolve("h100-llama3-8b"), step_tokens=1000)
    chunks_ = [FakeStep((Chunk(0, s, min(1000, 2500 - s)),), ()) for s in (0, 1000, 2000)]
    assert p.ttft_s(2500) == pytest.approx(sum(p.step_s(c) for c in chunks_))
    assert p.ttft_s(2500, cached=2000) == pytest.approx(p.step_s(chunks_[2]))
    assert p.ttft_s(2500, cached=2500) == 0.0


# ------------------------------------------------------------------------- shipped profiles
def test_shipped_names() -> None:
    assert set(shipped()) == EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_field_cites_a_figure_or_its_derivation(name: str) -> None:
    p = resolve(name)
    optional = {n for n in OPTIONAL_TIMES if getattr(p, n)}  # cited when not 0
    assert set(p.citations) == set(COEFFICIENTS) | set(CAPACITIES) | optional
    for field_name, text in p.citations.items():
        assert any(ch.isdigit() for ch in text), f"{name}.{field_name}: no figure in {text!r}"
    assert p.checks, f"{name} cites no published figure to check against"
    assert p.derived == (name == "h100-qwen2.5-0.5b")
    if p.derived:
        assert all(p.citations[c].startswith("derived") for c in COEFFICIENTS)


@pytest.mark.parametrize(
    ("name", "index"),
    [(n, i) for n in sorted(EXPECTED) for i in range(len(resolve(n).checks))],
)
def test_predictions_within_tolerance_of_the_cited_figures(name: str, index: int) -> None:
    p = resolve(name)
    check = p.checks[index]
    predicted = p.predicted_s(check)
    error = predicted / check.published_s - 1
    assert abs(error) <= check.tolerance, f"{name}: {check} predicted {predicted:.4g} s"


def test_the_gpu_profiles_order_as_the_hardware_does() -> None:
    # the same model: H100 faster than A100 faster than A10G, at prefill and at decode
    h100, a100, a10g = (resolve(f"{g}-llama3-8b") for g in ("h100", "a100", "a10g"))
    assert h100.ttft_s(4096) < a100.ttft_s(4096) < a10g.ttft_s(4096)
    assert h100.tpot_s(16, 1024) < a100.tpot_s(16, 1024) < a10g.tpot_s(16, 1024)
    assert resolve("h100-qwen2.5-0.5b").tpot_s(16, 1024) < h100.tpot_s(16, 1024)


def test_profiles_are_package_data() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["radixmesh.profiles"]
    folder = ROOT / "src" / "radixmesh" / "profiles"
    assert (folder / "__init__.py").exists()
    listed = {p.name for pat in patterns for p in folder.glob(pat)}
    assert listed == {p.name for p in folder.glob("*.toml")} == {f"{n}.toml" for n in EXPECTED}


# ------------------------------------------------------------------------------- TOML format
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_dumps_round_trips(name: str, tmp_path: Path) -> None:
    p = resolve(name)
    path = tmp_path / "p.toml"
    path.write_text(dumps(p))
    assert Profile.load(path) == p
    assert resolve(str(path)) == p


@given(
    st.lists(st.floats(0, 1, allow_subnormal=False), min_size=5, max_size=5),
    st.text(min_size=1, max_size=20).filter(str.strip),
)
def test_dumps_round_trips_any_values(values: list[float], text: str) -> None:
    p = resolve("cpu-tiny")
    coeffs = dict(zip(COEFFICIENTS, values, strict=True))
    coeffs["step_base_s"] += 1e-6
    q = replace(p, name=text, source=text, **coeffs)
    assert Profile.loads(dumps(q)) == q


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"step_base_s": None}, "step_base_s"),  # None: the key is removed
        ({"decode_kv_s": None}, "decode_kv_s"),
        ({"kv_blocks": None}, "kv_blocks"),
        ({"colour": "blue"}, "colour"),
        ({"prefill_token_s": -1e-6}, "prefill_token_s"),
        ({"step_base_s": 0.0}, "step_base_s"),
        ({"decode_seq_s": "fast"}, "decode_seq_s"),
        ({"decode_seq_s": float("nan")}, "decode_seq_s"),
        ({"kv_blocks": 0}, "kv_blocks"),
        ({"kv_blocks": 100}, "kv_blocks"),  # 1,600 tokens < one 131,072-token context
        ({"kv_blocks": 2.5}, "kv_blocks"),
        ({"step_tokens": 0}, "step_tokens"),
        ({"max_running": 0}, "max_running"),
        ({"block_size": True}, "block_size"),
        ({"context_length": 8, "block_size": 16}, "context_length"),
        ({"derived": "no"}, "derived"),
        ({"name": ""}, "name"),
        ({"citations": {"prefill_attn_s": "x 1"}}, "step_base_s"),  # coefficients uncited
        ({"admission_s": -0.01}, "admission_s"),
        ({"admission_s": float("inf")}, "admission_s"),
        ({"admission_s": "slow"}, "admission_s"),
        ({"admission_s": True}, "admission_s"),
        ({"admission_s": 0.03}, "admission_s"),  # not 0 and uncited
        ({"prefill_seq_s": -1e-3}, "prefill_seq_s"),
        ({"prefill_seq_s": float("nan")}, "prefill_seq_s"),
        ({"prefill_seq_s": [1]}, "prefill_seq_s"),
        ({"prefill_seq_s": 0.01}, "prefill_seq_s"),  # not 0 and uncited
        ({"cache_rule": "lru"}, "cache_rule"),
        ({"cache_rule": 1}, "cache_rule"),
        ({"prefix_aware": "no"}, "prefix_aware"),
        ({"checks": [{"metric": "tpot", "published_s": 0.01, "source": "s"}]}, "tolerance"),
        (
            {"checks": [{"metric": "itl", "published_s": 0.01, "tolerance": 0.1, "source": "s"}]},
            "metric",
        ),
    ],
)
def test_bad_profiles_are_refused_naming_the_field(changes: dict[str, Any], field: str) -> None:
    data = _base()
    for key, value in changes.items():
        if value is None:
            del data[key]
        else:
            data[key] = value
    with pytest.raises(ValueError, match=field):
        Profile.from_dict(data)


def test_unknown_citation_and_bad_toml(tmp_path: Path) -> None:
    data = _base()
    data["citations"] = {**data["citations"], "speed": "1"}
    with pytest.raises(ValueError, match="speed"):
        Profile.from_dict(data)
    path = tmp_path / "bad.toml"
    path.write_text("name = \n")
    with pytest.raises(ValueError, match=r"bad\.toml"):
        resolve(str(path))
    with pytest.raises(ValueError, match="neither shipped"):
        resolve(str(tmp_path / "missing.toml"))


# ---------------------------------------------------------------------------- admission_s
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_admission_0_leaves_every_prediction_as_before(name: str) -> None:
    """A profile without the field reads it as 0, writes it not at all, and predicts what the
    formula without it does; with it, a TTFT is that much later and no step is."""
    p = resolve(name)
    optional = ("admission_s", "prefill_seq_s")
    # a profile that has them: as it would be without
    p = replace(p, admission_s=0.0, prefill_seq_s=0.0,
                citations={k: v for k, v in p.citations.items() if k not in optional})
    assert not any(name in dumps(p) for name in optional)
    step = FakeStep((Chunk(1, 100, 700),), (Slot(2, 900),) * 3)
    for prompt, cached in ((1, 0), (700, 0), (p.context_length, 128)):
        alone = sum(p.step_s(FakeStep((c,), ())) for c in _chunks(p, prompt, cached))
        assert p.ttft_s(prompt, cached) == pytest.approx(alone, rel=1e-12)
    q = replace(p, admission_s=0.031, citations={**p.citations, "admission_s": "measured"})
    assert q.step_s(step) == p.step_s(step)
    assert q.tpot_s(4, 512) == p.tpot_s(4, 512)
    assert q.ttft_s(700, 0) == pytest.approx(p.ttft_s(700, 0) + 0.031, rel=1e-12)
    assert Profile.loads(dumps(q)) == q and "admission_s = 0.031" in dumps(q)


@given(steps, st.floats(0, 0.1, allow_subnormal=False))
def test_prefill_seq_s_adds_once_per_prefill_chunk_and_nothing_else(step: FakeStep,
                                                                     extra: float) -> None:
    p = resolve("a10g-llama3-8b")
    cites = {**p.citations, "prefill_seq_s": "t"} if extra else p.citations
    q = replace(p, prefill_seq_s=extra, citations=cites)
    assert q.step_s(step) == pytest.approx(p.step_s(step) + extra * len(step.prefills),
                                           rel=1e-12, abs=1e-15)
    assert q.tpot_s(8, 300) == p.tpot_s(8, 300)
    chunks = -(-3000 // p.step_tokens)
    assert q.ttft_s(3000) == pytest.approx(p.ttft_s(3000) + extra * chunks, rel=1e-12)
    if extra:
        assert Profile.loads(dumps(q)) == q
    else:
        assert "prefill_seq_s" not in dumps(q)


def _chunks(p: Profile, prompt: int, cached: int) -> list[Chunk]:
    out, start = [], cached
    while start < prompt:
        tokens = min(p.step_tokens, prompt - start)
        out.append(Chunk(1, start, tokens))
        start += tokens
    return out


def test_check_validation() -> None:
    with pytest.raises(ValueError, match="tokens"):
        Check("ttft", 0.1, 0.1, "s")
    with pytest.raises(ValueError, match="tolerance"):
        Check("tpot", 0.1, 0.0, "s")


# ------------------------------------------------------------------------------------- CLI
def test_cli_show_prints_predictions(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["profile", "show", "h100-llama3-8b", "--context", "512"]) == 0
    out = capsys.readouterr().out
    p = resolve("h100-llama3-8b")
    assert f"4k {p.ttft_s(4096) * 1e3:,.1f} ms" in out
    assert f"batch 16 {p.tpot_s(16, 512) * 1e3:,.2f} ms" in out
    assert "OUTSIDE" not in out and out.count(": ok)") == len(p.checks)


def test_cli_list_and_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli_main(["profile", "list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in EXPECTED) and "(derived)" in out
    path = tmp_path / "mine.toml"
    path.write_text(dumps(replace(resolve("cpu-tiny"), name="mine")))
    assert cli_main(["profile", "show", str(path)]) == 0
    assert "mine:" in capsys.readouterr().out
    assert cli_main(["profile", "show", "no-such-profile"]) == 2
    assert "neither shipped" in capsys.readouterr().err


# ------------------------------------------------------------------------ with the scheduler
def test_with_the_scheduler_step_and_config() -> None:
    p = resolve("a10g-llama3-8b")
    config = p.scheduler_config(max_overtake=3)
    assert (config.block_size, config.kv_blocks, config.max_running, config.step_tokens) == (
        p.block_size,
        p.kv_blocks,
        p.max_running,
        p.step_tokens,
    )
    assert config.max_overtake == 3
    scheduler = Scheduler(config)
    scheduler.add(1, list(range(100, 700)), 4, 0.0)
    first = scheduler.schedule(0.0)  # the whole 600-token prompt in one chunk
    assert p.step_s(first) == pytest.approx(p.ttft_s(600))
    scheduler.complete(first, {s: 7 for s in first.emitting}, 0.0)
    second = scheduler.schedule(1.0)  # one decode attending to the prompt and its first token
    assert p.step_s(second) == pytest.approx(p.tpot_s(1, 601))


def test_scheduler_rules_reach_the_scheduler_and_round_trip() -> None:
    # vllm-cpu-tiny emulates vLLM 0.32: its caching rule, no "pioneers first", and the 47
    # blocks vLLM can use of the 48 it was started with (one is its null block).
    p = resolve("vllm-cpu-tiny")
    config = p.scheduler_config()
    assert (config.cache_rule, config.prefix_aware, config.kv_blocks) == ("vllm", False, 47)
    assert Profile.loads(dumps(p)) == p
    # the defaults are left out of the file and read back as the defaults
    gpu = resolve("h100-llama3-8b")
    assert (gpu.cache_rule, gpu.prefix_aware) == ("radix", True)
    assert "cache_rule" not in dumps(gpu) and "prefix_aware" not in dumps(gpu)
