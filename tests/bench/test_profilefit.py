"""Fitting step-time profiles: least squares against known coefficients, the built-in engine's
cost-model fit as a profile, and ``calibrate --engine-url`` against the fake vLLM (plumbing)."""

from __future__ import annotations

import argparse
import asyncio
import queue
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixmesh.bench import calibrate
from radixmesh.bench.engine_calibrate import measure
from radixmesh.bench.profilefit import (
    fit_decode,
    fit_prefill,
    from_builtin_fit,
    from_engine_points,
    nonneg_lstsq,
)
from radixmesh.core.profile import Profile, dumps, resolve
from radixmesh.emulate.fake import running
from radixmesh.sim import costs

coef = st.floats(0, 10, allow_nan=False, allow_subnormal=False)


@given(st.lists(coef, min_size=3, max_size=3))
def test_nonneg_lstsq_recovers_exact_nonnegative_coefficients(true: list[float]) -> None:
    xs = [1.0, 2.0, 3.0, 5.0, 8.0]
    cols = [[1.0] * 5, xs, [x * x for x in xs]]
    y = [sum(c * col[i] for c, col in zip(true, cols, strict=True)) for i in range(5)]
    got = nonneg_lstsq(cols, y)
    assert got == pytest.approx(true, abs=1e-6 * (1 + max(true)))


@given(st.lists(st.floats(-5, 5, allow_subnormal=False), min_size=5, max_size=5))
def test_nonneg_lstsq_never_returns_a_negative(y: list[float]) -> None:
    xs = [1.0, 2.0, 3.0, 5.0, 8.0]
    assert min(nonneg_lstsq([[1.0] * 5, xs], y)) >= 0


@pytest.mark.parametrize("name", ["h100-llama3-8b", "a10g-llama3-8b"])
def test_fits_recover_a_profile_from_its_own_predictions(name: str) -> None:
    p = resolve(name)
    prefill = [(n, p.ttft_s(n)) for n in (128, 512, 2048, 4096)]
    decode = [(b, c, p.tpot_s(b, c)) for b in (1, 4, 16) for c in (100, 2000)]
    _, pt, pa = fit_prefill(prefill)
    base, ds, dk = fit_decode(decode)
    assert (pt, pa) == pytest.approx((p.prefill_token_s, p.prefill_attn_s), rel=1e-6)
    assert (base, ds, dk) == pytest.approx((p.step_base_s, p.decode_seq_s, p.decode_kv_s), rel=1e-6)
    texts = {"name": "x", "hardware": "h", "model": "m", "source": "synthetic"}
    caps = {
        n: getattr(p, n)
        for n in ("kv_blocks", "block_size", "context_length", "max_running", "step_tokens")
    }
    fitted = from_engine_points(prefill, decode, texts=texts, capacities=caps)
    assert all(c.tolerance == 0.05 for c in fitted.checks)  # exact data: the floor
    assert fitted.admission_s == pytest.approx(0.0, abs=1e-9)


def test_the_ttft_intercept_beyond_a_step_is_fitted_as_admission() -> None:
    """TTFTs that carry a fixed per-request time give it back as admission_s (cited), and
    leave the step coefficients as they were."""
    base = resolve("a10g-llama3-8b")
    p = replace(base, admission_s=0.031, citations={**base.citations, "admission_s": "t"})
    prefill = [(n, p.ttft_s(n)) for n in (128, 512, 2048, 4096)]
    decode = [(b, c, p.tpot_s(b, c)) for b in (1, 4, 16) for c in (100, 2000)]
    texts = {"name": "x", "hardware": "h", "model": "m", "source": "synthetic"}
    caps = {n: getattr(p, n) for n in ("kv_blocks", "block_size", "context_length",
                                       "max_running", "step_tokens")}
    fitted = from_engine_points(prefill, decode, texts=texts, capacities=caps)
    assert fitted.admission_s == pytest.approx(0.031, rel=1e-6)
    assert fitted.step_base_s == pytest.approx(p.step_base_s, rel=1e-6)
    assert "intercept" in fitted.citations["admission_s"]
    assert all(c.tolerance == 0.05 for c in fitted.checks)  # ttft checks include it


def test_builtin_fit_profile_times_requests_as_the_cost_model() -> None:
    doc = {
        "name": "calibrated:tiny:cpu",
        "source": "a test",
        "prefill_overhead_s": 0.0028,
        "prefill_s_per_token": 1.6e-4,
        "context_scale": 2900.0,
        "decode_s_per_token": 0.008,
        "measurements": {"prefill": [{"uncached": 512, "cached": 0, "prefill_s": 0.095}]},
    }
    prof = from_builtin_fit(doc, context_length=4096, kv_blocks=2048)
    model = costs.from_profile(prof, decode_context=80)
    for u, c in ((10, 0), (512, 0), (300, 1000)):
        assert model.prefill_s(u, c) == pytest.approx(
            costs.CostModel.from_dict(
                {k: v for k, v in doc.items() if k != "measurements"}
            ).prefill_s(u, c)
        )
    assert prof.tpot_s(1, 80) == pytest.approx(0.008)
    assert [c.tokens for c in prof.checks if c.metric == "ttft"] == [512]


def _engine_args(url: str, out: Path) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    return parser.parse_args(
        [
            "--engine-url",
            url,
            "--lengths",
            "32,128,512",
            "--repeats",
            "1",
            "--decode-tokens",
            "6",
            "--batches",
            "1,3",
            "--timeout",
            "30",
            "--profile-out",
            str(out),
            "--quiet",
        ]
    )


def test_engine_url_plumbing_against_the_fake_vllm(tmp_path: Path) -> None:
    async def scenario() -> tuple[object, list[object], list[object], int]:
        async with running(cache_tokens=8192) as fake:
            fake.faults.token_delay_s = 0.002
            facts, prefill, decode = await measure(_engine_args(fake.url, tmp_path / "p.toml"))
            return facts, prefill, decode, fake.peak_active

    facts, prefill, decode, peak = asyncio.run(scenario())
    # the fake's /v1/models card carries max_model_len, as vLLM's does
    assert facts == {"model": "fake-model", "context_length": 8192}
    assert [n for n, _ in prefill] == [32, 128, 512]  # type: ignore[misc]
    assert [(b, c) for b, c, _ in decode] == [(1, 67), (3, 67)]  # type: ignore[misc]
    assert peak == 3  # the batch-3 streams ran concurrently
    texts = {"name": "fake", "hardware": "none", "model": "fake-model", "source": "test"}
    caps = {
        "kv_blocks": 512,
        "block_size": 16,
        "context_length": 4096,
        "max_running": 8,
        "step_tokens": 4096,
    }
    prof = from_engine_points(prefill, decode, texts=texts, capacities=caps)  # type: ignore[arg-type]
    assert prof.step_base_s > 0 and len(prof.checks) == 5
    assert Profile.loads(dumps(prof)) == prof


def test_engine_url_unreachable_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _engine_args("http://127.0.0.1:9", tmp_path / "p.toml")
    assert calibrate.run(args) == 2
    assert "radixmesh calibrate:" in capsys.readouterr().err
    assert not (tmp_path / "p.toml").exists()


def test_calibrate_engine_url_writes_a_loadable_profile(tmp_path: Path) -> None:
    """The whole command against the fake vLLM served from another thread's event loop."""
    ready: queue.Queue[str] = queue.Queue()
    stop = threading.Event()

    async def serve() -> None:
        async with running(cache_tokens=8192) as fake:
            fake.faults.token_delay_s = 0.002
            ready.put(fake.url)
            await asyncio.to_thread(stop.wait)  # until the test is done with it

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    try:
        out = tmp_path / "fake.toml"
        assert calibrate.run(_engine_args(ready.get(timeout=30), out)) == 0
    finally:
        stop.set()
        thread.join(timeout=30)
    prof = Profile.load(out)
    assert prof.model == "fake-model" and prof.name == "calibrated-fake-model"
    assert {c.metric for c in prof.checks} == {"ttft", "tpot"}
    assert "--engine-url" in prof.citations["step_base_s"]


def test_profile_out_refused_with_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    args = parser.parse_args(
        ["--from-records", str(tmp_path / "r.jsonl"), "--profile-out", str(tmp_path / "p.toml")]
    )
    assert calibrate.run(args) == 2
    assert "--profile-out" in capsys.readouterr().err


def test_the_engines_own_prefill_times_split_the_intercept() -> None:
    """With the engine's prefill times (step start to first token), the intercept's part
    inside the step is prefill_seq_s and the rest admission_s; both reproduce the TTFTs."""
    base = resolve("a10g-llama3-8b")
    p = replace(base, admission_s=0.02, prefill_seq_s=0.009,
                citations={**base.citations, "admission_s": "t", "prefill_seq_s": "t"})
    lengths = (128, 512, 2048, 4096)
    prefill = [(n, p.ttft_s(n)) for n in lengths]
    inside = [(n, p.ttft_s(n) - p.admission_s) for n in lengths]
    decode = [(b, c, p.tpot_s(b, c)) for b in (1, 4, 16) for c in (100, 2000)]
    texts = {"name": "x", "hardware": "h", "model": "m", "source": "synthetic"}
    caps = {n: getattr(p, n) for n in ("kv_blocks", "block_size", "context_length",
                                       "max_running", "step_tokens")}
    fitted = from_engine_points(prefill, decode, texts=texts, capacities=caps,
                                engine_prefill=inside)
    assert fitted.prefill_seq_s == pytest.approx(0.009, rel=1e-6)
    assert fitted.admission_s == pytest.approx(0.02, rel=1e-6)
    assert "vllm:request_prefill_time_seconds" in fitted.citations["prefill_seq_s"]
    for n, s in prefill:
        assert fitted.ttft_s(n) == pytest.approx(s, rel=1e-6)
