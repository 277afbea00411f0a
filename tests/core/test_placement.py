"""Placement of prefixes nobody holds: consistent hashing, the same owner from every node."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from radixmesh.core.placement import MAX_WALK, Ring, placement_key


def ring_of(n: int) -> Ring:
    ring = Ring()
    ring.update(f"n{i}" for i in range(n))
    return ring


def test_the_key_is_the_block_at_the_placement_depth() -> None:
    assert placement_key([], 16) is None
    assert placement_key([1, 2, 3], 16) == 3  # shorter than the depth: the whole prompt
    assert placement_key(list(range(1, 40)), 16) == 16


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=50), st.integers(1, 12))
def test_every_node_with_the_same_members_picks_the_same_owner(keys: list[int], n: int) -> None:
    a, b = ring_of(n), Ring()
    b.update(reversed([f"n{i}" for i in range(n)]))  # order of discovery does not matter
    for key in keys:
        assert a.owner(key, lambda m: True) == b.owner(key, lambda m: True)


def test_owners_spread_evenly_and_move_little_when_a_member_leaves() -> None:
    rng = random.Random(1)
    keys = [rng.getrandbits(64) for _ in range(4000)]
    ring = ring_of(8)
    before = {k: ring.owner(k, lambda m: True) for k in keys}
    shares = [sum(o == f"n{i}" for o in before.values()) / len(keys) for i in range(8)]
    assert min(shares) > 0.6 / 8 and max(shares) < 1.5 / 8
    ring.update(f"n{i}" for i in range(7))  # n7 leaves
    after = {k: ring.owner(k, lambda m: True) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == "n7" for k in moved)  # only n7's prefixes move


def test_an_unavailable_owner_is_skipped_within_the_walk() -> None:
    ring = ring_of(4)
    key = 12345
    first = ring.owner(key, lambda m: True)
    second = ring.owner(key, lambda m: m != first)
    assert second is not None and second != first
    assert ring.owner(key, lambda m: False) is None
    assert MAX_WALK >= 2
