"""A profile's ``admission_s`` in the simulator: the time from a request's arrival at the engine
to its joining the scheduler delays that request only (as ``emulate/loop.py`` awaits it before
``submit``), never a step."""

from __future__ import annotations

from dataclasses import replace

import pytest

from radixmesh.core.profile import resolve as resolve_profile
from radixmesh.core.router import Policy, RouterConfig
from radixmesh.results.records import Record
from radixmesh.sim import costs
from radixmesh.sim.runner import SimSpec, run
from radixmesh.sim.shell import ClusterConfig
from radixmesh.sim.tokens import byte_tokenize
from radixmesh.workload.request import Request

ADMISSION_S = 0.25  # far above any step of the profile: a step cost would show at once


def _run(admission_s: float, reqs: list[Request], schedule: str) -> list[Record]:
    prof = resolve_profile("h100-qwen2.5-0.5b")
    prof = replace(prof, admission_s=admission_s,
                   citations={**prof.citations, "admission_s": "test figure"})
    cluster = ClusterConfig(nodes=1, cost=costs.from_profile(prof),
                            router=RouterConfig(policy=Policy.NONE), seed=1)
    res = run(SimSpec("none", cluster, schedule=schedule, warmup_s=0.5), reqs,
              byte_tokenize()[0])
    assert len(res.records) == len(reqs) and all(r.ok for r in res.records)
    return res.records


@pytest.mark.parametrize("schedule", ["sequential", "poisson"])
def test_admission_delays_each_request_once_and_overlaps_the_others(schedule: str) -> None:
    # sequential: one at a time; poisson: three requests arrive together at t = 0 and are
    # batched together either way, so admission (not a step's cost) delays each by exactly it
    reqs = [Request(id=f"r{i}", prompt=f"question {i} " * 40, max_tokens=8, t=0.0)
            for i in range(3)]
    base, slow = _run(0.0, reqs, schedule), _run(ADMISSION_S, reqs, schedule)
    for a, b in zip(base, slow, strict=True):
        assert a.ttft_s is not None and b.ttft_s is not None
        assert b.ttft_s == pytest.approx(a.ttft_s + ADMISSION_S, abs=1e-9)
        assert b.tpot_s == pytest.approx(a.tpot_s, abs=1e-12)
        # it waited before the scheduler: the engine's queue time, not its service
        assert b.server_timing["queue"] == pytest.approx(
            a.server_timing["queue"] + ADMISSION_S, abs=1e-9)
        assert b.server_timing["service"] == pytest.approx(a.server_timing["service"], abs=1e-9)
