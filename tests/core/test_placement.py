"""Placement of prefixes: consistent hashing, the same owner (set) from every node; replicas."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixmesh.core.placement import (
    MAX_WALK,
    KeyRates,
    Ring,
    placement_depth,
    placement_key,
    replicas_for,
)


def ring_of(n: int) -> Ring:
    ring = Ring()
    ring.update(f"n{i}" for i in range(n))
    return ring


def test_the_key_is_the_block_at_the_placement_depth() -> None:
    assert placement_key([], 16) is None
    assert placement_key([1, 2, 3], 16) == 3  # shorter than the depth: the whole prompt
    assert placement_key(list(range(1, 40)), 16) == 16
    # a header every member holds (here 20 blocks: a chat preamble) does not name the prefix:
    # the block past it does, so conversations that differ after it get different keys
    assert placement_key(list(range(1, 40)), 16, shared_blocks=20) == 21
    assert placement_key(list(range(1, 40)), 16, shared_blocks=5) == 16  # MMLU's short header
    assert placement_key(list(range(1, 40)), 16, shared_blocks=60) == 39  # all of it is shared
    assert placement_depth(39, 16, 20) == 21 and placement_depth(3, 16) == 3
    with pytest.raises(ValueError):
        placement_depth(0, 16)


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


# ------------------------------------------------------------------ hot prefixes: owner sets
@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**64 - 1), st.integers(1, 40), st.integers(1, 50))
def test_owner_sets_are_nested_distinct_and_the_same_from_every_node(
    key: int, n: int, k: int
) -> None:
    a, b = ring_of(n), Ring()
    b.update(reversed([f"n{i}" for i in range(n)]))
    owners = a.owners(key, k, lambda m: True)
    assert owners == b.owners(key, k, lambda m: True)  # same view -> same owner set
    assert len(owners) == min(k, n) and len(set(owners)) == len(owners)
    assert owners[:1] == [a.owner(key, lambda m: True)]  # the first is the placement owner
    for j in range(1, k):
        assert a.owners(key, j, lambda m: True) == owners[:j]  # nested: growing adds, only


def test_unavailable_members_are_passed_over_within_the_walk() -> None:
    ring = ring_of(16)
    all_up = ring.owners(99, 4, lambda m: True)
    down = all_up[1]
    without = ring.owners(99, 4, lambda m: m != down)
    assert down not in without and len(without) == 4
    assert without[:1] == all_up[:1] and without[1:3] == all_up[2:4]
    assert ring.owners(99, 4, lambda m: False) == []  # MAX_WALK unavailable: give up


@settings(max_examples=200, deadline=None)
@given(
    st.floats(0, 1e4),
    st.floats(0, 1e4),
    st.floats(0.01, 2.0),
    st.integers(0, 2000),
    st.integers(1, 128),
)
def test_replica_count_is_monotone_in_load_and_bounded_by_members(
    a: float, b: float, per: float, members: int, cap: int
) -> None:
    lo, hi = sorted((a, b))
    k_lo, k_hi = (replicas_for(x, per, members, cap) for x in (lo, hi))
    assert k_lo <= k_hi <= min(members, cap)
    if members >= 1:
        assert k_lo >= 1  # a prefix always has its one owner
        assert k_hi >= min(members, cap, math.ceil(hi / per - 1e-6))  # ... and what it needs
    else:
        assert k_hi == 0


def test_key_rates_follow_the_traffic_and_forget_a_cold_prefix() -> None:
    rates = KeyRates(window_s=10.0)
    rates.add(1, 0.0)  # a fresh node's first request: over a quarter window's span at most
    assert rates.rate(1, 0.0) == pytest.approx(1.0 / (10.0 * -math.expm1(-0.25)))
    first_seconds = first_window = 0.0
    for i in range(1, 800):  # 20 requests/s of key 1 and 5/s of key 2 for 40 s
        rates.add(1, i * 0.05)
        if i % 4 == 0:
            rates.add(2, i * 0.05)
        if i == 100:
            first_seconds = rates.rate(1, i * 0.05)
        if i == 200:
            first_window = rates.rate(1, i * 0.05)
    # unbiased from the start: the count over the span it covers, not over the window (that
    # read 63 % of the rate after one window, 39 % after half of one)
    assert first_seconds == pytest.approx(20.0, rel=0.05)
    assert first_window == pytest.approx(20.0, rel=0.05)
    now = 40.0
    assert rates.rate(1, now) == pytest.approx(20.0, rel=0.05)
    assert rates.rate(2, now) == pytest.approx(5.0, rel=0.1)
    assert rates.rate(3, now) == 0.0
    assert rates.rate(1, now + 60.0) < 0.1  # cooled: the owner set shrinks back
    # sized by the rate less one standard deviation of the count: a prefix seen once is no
    # evidence of a hot one; a steady 20/s (200 per window) loses about 7 %
    assert rates.confident_rate(3, now) == 0.0
    once = KeyRates(window_s=10.0)
    once.add(9, 0.0)
    assert once.confident_rate(9, 0.0) == 0.0
    twice = KeyRates(window_s=10.0)  # two requests at once at a fresh node: not hot either
    twice.add(9, 0.0)
    twice.add(9, 0.0)
    assert twice.confident_rate(9, 0.0) < 0.3
    assert 20.0 * 0.9 < rates.confident_rate(1, now) < rates.rate(1, now)
    small = KeyRates(window_s=1.0, max_keys=8)
    for key in range(20):
        small.add(key, float(key))
    assert len(small) <= 8 and small.rate(19, 19.0) > 0  # bounded; the recent ones kept
