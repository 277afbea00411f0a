"""PeerView.match / match_levels / match_top against brute force over per-peer hash sets."""

from __future__ import annotations

import random

import hypothesis.strategies as st
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from radixmesh.core.peerview import PeerView

PEERS = [f"p{i}" for i in range(6)]
hash_st = st.integers(0, 11)  # few hashes so that peers share and prefixes overlap
hashes_st = st.lists(hash_st, max_size=10)


def brute(held: dict[str, set[int]], request: list[int]) -> dict[str, int]:
    out = {}
    for peer, have in held.items():
        n = 0
        while n < len(request) and request[n] in have:
            n += 1
        if n:
            out[peer] = n
    return out


class PeerViewMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.view = PeerView()
        self.model: dict[str, set[int]] = {}

    @rule(peer=st.sampled_from(PEERS), hashes=hashes_st)
    def replace(self, peer: str, hashes: list[int]) -> None:
        self.view.replace(peer, hashes)
        self.model[peer] = set(hashes)

    @rule(peer=st.sampled_from(PEERS), added=hashes_st, removed=hashes_st)
    def apply_delta(self, peer: str, added: list[int], removed: list[int]) -> None:
        self.view.apply_delta(peer, added, removed)
        self.model[peer] = (self.model.get(peer, set()) - set(removed)) | set(added)

    @rule(peer=st.sampled_from(PEERS), hashes=hashes_st)
    def optimistic_insert(self, peer: str, hashes: list[int]) -> None:
        self.view.optimistic_insert(peer, hashes)
        self.model.setdefault(peer, set()).update(hashes)

    @rule(peer=st.sampled_from(PEERS))
    def drop(self, peer: str) -> None:  # a later insert for any peer reuses the freed slot
        self.view.drop(peer)
        self.model.pop(peer, None)

    @rule(request=hashes_st)
    def match(self, request: list[int]) -> None:
        assert self.view.match(request) == brute(self.model, request)

    @rule(
        request=hashes_st,
        k=st.integers(0, 7),
        seed=st.integers(0, 3),
        skip=st.sets(st.sampled_from(PEERS)),
    )
    def match_top(self, request: list[int], k: int, seed: int, skip: set[str]) -> None:
        top = self.view.match_top(request, k, random.Random(seed), skip)
        expected = {p: n for p, n in brute(self.model, request).items() if p not in skip}
        assert len(top) == min(k, len(expected))
        assert len({p for p, _ in top}) == len(top)
        for peer, depth in top:
            assert expected[peer] == depth
        depths = [d for _, d in top]
        assert depths == sorted(depths, reverse=True)
        if top:  # nothing left out is deeper than what was returned
            left_out = [n for p, n in expected.items() if p not in dict(top)]
            assert all(n <= depths[-1] for n in left_out)

    @rule(request=hashes_st)
    def match_levels(self, request: list[int]) -> None:
        levels = self.view.match_levels(request)
        assert [d for d, _ in levels] == sorted({d for d, _ in levels}, reverse=True)
        assert all(mask for _, mask in levels)

    @invariant()
    def bookkeeping(self) -> None:
        assert sorted(self.view.peers()) == sorted(self.model)
        for peer, have in self.model.items():
            assert self.view.held(peer) == have and self.view.size(peer) == len(have)
            assert peer in self.view
        assert self.view.total_entries() == sum(len(s) for s in self.model.values())


PeerViewMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None
)
TestPeerViewModel = PeerViewMachine.TestCase


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_match_top_spreads_over_equal_peers(seed: int) -> None:
    view = PeerView()
    for i in range(16):
        view.replace(f"p{i}", [1, 2, 3])
    rng = random.Random(seed)
    heads = {view.match_top([1, 2, 3], 1, rng)[0][0] for _ in range(40)}
    assert len(heads) > 1  # never always "the first peer"


def test_unknown_peer_queries_are_empty() -> None:
    view = PeerView()
    assert view.match([1, 2]) == {} and view.held("x") == frozenset() and view.size("x") == 0
    view.drop("x")  # dropping an unknown peer is a no-op
    assert view.match_top([1], 3, random.Random(0)) == []


def test_match_top_is_deterministic_for_a_seed() -> None:
    view = PeerView()
    for i in range(40):
        view.replace(f"p{i}", [1, 2, 3][: 1 + i % 3])
    runs = [view.match_top([1, 2, 3], 5, random.Random(42)) for _ in range(2)]
    assert runs[0] == runs[1]
    assert [d for _, d in runs[0]] == [3, 3, 3, 3, 3]
