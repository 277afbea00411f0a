"""EngineStateChanged: a node whose engine is down takes no new work, reversibly — its own
requests go to a peer under any policy (or are rejected: nothing can run here), peers'
forwards are refused, push-back goes out at once; back up, it serves again."""

from __future__ import annotations

import random

from radixmesh.core.blocks import Fingerprint
from radixmesh.core.config import NodeConfig
from radixmesh.core.events import (
    AcceptForward,
    EngineStateChanged,
    ExecuteLocally,
    Forward,
    ForwardArrived,
    RefuseForward,
    RejectRequest,
    RequestArrived,
    Send,
)
from radixmesh.core.node import NodeCore
from radixmesh.core.router import Policy, RouterConfig
from radixmesh.testing import TwinCluster

FP = Fingerprint("test-model", "bytes", 16)
IDLE_FORWARD = ForwardArrived(0, 64, 0, 4, None)


def warm(policy: Policy) -> TwinCluster:
    c = TwinCluster(3, router=RouterConfig(policy=policy), seed=5)
    c.run_for(2.0)
    return c


def test_a_node_without_its_engine_sends_its_requests_to_a_peer_under_every_policy() -> None:
    for policy in (Policy.NONE, Policy.PAPER, Policy.COST):
        c = warm(policy)
        actions = c.deliver("n0", EngineStateChanged(False, "killed"))
        assert {a.peer_id for a in actions if isinstance(a, Send)} == {"n1", "n2"}
        [action] = c.deliver("n0", RequestArrived(1, (), 64, 0, 4))
        assert isinstance(action, Forward) and action.peer_id in ("n1", "n2"), policy
        assert c.nodes["n0"].metrics()["engine_down"] == 1.0


def test_forwards_are_refused_while_down_and_accepted_once_back() -> None:
    c = warm(Policy.COST)
    n1 = c.nodes["n1"]
    c.deliver("n1", EngineStateChanged(False, "stopped"))
    [refusal] = n1.handle(IDLE_FORWARD, c.now)
    assert isinstance(refusal, RefuseForward)
    assert n1.metrics()["forwards_refused_engine_down"] == 1
    c.deliver("n1", EngineStateChanged(True, "answers again"))
    assert n1.handle(IDLE_FORWARD, c.now) == [AcceptForward(0)]
    assert n1.metrics()["engine_went_down"] == 1 and n1.metrics()["engine_came_back"] == 1
    assert c.deliver("n1", EngineStateChanged(True, "again")) == []  # no change, no round


def test_alone_and_down_a_request_is_rejected_never_run_here() -> None:
    solo = NodeCore(NodeConfig("solo", "mem://solo", FP, 1), random.Random(0), now=0.0)
    solo.handle(EngineStateChanged(False, "killed"), 0.0)
    [rejected] = solo.handle(RequestArrived(1, (), 64, 0, 4), 0.1)
    assert isinstance(rejected, RejectRequest) and rejected.retry_after_s > 0
    solo.handle(EngineStateChanged(True, "back"), 1.0)
    [served] = solo.handle(RequestArrived(2, (), 64, 0, 4), 1.1)
    assert isinstance(served, ExecuteLocally)


def test_forwards_of_a_node_without_its_engine_give_nothing_to_beat() -> None:
    """A peer refuses a forward as slower than the entry's own alternative (``beat_s``); with
    the engine down there is none. Kept, a real vLLM's peer refused 169 forwards of a killed
    engine's node as slower in one minute, and that node's clients got 429s."""
    rng = random.Random(3)
    c = warm(Policy.COST)

    def forwards(first: int) -> list[Forward]:
        out = []
        for rid in range(first, first + 40):
            cold = tuple(rng.getrandbits(64) for _ in range(20))  # owned by one of the three
            out += [a for a in c.deliver("n0", RequestArrived(rid, cold, 320, 0, 1))
                    if isinstance(a, Forward)]
        return out

    up = forwards(1)
    assert up and all(f.beat_s is not None for f in up)  # up: each carries its alternative
    c.deliver("n0", EngineStateChanged(False, "killed"))
    down = forwards(100)
    assert len(down) == 40 and all(f.beat_s is None for f in down)
    n1 = c.nodes["n1"]
    [accepted] = n1.handle(ForwardArrived(7, 320, 0, 1, down[0].beat_s), c.now)
    assert isinstance(accepted, AcceptForward)
