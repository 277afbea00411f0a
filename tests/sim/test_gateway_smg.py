"""The simulator's model of SMG 1.13's ``cache_aware`` (``sim/gateway.py``, ``SmgGateway``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from radixmesh.core.config import GossipConfig
from radixmesh.core.router import Policy, RouterConfig
from radixmesh.sim import costs
from radixmesh.sim.gateway import (
    CACHE_AWARE,
    SMG,
    CacheAwareGateway,
    GatewayConfig,
    SmgGateway,
    make_gateway,
)
from radixmesh.sim.runner import SimSpec, run
from radixmesh.sim.shell import ClusterConfig
from radixmesh.sim.sweep import parse_policies
from radixmesh.sim.tokens import byte_tokenize
from radixmesh.workload.request import Request

SMG_CFG = GatewayConfig(kind=SMG)
DOC = list(range(100))


def _gw(workers: int, cfg: GatewayConfig = SMG_CFG) -> SmgGateway:
    gw = make_gateway(workers, cfg, block_size=4, seed=1)
    assert isinstance(gw, SmgGateway)
    return gw


def test_a_miss_goes_to_the_fewest_dispatched_not_the_smallest_tree() -> None:
    gw = _gw(3)
    firsts = [gw.choose(list(range(1000 * i, 1000 * i + 64)), [True] * 3, 0.0) for i in (1, 2, 3)]
    assert sorted(firsts) == [0, 1, 2]  # three misses: one to each (ties drawn, never twice)
    for w in range(3):
        gw.finished(w)
    # worker 0 gets a much larger tree; a fourth miss still goes by dispatches since the poll
    gw.choose(DOC, [True, False, False], 0.1)  # only 0 up: 0 (2 dispatched now)
    gw.finished(0)
    assert gw.trees[0].total_tokens > gw.trees[1].total_tokens
    assert gw.choose(list(range(5000, 5064)), [True] * 3, 0.2) in (1, 2)


def test_a_hit_goes_to_the_holder_with_the_least_expected_wait() -> None:
    gw = _gw(4)
    for up in ([True, False, False, False], [False, True, False, False]):
        gw.choose([*DOC, 7, 7, 7, 7], up, 0.0)  # the document on workers 0 and 1
    gw.choose(list(range(900, 964)), [True, False, False, False], 0.0)  # 0: one more dispatched
    # 0 and 1 match 100 of 108 tokens (> 30 %); 1 has had fewer dispatched: 1, not 2 or 3
    assert gw.choose(DOC + [9] * 8, [True] * 4, 0.1) == 1


def test_a_holder_past_the_spill_gate_is_skipped_and_the_spill_replicates() -> None:
    gw = _gw(8)
    only0 = [True] + [False] * 7
    for i in range(4):  # four copies of the document pile on worker 0 (the only one up)
        assert gw.choose(DOC + [i] * 4, only0, 0.0) == 0
    # in flight 4 and seven 0: mean 0.5, two standard deviations 2.6, margin 4: 4 > 0.75 but
    # not 4 > 4.5: the holder keeps it
    assert gw.choose(DOC + [50] * 4, [True] * 8, 0.1) == 0
    # 5 in flight: mean 0.625, margin max(4, 3.3) = 4: 5 > 0.94 and 5 > 4.6: gated, the
    # request spills to the least expected wait among the others
    target = gw.choose(DOC + [51] * 4, [True] * 8, 0.1)
    assert target != 0 and gw.imbalanced_choices == 1
    assert gw.trees[target].match(DOC) == len(DOC)  # the spill's worker now holds it too
    for _ in range(5):
        gw.finished(0)
    # worker 0 idle again: of the two holders, 0 dispatched 5 since the poll, the spill's 1
    assert gw.choose(DOC + [52] * 4, [True] * 8, 0.2) == target
    wide = _gw(2, replace(SMG_CFG, balance_abs=1))  # the margin is balance_abs when lower
    for _ in range(3):
        wide.choose(DOC, [True, False], 0.0)
    line = wide._gate_line([0, 1])  # worker 0 gated, 1 not: 3 > 2.25 and 3 > 1.5 + 1
    assert wide.load[0] > line >= wide.load[1]


def test_the_poll_reads_the_in_flight_counts_and_restarts_the_credits() -> None:
    gw = _gw(2, replace(SMG_CFG, poll_s=1.0))
    gw.choose(DOC, [True, True], 0.0)
    gw.choose(list(range(500, 564)), [True, True], 0.5)
    assert gw.since_poll == [1, 1] and gw.polled == [0, 0]
    gw.finished(0)
    gw.choose(list(range(700, 764)), [True, True], 1.5)  # a poll first: in flight 0 and 1
    assert gw.polled == [0, 1] and sum(gw.since_poll) == 1 and gw.since_poll[0] == 1


def test_the_kinds_and_their_names() -> None:
    assert type(make_gateway(2, GatewayConfig())) is CacheAwareGateway
    assert parse_policies("cost,smg,cache_aware") == ["cost", "smg", "cache_aware"]
    with pytest.raises(ValueError):
        GatewayConfig(kind="sglang")
    with pytest.raises(ValueError):
        GatewayConfig(kind=SMG, poll_s=0.0)


def test_a_run_behind_the_smg_model_spreads_a_hot_prefix(
    make_reqs: Callable[..., list[Request]],
) -> None:
    """Twelve concurrent-free requests of two prefixes: sglang-router's model keeps each
    prefix on one worker; SMG's does too while no holder is gated, and names its runs smg."""
    reqs = make_reqs(60, groups=3, prefix_words=200)
    tokenize, _ = byte_tokenize()
    out = {}
    for kind in (CACHE_AWARE, SMG):
        cfg = ClusterConfig(nodes=4, cost=costs.resolve("cpu-tiny"),
                            router=RouterConfig(policy=Policy.NONE),
                            gossip=GossipConfig.for_interval(0.1), seed=3,
                            gateway=GatewayConfig(kind=kind))  # fmt: skip
        out[kind] = run(SimSpec(name=kind, cluster=cfg), reqs, tokenize)
    res = out[SMG]
    assert res.summary["policy"] == SMG and res.summary["errors"] == 0
    assert all(r.served_by == r.entry_node for r in res.records)
    assert res.summary["actual_hit_rate"] >= out[CACHE_AWARE].summary["actual_hit_rate"] - 0.05
