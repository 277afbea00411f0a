"""Fault injection on real processes (CI-sized `radixmesh chaos --quick`): faults cost time.

One keyed 3-node cluster (``micro`` model, Δpoll 0.2 s, forward timeout 1 s) runs every fault
in turn: hostile peer messages, kill -9 and SIGSTOP of a forward target (plain and streaming
clients), restart with a new incarnation, gossip loss 0%/50% with duplication and reordering,
a partition into two halves, a slow node. For each: 0 client-visible failures, every answer
equal to the single-node greedy reference, and the fault's own criterion (push-back fired,
views converged, estimate dropped). Criteria about elapsed time are printed, not asserted
(shared CPU). Budget: ~60-120 s.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from radixmesh.chaos.cli import FAULTS as FAULT_STEPS
from radixmesh.chaos.env import ChaosConfig, ChaosEnv
from radixmesh.chaos.faults import FaultPlan
from radixmesh.chaos.report import FaultResult, to_json, to_markdown
from radixmesh.chaos.soak import _locks_at_end
from radixmesh.chaos.suite import run_all

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chaos() -> Iterator[tuple[ChaosEnv, list[FaultResult]]]:
    with ChaosEnv(ChaosConfig()) as env:
        results = run_all(env, FaultPlan.quick())
        print("\n" + to_markdown(results))
        yield env, results


EXPECTED = {
    "hostile peer messages": 1,
    "kill -9 of the forward target": 2,  # plain and streaming clients
    "restart with a new incarnation": 1,
    "hung forward target": 1,
    "gossip loss": 2,
    "partition into two halves": 1,
    "slow node": 1,
}


def test_every_fault_ran(chaos: tuple[ChaosEnv, list[FaultResult]]) -> None:
    _, results = chaos
    crashed = [(r.fault, r.notes) for r in results if r.fault in FAULT_STEPS]
    assert not crashed, crashed  # a fault whose run raised is reported under its step name
    for prefix, count in EXPECTED.items():
        assert sum(r.fault.startswith(prefix) for r in results) == count, prefix


@pytest.mark.parametrize("prefix", list(EXPECTED))
def test_fault_costs_time_only(chaos: tuple[ChaosEnv, list[FaultResult]], prefix: str) -> None:
    _, results = chaos
    for r in (r for r in results if r.fault.startswith(prefix)):
        assert r.requests > 0, r.fault
        assert r.failures == 0, (r.fault, r.notes)
        assert r.lost == 0, (r.fault, r.notes)
        failed = [str(c["what"]) for c in r.checks if not c["ok"] and not c["timing"]]
        assert not failed, (r.fault, failed, r.figures)


def test_no_radix_locks_leak(chaos: tuple[ChaosEnv, list[FaultResult]]) -> None:
    """After kills, hangs and fallbacks, every node's cache holds 0 locked tokens."""
    env, _ = chaos
    locks = _locks_at_end(env)
    assert len(locks) == len(env.cluster)
    assert all(v == 0 for v in locks.values()), locks


def test_report_shape(chaos: tuple[ChaosEnv, list[FaultResult]]) -> None:
    _, results = chaos
    doc = json.loads(to_json(results))
    for f in doc["faults"]:
        assert {"fault", "requests", "failures", "lost", "notes"} <= set(f)


def test_cli_rejects_unknown_fault() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "radixmesh.cli", "chaos", "--only", "bogus"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and "unknown faults" in proc.stderr
