"""Leaving (LeaveRequested: drain, push-back gossip) and joining (SeedsDiscovered, seed backoff)."""

from __future__ import annotations

import random

import pytest

from radixmesh.core.blocks import Fingerprint
from radixmesh.core.config import JoinConfig, NodeConfig
from radixmesh.core.events import (
    AcceptForward,
    ExecuteLocally,
    Forward,
    ForwardArrived,
    LeaveRequested,
    RefuseForward,
    RejectRequest,
    RequestArrived,
    SeedsDiscovered,
    Send,
    Tick,
)
from radixmesh.core.node import NodeCore
from radixmesh.core.router import Policy, RouterConfig
from radixmesh.testing import TwinCluster

FP = Fingerprint("test-model", "bytes", 16)
GRACE = 30.0


def warm(n: int = 3) -> TwinCluster:
    c = TwinCluster(n, router=RouterConfig(policy=Policy.COST), seed=5)
    c.run_for(2.0)
    return c


def lone(seeds: tuple[str, ...] = (), join: JoinConfig | None = None) -> NodeCore:
    config = NodeConfig("solo", "mem://solo", FP, 1, seeds=seeds, join=join or JoinConfig())
    return NodeCore(config, random.Random(0), now=0.0)


def seed_contacts(node: NodeCore, address: str, rounds: int) -> list[int]:
    """The rounds (1-based) in which ``node`` greets ``address``, over ``rounds`` rounds."""
    out = []
    for i in range(1, rounds + 1):
        actions = node.handle(Tick(), node.next_deadline())
        if any(isinstance(a, Send) and a.address == address for a in actions):
            out.append(i)
    return out


# ----------------------------------------------------------------------------- leaving
def test_leaving_node_refuses_every_forward_as_busy() -> None:
    c = warm()
    n1 = c.nodes["n1"]
    idle = ForwardArrived(0, 64, 0, 4, None)
    assert n1.handle(idle, c.now) == [AcceptForward(0)]
    c.deliver("n1", LeaveRequested(GRACE))
    [refusal] = n1.handle(idle, c.now + 1.0)
    assert isinstance(refusal, RefuseForward)
    assert refusal.retry_after_s == pytest.approx(GRACE - 1.0)
    assert n1.metrics()["forwards_refused_leaving"] == 1
    late = n1.handle(idle, c.now + GRACE + 5.0)  # past the grace, still leaving: still refused
    assert isinstance(late[0], RefuseForward) and late[0].retry_after_s >= 1.0


def test_leaving_node_sends_its_own_requests_to_a_peer_serves_or_rejects_them() -> None:
    c = warm()
    c.deliver("n0", LeaveRequested(GRACE))
    assert c.nodes["n0"].leaving and c.nodes["n0"].metrics()["leaving"] == 1.0
    [action] = c.deliver("n0", RequestArrived(1, (), 64, 64, 4))
    assert isinstance(action, Forward) and action.peer_id in ("n1", "n2")  # never itself
    # No peer to take it: within the grace a leaving node serves it (a rolling restart of a
    # loaded mesh must fail nothing); once the grace cannot cover it, it is rejected.
    solo = lone()
    solo.handle(LeaveRequested(GRACE), 0.0)
    [served] = solo.handle(RequestArrived(2, (), 64, 64, 4), 0.1)
    assert isinstance(served, ExecuteLocally)
    [rejected] = solo.handle(RequestArrived(3, (), 64, 64, 4), GRACE + 1.0)
    assert isinstance(rejected, RejectRequest) and rejected.retry_after_s >= 1.0
    assert solo.metrics()["requests_rejected"] == 1


def test_leave_gossips_pushback_for_the_grace_at_once_and_peers_stop_routing() -> None:
    c = warm()
    assert c.nodes["n0"].available("n2", c.now)
    actions = c.deliver("n2", LeaveRequested(GRACE))
    sends = [a for a in actions if isinstance(a, Send)]
    assert {s.peer_id for s in sends} == {"n0", "n1"}  # a round now, not at the next tick
    for s in sends:
        assert s.message is not None and s.message.load is not None
        assert s.message.load.pushback_s == pytest.approx(GRACE)
    c.run_for(0.05)  # one delivery delay: well before the next gossip round
    for peer in ("n0", "n1"):
        assert c.nodes[peer].pushed_back("n2", c.now)
        assert not c.nodes[peer].available("n2", c.now)
        [action] = c.deliver(peer, RequestArrived(10, (), 64, 0, 4, target=None))
        assert not (isinstance(action, Forward) and action.peer_id == "n2")
    assert c.deliver("n2", LeaveRequested(GRACE)) == []  # a second SIGTERM changes nothing


def test_leaving_keeps_advertising_pushback_after_the_grace() -> None:
    c = warm(2)
    c.deliver("n1", LeaveRequested(1.0))
    c.run_for(3.0)  # the grace is over, the node has not gone yet
    assert c.nodes["n0"].pushed_back("n1", c.now)


# ----------------------------------------------------------------------------- joining
def test_seeds_discovered_greets_new_addresses_at_once_and_joins() -> None:
    c = TwinCluster(2, seed=3)
    c.run_for(2.0)
    late = c.add_node("late", seeds=())
    c.run_for(2.0)
    assert late.metrics()["peers_alive"] == 0  # no seeds: nobody to join
    actions = c.deliver("late", SeedsDiscovered(("mem://late", "mem://n1", "mem://n1")))
    assert [a.address for a in actions if isinstance(a, Send)] == ["mem://n1"]
    assert late.metrics()["seeds_discovered"] == 1
    c.run_for(1.0)
    assert late.peer_state("n0") == "alive" and late.peer_state("n1") == "alive"
    # A known member's address, or a seed already held, is no news.
    assert c.deliver("late", SeedsDiscovered(("mem://n0", "mem://n1"))) == []
    assert late.metrics()["seeds_discovered"] == 1


def test_seeds_are_bounded() -> None:
    node = lone(join=JoinConfig(max_seeds=2))
    actions = node.handle(SeedsDiscovered(("a:1", "b:1", "c:1")), 0.0)
    assert [a.address for a in actions if isinstance(a, Send)] == ["a:1", "b:1"]
    assert node.mesh_state(0.0)["seeds"] == ["a:1", "b:1"]


def test_a_seed_that_never_answers_is_retried_with_capped_exponential_backoff() -> None:
    node = lone(seeds=("mem://ghost",))  # today's default cap: 8 rounds
    assert seed_contacts(node, "mem://ghost", 40) == [1, 2, 4, 8, 16, 24, 32, 40]
    wide = lone(seeds=("mem://ghost",), join=JoinConfig(seed_backoff_max_rounds=16))
    assert seed_contacts(wide, "mem://ghost", 40) == [1, 2, 4, 8, 16, 32]
    capped = lone(seeds=("mem://ghost",), join=JoinConfig(seed_backoff_max_rounds=4))
    assert seed_contacts(capped, "mem://ghost", 20) == [1, 2, 4, 8, 12, 16, 20]


def test_a_discovered_seed_counts_its_first_greeting_in_the_backoff() -> None:
    node = lone()
    node.handle(SeedsDiscovered(("mem://ghost",)), 0.0)  # greeted now (round 0)
    assert seed_contacts(node, "mem://ghost", 10) == [1, 3, 7]


def test_backoff_does_not_slow_a_join_through_a_live_seed() -> None:
    c = TwinCluster(3, seed=9)
    c.run_for(1.5)
    for node in ("n1", "n2"):
        assert c.nodes[node].peer_state("n0") == "alive"
    assert c.nodes["n1"].mesh_state(c.now)["seeds"] == []  # answered: no longer a seed
