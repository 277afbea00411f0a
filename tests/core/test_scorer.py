"""The ``llmd`` policy: llm-d's default profile (prefix 3 : queue 2 : KV 2) on one node's view."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from radixmesh.core.cost_model import NodeInfo, RouteInput
from radixmesh.core.estimators import SpeedReport
from radixmesh.core.router import Policy, Router, RouterConfig
from radixmesh.core.scorer import llmd_order, llmd_scores

SPEED = SpeedReport(0.01, 1e-4, 0.005, 0.002)


def node(name: str, cached: int, queue: float, kv: float, me: bool = False) -> NodeInfo:
    return NodeInfo(name, me, cached, 0.0, queue, SPEED, kv_usage=kv)


def test_scores_follow_the_three_scorers() -> None:
    req = RouteInput(prompt_tokens=1000, max_tokens=8)
    nodes = [node("a", 1000, 0, 0.5, me=True), node("b", 0, 4, 0.0), node("c", 500, 2, 1.0)]
    # a: 3*1 + 2*1 + 2*0.5 = 6; b: 0 + 0 + 2 = 2; c: 1.5 + 1 + 0 = 2.5
    assert llmd_scores(req, nodes) == [6.0, 2.0, 2.5]
    assert [n.node_id for n in llmd_order(req, nodes, random.Random(0))] == ["a", "c", "b"]


def test_equal_queues_score_one_and_ties_are_shuffled() -> None:
    req = RouteInput(prompt_tokens=100, max_tokens=1)
    nodes = [node(f"n{i}", 0, 3, 0.0, me=i == 0) for i in range(4)]
    assert llmd_scores(req, nodes) == [4.0] * 4
    heads = {llmd_order(req, nodes, random.Random(s))[0].node_id for s in range(40)}
    assert heads == {"n0", "n1", "n2", "n3"}


@given(st.lists(st.tuples(st.integers(0, 2000), st.integers(0, 50), st.floats(0, 1)),
                min_size=1, max_size=8),
       st.integers(1, 2000))
def test_the_head_has_the_best_score_of_a_reference_sum(rows: list[tuple[int, int, float]],
                                                        prompt: int) -> None:
    nodes = [node(f"n{i}", c, q, kv, me=i == 0) for i, (c, q, kv) in enumerate(rows)]
    req = RouteInput(prompt_tokens=prompt, max_tokens=1)
    lo, hi = min(q for _, q, _ in rows), max(q for _, q, _ in rows)

    def ref(c: int, q: int, kv: float) -> float:
        qs = 1.0 if hi == lo else (hi - q) / (hi - lo)
        return 3 * min(c / prompt, 1.0) + 2 * qs + 2 * (1 - kv)

    best = max(ref(*r) for r in rows)
    head = llmd_order(req, nodes, random.Random(1))[0]
    i = int(head.node_id[1:])
    assert abs(ref(*rows[i]) - best) < 1e-9


def test_the_router_runs_it_as_a_policy_over_available_nodes() -> None:
    router = Router(RouterConfig(policy=Policy.parse("llmd")))
    req = RouteInput(prompt_tokens=1000, max_tokens=8)
    nodes = [node("a", 0, 5, 0.9, me=True), node("b", 900, 0, 0.1)]
    suspect = NodeInfo("c", False, 1000, 0.0, 0, SPEED, suspect=True)
    ranked = router.rank(req, [*nodes, suspect], random.Random(0))
    assert [c.node_id for c in ranked] == ["b", "a"]
