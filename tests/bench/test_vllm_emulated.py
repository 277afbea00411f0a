"""bench/vllm_emulated's arithmetic: admission_s closed against the emulator's own intercept,
and the per-request comparison."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from radixmesh.bench import vllm_emulated
from radixmesh.bench.vllm_emulated import closed, compare
from radixmesh.core.profile import Profile, dumps, resolve


def _profile(admission: float) -> Profile:
    base = resolve("vllm-cpu-tiny")
    cites = {k: v for k, v in base.citations.items() if k != "admission_s"}
    if admission:
        cites["admission_s"] = "t"
    return replace(base, admission_s=admission, prefill_seq_s=0.0, citations=cites)


def test_admission_is_the_engines_intercept_less_the_emulators() -> None:
    prof = _profile(0.030)
    a_real = 0.030 + prof.step_base_s
    assert vllm_emulated.intercept(prof) == pytest.approx(a_real)
    out = closed(prof, a_real, prof.step_base_s + 0.004, [(128, 0.02)])
    assert out.admission_s == pytest.approx(a_real - prof.step_base_s - 0.004)
    assert "the emulator's own" in out.citations["admission_s"]
    assert closed(prof, a_real, None, []).admission_s == 0.0
    assert "admission_s" not in closed(prof, a_real, None, []).citations
    assert closed(prof, a_real, a_real + 0.01, [(128, 0.2)]).admission_s == 0.0  # never < 0
    Profile.from_dict(out.to_dict())  # still a valid profile
    # its own admission_s is not read: closing the result again changes nothing
    assert closed(out, a_real, prof.step_base_s + 0.004, [(128, 0.02)]) == out


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


def test_closing_twice_gives_the_profile_closing_once_gave(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # close_admission measures the emulator (stubbed: its intercept is 4 ms above step_base_s)
    # and closes the calibration; a second run must not subtract the emulator's own twice
    calibrated = _profile(0.030)
    emu_points = [(n, calibrated.step_base_s + 0.004 + 1e-5 * n) for n in (128, 512, 2048)]

    @contextlib.contextmanager
    def stub_emulator(profile: Path, model_dir: Path, out: Path) -> Iterator[str]:
        assert Profile.load(profile).admission_s == 0.0  # probed without admission
        yield "http://emulator"

    async def stub_points(*args: object) -> list[tuple[int, float]]:
        return emu_points

    monkeypatch.setattr(vllm_emulated, "emulator", stub_emulator)
    monkeypatch.setattr(vllm_emulated, "prefill_points", stub_points)
    path = tmp_path / "vllm-cpu-tiny.calibrated.toml"
    path.write_text(dumps(calibrated), encoding="utf-8")
    first = Profile.load(vllm_emulated.close_admission(path, tmp_path, tmp_path, 400))
    again = Profile.load(vllm_emulated.close_admission(path, tmp_path, tmp_path, 400))
    assert first.admission_s == pytest.approx(0.030 - 0.004, abs=1e-9)
    assert again == first
    assert Profile.load(path) == calibrated  # the calibration stays as it was
    with pytest.raises(ValueError, match="calibration"):
        vllm_emulated.close_admission(tmp_path / vllm_emulated.PROFILE, tmp_path, tmp_path, 400)
