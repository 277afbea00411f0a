"""What a prompt's compute costs the sequences decoding beside it, priced the same for every
candidate of one decision (``cost_model.batch_externality`` with ``mesh_decoding``) unless
one decodes far fewer, and what it costs the requests arriving behind it: its compute, not
the steps' fixed part (``BatchState.marginal_prefill_s``)."""

from __future__ import annotations

import random

from radixmesh.core.cost_model import (
    NodeInfo,
    RouteInput,
    batch_externality,
    decoders,
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


def h100(decoding: int, ahead_s: float, rate: float, ahead_tokens: int) -> BatchState:
    """The h100-llama3-8b profile's step model, ``decoding`` sequences of ~2,900 tokens."""
    return BatchState(0.005753, 1.725e-5, 7.085e-10, 2.973e-4, 3.913e-8, 8192, 1024, 450_000,
                      decoding, 0, decoding, decoding * 2900, ahead_tokens, decoding * 2900,
                      ahead_s, 0.02, 0.05, rate)


def a10g_idle() -> BatchState:
    """An A10G-like engine (~3.8x slower prompt compute) decoding 2 sequences, nothing ahead."""
    return BatchState(0.0125, 6.6e-5, 2.5e-9, 9e-4, 1.4e-7, 2048, 256, 50_000, 2, 0, 2, 5800,
                      0, 5800, 0.0, 0.0, 0.0, 3.0)


def at(name: str, cached: int, b: BatchState) -> NodeInfo:
    me = name == "self"
    return NodeInfo(name, me, cached, 0.0 if me else 0.004, b.running, SPEED, batch=b)


def test_what_a_prompt_adds_to_the_one_behind_it_is_its_compute() -> None:
    """Its compute, and a step's fixed part in the share of a step's budget it takes: the
    fixed part of the steps it shares is paid by the one behind whether it is there or not."""
    b = h100(90, 0.0, 100.0, 0)
    fixed = b.step_fixed_s(90, 90 * 2900)
    budget = 8192 - 90
    assert b.marginal_prefill_s(500, 2400) == b.prefill_compute_s(500, 2400) + fixed * 500 / budget
    assert b.marginal_prefill_s(20_000, 0) == b.prefill_compute_s(20_000, 0) + fixed  # one spill
    assert b.marginal_prefill_s(270, 2400) < 0.2 * fixed + b.prefill_compute_s(270, 2400)


def test_an_agents_step_stays_with_its_scratchpads_holder_near_capacity() -> None:
    """16 simulated H100s at 1.6x the planned capacity: the entry node holds the tool prompt
    (2,416 tokens), a peer the task's scratchpad too (2,688), with more work queued (0.23 s
    against 0.09). Priced at the whole prefill in its batch (steps' fixed part included) the
    arrivals behind made the holder ~0.5 s dearer and the step was re-prefilled here (43 % of
    steps moved); priced at the compute, the 270 tokens saved beside 90 decodes win."""
    me = at("self", 2416, h100(90, 0.09, 100.0, 3000))
    holder = at("holder", 2688, h100(90, 0.23, 100.0, 9000))
    assert first([me, holder]) == "holder"


def test_a_slow_engine_left_idle_is_priced_at_its_own_decodes() -> None:
    """4 H100s + 12 A10Gs at 3x: an H100 decoding 200 with 0.25 s of prompts ahead against an
    idle A10G. At the decision's mean batch (101) the A10G's slower compute was charged for
    ~100 decodes it does not have, and the request queued on the H100."""
    assert decoders(2, 101.0) == 2.0  # far below: its own
    assert decoders(90, 101.0) == 101.0  # within a count's noise: the decision's
    assert decoders(200, 101.0) == 101.0  # above: the decision's (its wait prices its load)
    assert decoders(7, None) == 7.0
    busy = at("self", 2400, h100(200, 0.25, 300.0, 12000))
    assert first([busy, at("a10g", 2400, a10g_idle())]) == "a10g"
