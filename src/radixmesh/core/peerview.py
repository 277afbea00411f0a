"""Estimates of every peer's cache, as sets of block hashes, with an inverted index.

Theory of operation
-------------------
Each peer ``p`` is believed to hold a set ``S_p`` of block hashes (see :mod:`blocks`). Routing
needs, for one request with block hashes ``h_0 .. h_{n-1}``, the number of *leading* blocks each
peer holds: ``match_p = max k such that h_0..h_{k-1} are all in S_p``.

Instead of testing every peer, an inverted index maps each hash to a bitmask of the peers
holding it (bit ``slot(p)``). Matching walks the request's blocks once, AND-ing masks::

    alive = all peers          block 0: alive &= index[h0]   peers dropped here matched 0
                               block 1: alive &= index[h1]   peers dropped here matched 1 ...

so one match costs O(blocks) big-integer operations plus O(matched peers), independent of how
many peers hold nothing. Python ints are arbitrary-width, so 1,024 peers are a 1,024-bit mask.

The index is the only copy of the sets: ``S_p`` is the hashes whose mask has bit ``slot(p)``,
and only its size is kept per peer. Prefixes are what routing is for, so most hashes are held by
many peers, and one index entry with an N-bit mask is far smaller than N set entries (at 1,024
simulated nodes the per-peer sets were 5x the index). A hash held by one peer shares that peer's
single-bit mask object. The price is that whole-peer operations (a snapshot replacing an
estimate, dropping a peer, listing what it holds) scan the index: O(distinct hashes), and rare.

Mutations (snapshot replace, delta, optimistic insert, drop) keep the index and the per-peer
sizes in step. The view is advisory: it may be stale or wrong; a wrong estimate costs a cache
miss, never a wrong answer.
"""

from __future__ import annotations

import itertools
from collections.abc import Container, Iterable, Sequence
from random import Random  # the type only: instances are passed in, never the global one

PeerId = str


class PeerView:
    """Per-peer block-hash sets, stored only as an inverted index ``hash -> bitmask of peers``."""

    def __init__(self) -> None:
        self._size: dict[PeerId, int] = {}  # peers in the view -> hashes held
        self._slot: dict[PeerId, int] = {}
        self._bit: dict[PeerId, int] = {}  # 1 << slot, one shared object per peer
        self._peer_at: dict[int, PeerId] = {}
        self._free_slots: list[int] = []
        self._index: dict[int, int] = {}

    # ----------------------------------------------------------------------------- queries
    def peers(self) -> list[PeerId]:
        return list(self._size)

    def __contains__(self, peer: object) -> bool:
        return peer in self._size

    def held(self, peer: PeerId) -> frozenset[int]:
        """The hashes ``peer`` is believed to hold (empty if unknown). O(distinct hashes)."""
        bit = self._bit.get(peer)
        if bit is None or not self._size[peer]:
            return frozenset()
        return frozenset(h for h, mask in self._index.items() if mask & bit)

    def size(self, peer: PeerId) -> int:
        return self._size.get(peer, 0)

    def total_entries(self) -> int:
        """Sum over peers of the hashes each holds."""
        return sum(self._size.values())

    def match(self, hashes: Sequence[int]) -> dict[PeerId, int]:
        """Leading blocks of ``hashes`` held by each peer; peers matching 0 are omitted.

        Costs O(blocks + matched peers); routing uses :meth:`match_top`, which does not pay
        for every matched peer.
        """
        result: dict[PeerId, int] = {}
        for depth, mask in self.match_levels(hashes):
            self._record(mask, depth, result)
        return result

    def depth_of(self, peer: PeerId, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` that ``peer`` is believed to hold. O(that depth)."""
        bit = self._bit.get(peer)
        if bit is None:
            return 0
        get = self._index.get
        depth = 0
        for h in hashes:
            if not get(h, 0) & bit:
                break
            depth += 1
        return depth

    def match_levels(self, hashes: Sequence[int]) -> list[tuple[int, int]]:
        """``(depth, slot mask)`` pairs, deepest first: each peer in a mask holds exactly
        ``depth`` leading blocks. O(blocks) big-integer operations, whatever the peer count."""
        if not hashes or not self._index:
            return []
        levels: list[tuple[int, int]] = []
        get = self._index.get
        alive = get(hashes[0], 0)
        depth = 1
        for h in itertools.islice(hashes, 1, None):
            if not alive:
                break
            nxt = alive & get(h, 0)
            if nxt != alive:
                levels.append((depth, alive ^ nxt))  # nxt is a subset of alive
                alive = nxt
            depth += 1
        if alive:
            levels.append((depth, alive))
        levels.reverse()
        return levels

    def match_top(
        self,
        hashes: Sequence[int],
        k: int,
        rng: Random,
        skip: Container[PeerId] = (),
    ) -> list[tuple[PeerId, int]]:
        """Up to ``k`` peers with the deepest matches, deepest first, as ``(peer, depth)``.

        Peers in ``skip`` (e.g. suspect or pushed back) are passed over. Among peers of equal
        depth the sample starts at a random slot, so equal peers share the load instead of
        "the first peer" taking it all. Costs O(blocks + k + skipped), not O(matched peers).
        """
        out: list[tuple[PeerId, int]] = []
        if k <= 0:
            return out
        for depth, mask in self.match_levels(hashes):
            for peer in self._sample(mask, k - len(out), rng, skip):
                out.append((peer, depth))
            if len(out) >= k:
                break
        return out

    def _sample(
        self, mask: int, n: int, rng: Random, skip: Container[PeerId]
    ) -> list[PeerId]:
        """Up to ``n`` peers of ``mask``, scanning slots cyclically from a random one."""
        width = mask.bit_length()
        shift = rng.randrange(width)
        rotated = (mask >> shift) | ((mask & ((1 << shift) - 1)) << (width - shift))
        peer_at = self._peer_at
        out: list[PeerId] = []
        while rotated and len(out) < n:
            low = rotated & -rotated
            peer = peer_at[(low.bit_length() - 1 + shift) % width]
            if peer not in skip:
                out.append(peer)
            rotated ^= low
        return out

    def _record(self, mask: int, depth: int, out: dict[PeerId, int]) -> None:
        peer_at = self._peer_at
        while mask:
            low = mask & -mask
            out[peer_at[low.bit_length() - 1]] = depth
            mask ^= low

    # --------------------------------------------------------------------------- mutations
    def replace(self, peer: PeerId, hashes: Iterable[int]) -> None:
        """Replace ``peer``'s estimate with a full snapshot."""
        if self._size.get(peer):
            self._clear(peer)
        elif peer not in self._size:
            self._add_peer(peer)
        self._add(peer, hashes)

    def apply_delta(self, peer: PeerId, added: Iterable[int], removed: Iterable[int]) -> None:
        """Apply a change set: ``removed`` first, then ``added``."""
        if peer not in self._size:
            self._add_peer(peer)
        self._remove(peer, removed)
        self._add(peer, added)

    def optimistic_insert(self, peer: PeerId, hashes: Iterable[int]) -> None:
        """After a successful forward, assume ``peer`` now caches the request's blocks."""
        self.apply_delta(peer, hashes, ())

    def drop(self, peer: PeerId) -> None:
        """Forget ``peer`` entirely (dead, restarted or refused)."""
        if peer not in self._size:
            return
        if self._size[peer]:
            self._clear(peer)
        del self._size[peer]
        del self._bit[peer]
        slot = self._slot.pop(peer)
        del self._peer_at[slot]
        self._free_slots.append(slot)

    # ----------------------------------------------------------------------------- helpers
    def _add_peer(self, peer: PeerId) -> None:
        slot = self._free_slots.pop() if self._free_slots else len(self._slot)
        self._slot[peer] = slot
        self._bit[peer] = 1 << slot
        self._peer_at[slot] = peer
        self._size[peer] = 0

    def _add(self, peer: PeerId, hashes: Iterable[int]) -> None:
        bit = self._bit[peer]
        index = self._index
        get = index.get
        n = 0
        for h in hashes:
            mask = get(h)
            if mask is None:
                index[h] = bit  # the shared single-bit object: no allocation per hash
                n += 1
            elif not mask & bit:
                index[h] = mask | bit
                n += 1
        self._size[peer] += n

    def _remove(self, peer: PeerId, hashes: Iterable[int]) -> None:
        bit = self._bit[peer]
        index = self._index
        get = index.get
        n = 0
        for h in hashes:
            mask = get(h)
            if mask is None or not mask & bit:
                continue
            n += 1
            if mask == bit:
                del index[h]
            else:
                index[h] = mask ^ bit
        self._size[peer] -= n

    def _clear(self, peer: PeerId) -> None:
        """Remove every hash of ``peer``: one pass over the index."""
        bit = self._bit[peer]
        self._remove(peer, [h for h, mask in self._index.items() if mask & bit])
