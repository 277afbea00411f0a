"""The engine micro-benchmark runs end to end and reports consistent figures (no timing asserts)."""

from __future__ import annotations

import pytest

from radixmesh.bench import micro_engine


def test_micro_engine_reports_every_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXMESH_BENCH_PRESET", "micro")
    out = micro_engine.run(quick=True)
    for key in ("prefill_s_0", "prefill_s_50", "prefill_s_85", "decode_s_per_token"):
        assert isinstance(out[key], float) and out[key] > 0
    assert out["prefill_ratio_85"] == pytest.approx(out["prefill_s_85"] / out["prefill_s_0"], 1e-2)
    assert out["kv_bytes_per_token"] == out["kv_bytes_per_token_stored"] == 2 * 2 * 2 * 16 * 4
    assert out["max_abs_logit_diff_85"] < 1e-4
    assert 0 < out["engine_shared_prefix_tokens"] < out["engine_prompt_tokens"]
