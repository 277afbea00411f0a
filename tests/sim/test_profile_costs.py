"""The phase-1 adapter: a step-time profile as the one-request-at-a-time simulator's cost model."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixmesh.core.profile import dumps, shipped
from radixmesh.core.profile import resolve as resolve_profile
from radixmesh.sim import costs


@pytest.mark.parametrize("name", [n for n in shipped() if n not in costs.PRESETS])
def test_profile_names_resolve_through_the_adapter(name: str) -> None:
    model = costs.resolve(name)
    assert model == costs.from_profile(resolve_profile(name))
    assert model.name == f"profile:{name}"


@given(
    st.sampled_from(["h100-llama3-8b", "a10g-llama3-8b", "h100-qwen2.5-0.5b"]),
    st.integers(1, 8192),
    st.integers(0, 8192),
    st.integers(1, 64),
)
def test_adapter_times_one_request_as_the_profile_does(
    name: str, uncached: int, cached: int, max_tokens: int
) -> None:
    prof = resolve_profile(name)
    model = costs.from_profile(prof, decode_context=700)
    prompt = cached + uncached  # <= step_tokens: one prefill step, as the adapter assumes
    assert model.prefill_s(uncached, cached) == pytest.approx(
        prof.ttft_s(prompt, cached=cached), rel=1e-9
    )
    assert model.decode_s(max_tokens) == pytest.approx((max_tokens - 1) * prof.tpot_s(1, 700))


def test_toml_files_resolve_and_presets_still_win(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text(dumps(replace(resolve_profile("a100-llama3-8b"), name="mine")))
    assert costs.resolve(str(path)).name == "profile:mine"
    assert costs.resolve("cpu-tiny") == costs.PRESETS["cpu-tiny"]()  # preset, for now
    assert costs.resolve("gpu-7b").name == "gpu-7b"  # deprecated, still there
    with pytest.raises(ValueError, match="h100-llama3-8b"):
        costs.resolve("no-such-model")
