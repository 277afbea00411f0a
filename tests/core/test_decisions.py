"""core/decisions.py: the ring of routing decisions a node keeps to explain them."""

from __future__ import annotations

import json
import random

from radixmesh.core.decisions import DecisionLog, describe, from_json
from radixmesh.core.estimators import SpeedReport
from radixmesh.core.events import (
    AcceptForward,
    Forward,
    ForwardArrived,
    ForwardRefused,
    RefuseForward,
    RequestArrived,
)
from radixmesh.core.router import (
    Candidate,
    NodeInfo,
    Placement,
    Policy,
    RouterConfig,
    Tag,
)
from radixmesh.testing import TwinCluster

SPEED = SpeedReport(0.004, 8e-5, 0.01, 0.3)


def _nodes() -> list[NodeInfo]:
    return [
        NodeInfo("n0", True, 0, 0.0, 1.0, SPEED, utilization=0.5),
        NodeInfo("n1", False, 512, 0.002, 0.0, SPEED),
        NodeInfo("n2", False, 0, 0.002, 3.0, SPEED, pushed_back=True),  # not ranked
    ]


def _ranked() -> list[Candidate]:
    return [Candidate("n1", False, 512, 0.1, 0.4, Tag.HIT, cost_s=0.1),
            Candidate("n0", True, 0, 0.4, None, Tag.SECOND_COPY, cost_s=0.7)]


def _record(log: DecisionLog, request: int, placement: Placement | None = None) -> None:
    log.record(float(request), request, False, 600, 4, _nodes(), placement, _ranked())


def test_the_ring_keeps_the_last_decisions_and_counts_all() -> None:
    log = DecisionLog(3)
    for rid in range(5):
        _record(log, rid)
    assert len(log) == 3 and log.recorded == 5
    assert [d.request for d in log.recent()] == [2, 3, 4]
    assert [d.seq for d in log.recent()] == [2, 3, 4]  # the gap says 0 and 1 were evicted
    assert [d.request for d in log.recent(limit=2)] == [3, 4]
    assert [d.request for d in log.recent(request=3)] == [3]
    assert log.recent(placement="hit") == log.recent()
    assert log.recent(placement="first") == []
    none = DecisionLog(0)
    _record(none, 1)
    assert len(none) == 0 and none.recorded == 1  # keeps none, still counts


def test_a_decision_says_what_the_node_believed_of_every_candidate() -> None:
    log = DecisionLog(4)
    _record(log, 7, Placement(("n1",), 256, 0.05))
    [d] = log.recent()
    assert (d.chosen, d.placement, d.owners, d.held_tokens) == ("n1", "hit", ("n1",), 256)
    assert [(c.node_id, c.rank) for c in d.considered] == [("n1", 0), ("n0", 1), ("n2", None)]
    n1, n0, n2 = d.considered
    assert (n1.cached_tokens, n1.cost_s, n1.placement) == (512, 0.1, "hit")
    assert (n0.queue_depth, n0.utilization, n0.placement) == (1.0, 0.5, "second_copy")
    assert n2.pushed_back and n2.cost_s is None and n2.predicted_latency_s is None
    # JSON and back, as /mesh/decisions serves it and scripts/why.py reads it
    assert from_json(json.loads(json.dumps(d.to_json()))) == d
    text = describe(d)
    assert text[0].startswith("--- n0 request 7 at 7.000: 600 prompt tokens, owners n1")
    assert text[0].endswith("-> n1 (hit)")
    assert len(text) == 4 and "pushed-back" in text[3] and text[3].lstrip().startswith("- n2")


def test_a_node_keeps_its_choice_and_its_re_ranking_after_a_refusal() -> None:
    rng = random.Random(8)
    c = TwinCluster(3, router=RouterConfig(policy=Policy.COST), seed=11, decision_log=16)
    c.run_for(2.0)
    chain = [rng.getrandbits(64) for _ in range(64)]
    c.change_cache("n1", chain)
    c.run_for(1.0)
    n0 = c.nodes["n0"]
    [first] = c.deliver("n0", RequestArrived(1, tuple(chain), 1100, 0, 1))
    assert isinstance(first, Forward) and first.peer_id == "n1"
    n0.route(chain, 1100, 0, 1, c.now)  # a ranking for no request (a probe) is not kept
    [d] = n0.decisions.recent()
    assert (d.request, d.again, d.chosen, d.placement) == (1, False, "n1", "hit")
    assert d.prompt_tokens == 1100 and d.held_tokens is not None and d.owners
    holder = next(x for x in d.considered if x.node_id == "n1")
    assert holder.rank == 0 and holder.cached_tokens >= 64 * 16 - 16
    c.deliver("n0", ForwardRefused(1, "n1", 0.0, 10.0))
    again = n0.decisions.recent(request=1)
    assert [x.again for x in again] == [False, True]
    assert again[1].chosen != "n1"  # the refusal's 10 s queue: not worth it now
    assert c.nodes["n1"].decisions.recent() == []  # it routed nothing ...
    # ... and judges the forward when it arrives: its cost against n0's beat_s
    n1 = c.nodes["n1"]
    [ok] = n1.handle(ForwardArrived(7, 1100, 64 * 16, 1, first.beat_s), c.now)
    [no] = n1.handle(ForwardArrived(8, 1100, 0, 1, 0.0), c.now)  # beat nothing: slower
    assert isinstance(ok, AcceptForward) and isinstance(no, RefuseForward)
    accepted, slower = n1.decisions.recent_admissions()
    assert (accepted.prompt_tokens, accepted.verdict, accepted.beat_s) == (
        1100, "accepted", first.beat_s)
    assert accepted.cost_s is not None and first.beat_s is not None
    assert accepted.cost_s <= first.beat_s and accepted.wait_s == 0.0
    assert slower.verdict == "slower" and slower.cost_s is not None and slower.cost_s > 0.0


def test_admissions_are_kept_in_their_own_ring() -> None:
    log = DecisionLog(2)
    for i in range(3):
        log.admitted(float(i), 100 + i, 0, 1, 0.5, 0.7, 0.2, 1, "slower")
    kept = log.recent_admissions()
    assert [a.seq for a in kept] == [1, 2] and log.admissions_recorded == 3
    assert kept[-1].to_json()["verdict"] == "slower" and log.recent() == []
    assert [a.prompt_tokens for a in log.recent_admissions(limit=1)] == [102]
