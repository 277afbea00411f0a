"""What a prompt's compute costs the sequences decoding beside it, priced the same for every
candidate of one decision (``cost_model.batch_externality`` with ``mesh_decoding``)."""

from __future__ import annotations

import random

from radixmesh.core.cost_model import (
    NodeInfo,
    RouteInput,
    batch_externality,
    mesh_cost,
    mesh_decoding,
)
from radixmesh.core.estimators import SpeedReport
from radixmesh.core.router import Policy, Router, RouterConfig
from radixmesh.core.shadow_state import BatchState

SPEED = SpeedReport(0.004, 8e-5, 0.007, 0.05)
SCALE = RouterConfig().context_scale
REQ = RouteInput(3100, 8)


def batch(decoding: int) -> BatchState:
    """An H100-like engine (100 us a prompt token) decoding ``decoding`` sequences, nothing
    waiting or prefilling."""
    return BatchState(0.005, 1e-4, 0.0, 1e-5, 0.0, 8192, 256, 500_000, decoding, 0, decoding,
                      decoding * 3000, 0, decoding * 3000, 0.0, 0.002, 0.05, 50.0)


def node(name: str, cached: int, decoding: int, rtt: float = 0.004) -> NodeInfo:
    me = name == "self"
    return NodeInfo(name, me, cached, 0.0 if me else rtt, decoding, SPEED,
                    batch=batch(decoding))


def first(nodes: list[NodeInfo]) -> str:
    out = Router(RouterConfig(policy=Policy.COST)).rank(REQ, nodes, random.Random(0))
    return out[0].node_id


def test_one_decision_prices_every_candidates_compute_against_one_batch() -> None:
    nodes = [node("self", 2400, 14), node("a", 2400, 6), NodeInfo("b", False, 0, 0.004, 0,
                                                                    SPEED)]
    assert mesh_decoding(nodes) == 10.0  # the batching candidates' mean
    assert mesh_decoding([NodeInfo("c", False, 0, 0.004, 0, SPEED)]) is None
    mine = batch_externality(REQ, nodes[0], SCALE)  # alone: its own batch
    assert batch_externality(REQ, nodes[0], SCALE, 14) == mine
    assert batch_externality(REQ, nodes[0], SCALE, 7) < mine
    # a node checking a forward alone prices it against its own batch
    assert mesh_cost(REQ, [nodes[0]], SCALE) == [mesh_cost(REQ, nodes[:1], SCALE)[0]]


def test_a_copy_is_not_sent_away_for_a_smaller_decode_batch_alone() -> None:
    """Both hold the same prefix, so the 700 tokens are computed either way: a peer decoding
    fewer sequences at the moment is no reason to pay a round trip (priced at each node's own
    batch, its 8 fewer sequences x 70 ms of prompt compute outweighed the 4 ms)."""
    assert first([node("self", 2400, 14), node("small", 2400, 6)]) == "self"


def test_a_longer_hit_still_pays_its_round_trip() -> None:
    """The compute a hit saves is priced at the decision's batch: 600 tokens fewer to
    compute at the holder, beside ~10 decoding sequences, beat a 4 ms round trip."""
    assert first([node("self", 2400, 14), node("holder", 3000, 6)]) == "holder"
    # and at an idle mesh (nothing decoding anywhere) the hit still wins on its own TTFT
    idle = [node("self", 2400, 0), node("holder", 3000, 0)]
    assert first(idle) == "holder"
