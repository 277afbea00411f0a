"""bench/vllm_emulated's arithmetic: admission_s closed against the emulator's own intercept,
and the per-request comparison."""

from __future__ import annotations

from dataclasses import replace

import pytest

from radixmesh.bench.vllm_emulated import closed, compare
from radixmesh.core.profile import Profile, resolve


def _profile(admission: float) -> Profile:
    base = resolve("vllm-cpu-tiny")
    cites = {k: v for k, v in base.citations.items() if k != "admission_s"}
    if admission:
        cites["admission_s"] = "t"
    return replace(base, admission_s=admission, prefill_seq_s=0.0, citations=cites)


def test_admission_is_the_engines_intercept_less_the_emulators() -> None:
    prof = _profile(0.030)
    a_real = 0.030 + prof.step_base_s
    out = closed(prof, prof.step_base_s + 0.004, [(128, 0.02)])
    assert out.admission_s == pytest.approx(a_real - prof.step_base_s - 0.004)
    assert "the emulator's own" in out.citations["admission_s"]
    assert closed(prof, None, []).admission_s == 0.0
    assert "admission_s" not in closed(prof, None, []).citations
    assert closed(prof, a_real + 0.01, [(128, 0.2)]).admission_s == 0.0  # never negative
    Profile.from_dict(out.to_dict())  # still a valid profile


def test_compare_pairs_requests_and_counts_hits_and_tokens() -> None:
    def row(ttft: float, lat: float, cached: int) -> dict[str, object]:
        return {"ok": True, "ttft_s": ttft, "latency_s": lat, "prompt_tokens": 100,
                "cached_tokens": cached, "completion_tokens": 16}

    real = [row(0.1, 0.2, 0), row(0.2, 0.4, 50), row(0.4, 0.8, 100)]
    emu = [row(0.1, 0.1, 0), row(0.3, 0.4, 40), row(0.4, 1.6, 100)]
    c = compare(real, emu)
    assert c["paired"] == 3
    assert c["ttft_s"]["ratio_median"] == pytest.approx(1.0)
    assert c["latency_s"]["ratio_median"] == pytest.approx(1.0)
    assert c["real_hit_rate"] == pytest.approx(0.5)
    assert c["emulated_hit_rate"] == pytest.approx(140 / 300)
    assert c["real_completion_tokens"] == c["emulated_completion_tokens"] == 48
