"""The cost policy's deliberate replicas of a hot prefix (``CostPolicy._replica``): an owner
makes one when the prefix's one holder queues its requests, its load here asks for more
owners than hold it, and what the replica saves the requests to come pays its cold prefill."""

from __future__ import annotations

import random

from radixmesh.core.estimators import SpeedReport
from radixmesh.core.router import (
    Candidate,
    NodeInfo,
    Placement,
    Policy,
    RouteInput,
    Router,
    RouterConfig,
    Tag,
)

SPEED = SpeedReport(0.004, 8e-5, 0.007, 0.05)
REQ = RouteInput(3000, 1)
HELD = 2048


def _nodes(holder_queue: int, owner_holds: bool = False) -> list[NodeInfo]:
    """This node (cold), the prefix's one holder ``h`` (with ``holder_queue`` queued) and an
    idle owner ``o`` (holding it too if ``owner_holds``)."""
    return [
        NodeInfo("self", True, 0, 0.0, 0, SPEED),
        NodeInfo("h", False, 2900, 0.001, holder_queue, SPEED),
        NodeInfo("o", False, 2900 if owner_holds else 0, 0.001, 0, SPEED),
    ]


def _ranked(nodes: list[NodeInfo], owners: tuple[str, ...], rate_hz: float) -> list[Candidate]:
    router = Router(RouterConfig(policy=Policy.COST))
    return router.rank(REQ, nodes, random.Random(0), Placement(owners, HELD, rate_hz=rate_hz))


def _first(nodes: list[NodeInfo], owners: tuple[str, ...], rate_hz: float) -> tuple[str, Tag]:
    ranked = _ranked(nodes, owners, rate_hz)
    assert ranked[0].placement is not None
    return ranked[0].node_id, ranked[0].placement


def test_a_queued_holder_of_a_hot_prefix_gets_a_replica_once_its_requests_pay_for_it() -> None:
    busy = _nodes(holder_queue=3)
    assert _first(busy, ("o", "x"), rate_hz=0.0) == ("h", Tag.HIT)  # nothing to come: a hit
    assert _first(busy, ("o", "x"), rate_hz=0.01) == ("h", Tag.HIT)  # too rare to pay
    assert _first(busy, ("o", "x"), rate_hz=5.0) == ("o", Tag.REPLICA)


def test_no_replica_where_the_load_asks_for_no_more_copies_or_the_holder_is_not_slower() -> None:
    busy = _nodes(holder_queue=3)
    assert _first(busy, ("o",), rate_hz=5.0) == ("h", Tag.HIT)  # one owner: enough holders
    # as many nodes hold it as it has owners: those holders share its requests already
    both = _nodes(holder_queue=3, owner_holds=True)
    assert _first(both, ("o", "h"), rate_hz=5.0) == ("o", Tag.HIT)  # the idle holder
    # an idle holder answers as fast as a warm replica would: nothing saved, nothing copied
    idle = _nodes(holder_queue=0)
    assert _first(idle, ("o", "x"), rate_hz=5.0) == ("h", Tag.HIT)


def test_the_replica_forward_carries_the_limit_it_was_chosen_at() -> None:
    """The peer refuses a forward whose exact cost exceeds its ``beat_s``: a replica's must
    be the most it was allowed to cost, not what staying costs, or a peer as the sender
    sees it would refuse it (and every later request of the prefix the same)."""
    queued_self = [NodeInfo("self", True, 2900, 0.0, 3, SPEED),
                   NodeInfo("o", False, 0, 0.001, 0, SPEED)]
    busier_owner = [NodeInfo("self", True, 0, 0.0, 0, SPEED),
                    NodeInfo("h", False, 2900, 0.001, 4, SPEED),
                    NodeInfo("o", False, 0, 0.001, 1, SPEED)]
    for nodes in (queued_self, busier_owner):
        top = _ranked(nodes, ("o", "x"), rate_hz=5.0)[0]
        assert (top.node_id, top.placement) == ("o", Tag.REPLICA)
        assert top.beat_s is not None and top.cost_s is not None
        assert top.beat_s >= top.cost_s


def test_this_node_as_the_owner_makes_the_replica_itself() -> None:
    nodes = [NodeInfo("self", True, 0, 0.0, 0, SPEED), NodeInfo("h", False, 2900, 0.001, 3, SPEED)]
    top = _ranked(nodes, ("self", "x"), rate_hz=5.0)[0]
    assert (top.node_id, top.placement, top.beat_s) == ("self", Tag.REPLICA, None)
