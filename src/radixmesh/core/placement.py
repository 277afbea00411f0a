"""Where a new prefix goes when nobody holds it: the same owner from every entry node.

Theory of operation
-------------------
A request whose prefix no node has cached (as far as the deciding node can tell) would be
prefilled cold wherever it lands; if two entry nodes each keep it, the mesh pays for two cold
copies, and gossip is a round too slow to prevent it. So every node maps the prefix to an
*owner* with the same pure function of the same inputs — consistent hashing over the members
it can route to — and sends cold requests there when that costs little now::

    key   = the chained block hash at depth min(blocks, depth) - 1   (names the whole prefix
            up to there: a short common header, e.g. MMLU's 65 bytes, is one or two blocks,
            so prompts that differ after it get different keys; the same few-shot context
            gets the same key)
    ring  = 64 points per member (self and every routable peer; fewer above 64 members, at
            most 4,096 in all), sorted
    owner = the first *available* member clockwise from the key (at most 8 steps)

Every node's ring holds the members it believes alive, so two nodes agree on the owner as long
as their views of membership agree (they converge by gossip); a node that disagrees costs a
second cold copy, never a wrong answer. Different prefixes spread evenly over members.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence

import xxhash

POINTS_PER_MEMBER = 64  # virtual points of each member on the ring (spread within ~±20 %)
MAX_RING_POINTS = 4096  # ... fewer per member in large meshes (a ring per node: memory, CPU)
MIN_POINTS_PER_MEMBER = 4
MAX_WALK = 8  # members tried clockwise past an unavailable owner
_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: spreads a 64-bit key over the ring."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def placement_key(hashes: Sequence[int], depth_blocks: int) -> int | None:
    """The block hash that names the request's prefix for placement (None: no full block)."""
    if not hashes:
        return None
    return hashes[min(len(hashes), depth_blocks) - 1]


class Ring:
    """Consistent-hashing ring over member ids; rebuilt only when the members change."""

    def __init__(self) -> None:
        self._members: frozenset[str] = frozenset()
        self._points: list[int] = []
        self._owners: list[str] = []

    def update(self, members: Iterable[str]) -> None:
        ids = frozenset(members)
        if ids == self._members:
            return
        self._members = ids
        per = min(POINTS_PER_MEMBER, MAX_RING_POINTS // max(len(ids), 1))
        per = max(MIN_POINTS_PER_MEMBER, per)
        pairs = sorted(
            (_mix(xxhash.xxh64_intdigest(m.encode()) + i), m) for m in ids for i in range(per)
        )
        self._points = [p for p, _ in pairs]
        self._owners = [m for _, m in pairs]

    def owner(self, key: int, available: Callable[[str], bool]) -> str | None:
        """The first available member clockwise from ``key`` (None: none within the walk)."""
        if not self._points:
            return None
        start = bisect.bisect_left(self._points, _mix(key))
        seen: set[str] = set()
        for step in range(len(self._points)):
            member = self._owners[(start + step) % len(self._points)]
            if member in seen:
                continue
            if available(member):
                return member
            seen.add(member)
            if len(seen) >= MAX_WALK:
                return None
        return None
