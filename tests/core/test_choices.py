"""Two choices among equivalent holders (core/choices.py): at most ``per_class`` random
holders of each class (cached depth, engine speed, round-trip octave) are ranked; holders
that differ in any of those, and peers holding nothing, are never dropped."""

from __future__ import annotations

import random

import hypothesis.strategies as st
from hypothesis import given, settings

from radixmesh.core.choices import holder_class, two_choices
from radixmesh.core.cost_model import NodeInfo
from radixmesh.core.estimators import SpeedReport

SPEED = SpeedReport(0.004, 8e-5, 0.007, 0.05)
FAST = SpeedReport(0.001, 2e-5, 0.002, 0.02)


def peer(name: str, cached: int, rtt: float = 0.004, speed: SpeedReport = SPEED) -> NodeInfo:
    return NodeInfo(name, False, cached, rtt, 0.0, speed)


def test_equal_holders_are_cut_to_two_at_random_and_the_rest_kept() -> None:
    equal = [peer(f"h{i}", 2048) for i in range(8)]
    others = [peer("cold", 0), peer("deeper", 4096), peer("far", 2048, rtt=0.08),
              peer("fast", 2048, speed=FAST)]
    peers = [*equal[:4], *others, *equal[4:]]
    kept = two_choices(peers, random.Random(1), 2)
    names = [n.node_id for n in kept]
    assert sum(1 for n in names if n.startswith("h")) == 2
    assert {"cold", "deeper", "far", "fast"} <= set(names)
    assert names == [n.node_id for n in peers if n.node_id in names]  # order kept
    picks = {tuple(n.node_id for n in two_choices(peers, random.Random(s), 2)
                   if n.node_id.startswith("h")) for s in range(30)}
    assert len(picks) > 5  # each router its own random pair


def test_jitter_within_a_region_is_one_class_and_few_peers_pass_untouched() -> None:
    assert holder_class(peer("a", 64, rtt=0.0039)) == holder_class(peer("b", 64, rtt=0.0041))
    assert holder_class(peer("a", 64, rtt=0.004)) != holder_class(peer("b", 64, rtt=0.08))
    two = [peer("a", 64), peer("b", 64)]
    assert two_choices(two, random.Random(0), 2) is two


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, 16, 32]), st.sampled_from([0.002, 0.004, 0.08])),
                max_size=20),
       st.integers(1, 4), st.integers(0, 1000))
def test_every_class_keeps_min_of_its_size_and_per_class(
    spec: list[tuple[int, float]], per_class: int, seed: int,
) -> None:
    peers = [peer(f"p{i}", c, rtt) for i, (c, rtt) in enumerate(spec)]
    kept = two_choices(peers, random.Random(seed), per_class)
    for cls in {holder_class(n) for n in peers}:
        size = sum(1 for n in peers if holder_class(n) == cls)
        left = sum(1 for n in kept if holder_class(n) == cls)
        holders = cls[0] != 0
        assert left == (min(size, per_class) if holders else size)
