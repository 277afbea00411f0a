"""Where a new prefix goes when nobody holds it: the same owner from every entry node.

Theory of operation
-------------------
A request whose prefix no node has cached (as far as the deciding node can tell) would be
prefilled cold wherever it lands; if two entry nodes each keep it, the mesh pays for two cold
copies, and gossip is a round too slow to prevent it. So every node maps the prefix to an
*owner* with the same pure function of the same inputs — consistent hashing over the members
it can route to — and sends cold requests there when that costs little now::

    key   = the chained block hash at depth min(blocks, max(depth, shared + 1)) - 1   (names
            the whole prefix up to there: a short common header, e.g. MMLU's 65 bytes, is a
            few blocks, so prompts that differ after it get different keys; the same few-shot
            context gets the same key. ``shared``: the blocks of the request that every member
            holds, checked in meshes of up to 32 members: a long header common to all prompts
            — a chat preamble, an agent's system prompt — would otherwise be the key of every
            request, so the key is the first block past it, which names the conversation or
            the task)
    ring  = 64 points per member (self and every routable peer; fewer above 64 members, at
            most 4,096 in all), sorted
    owner = the first *available* member clockwise from the key (at most 8 steps) that is
            not busier than ``(1 + placement_load_bound)`` × the mean utilization of the
            candidates (consistent hashing with bounded load; ``core/placer.py``); if
            every one is, the first available one

Every node's ring holds the members it believes alive, so two nodes agree on the owner as long
as their views of membership agree (they converge by gossip); a node that disagrees costs a
second cold copy, never a wrong answer. Different prefixes spread evenly over members, and
the bound keeps a member whose prefixes turned out popular from also collecting the new ones
(a busy member keeps what it holds: the bound decides only who makes a copy not yet made).

Hot prefixes: one owner cannot serve a prefix whose traffic exceeds its capacity, so the
*owner set* of a key is the first ``k`` available members clockwise (:meth:`Ring.owners`),
with ``k`` from the key's load (:func:`replicas_for`)::

    load(key) = global request rate of key × a warm request's service time   (node-seconds/s)
    k         = clamp(ceil(load / replica_load), 1, min(members, max_replicas))

The global rate is estimated from the deciding node's *own* traffic (:class:`KeyRates`: a
decayed count of the key's requests at this entry less one standard deviation of that count
(:meth:`KeyRates.confident_rate`), × the number of members — entry nodes see comparable
shares of the traffic in a mesh whose clients spread over it), so no message
carries it and it shrinks by itself when the prefix cools. Owner sets are nested (the owners
for ``k`` are the first ``k`` of those for ``k + 1``), so two nodes whose estimates differ
still agree on the owners they share: a node that underestimates uses fewer replicas, never
different ones.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence

import xxhash

from radixmesh.core.load_estimates import decayed_span

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


def placement_depth(blocks: int, depth_blocks: int, shared_blocks: int = 0) -> int:
    """How many of a request's ``blocks`` (>= 1) name its prefix for placement: the fixed
    ``depth_blocks``, or one block past the ``shared_blocks`` that every member already holds
    (a header common to all prompts: a chat preamble, an agent's system prompt, a few-shot
    prefix cached everywhere), whichever is deeper; never more than the request has."""
    if blocks < 1:
        raise ValueError("a request with no full block has no placement key")
    return min(blocks, max(depth_blocks, shared_blocks + 1))


def placement_key(hashes: Sequence[int], depth_blocks: int, shared_blocks: int = 0) -> int | None:
    """The block hash that names the request's prefix for placement (None: no full block)."""
    if not hashes:
        return None
    return hashes[placement_depth(len(hashes), depth_blocks, shared_blocks) - 1]


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

    def __len__(self) -> int:
        return len(self._members)

    def owner(self, key: int, available: Callable[[str], bool]) -> str | None:
        """The first available member clockwise from ``key`` (None: none within the walk)."""
        found = self.owners(key, 1, available)
        return found[0] if found else None

    def owners(self, key: int, k: int, available: Callable[[str], bool]) -> list[str]:
        """The first ``k`` distinct available members clockwise from ``key``, in ring order;
        at most ``MAX_WALK`` unavailable members are passed over (fewer owners then)."""
        out: list[str] = []
        if not self._points or k < 1:
            return out
        n = len(self._points)
        start = bisect.bisect_left(self._points, _mix(key))
        seen: set[str] = set()
        skipped = 0
        for step in range(n):
            member = self._owners[(start + step) % n]
            if member in seen:
                continue
            seen.add(member)
            if available(member):
                out.append(member)
                if len(out) >= k:
                    break
            else:
                skipped += 1
                if skipped >= MAX_WALK:
                    break
        return out


def replicas_for(load: float, replica_load: float, members: int, max_replicas: int) -> int:
    """Owners a key needs: its load (node-seconds of service per second) over what one replica
    should carry, at least 1 and at most ``min(members, max_replicas)`` (0 members: 0)."""
    cap = min(members, max_replicas)
    if cap < 1:
        return 0
    if not load > 0 or replica_load <= 0:
        return 1
    return max(1, min(cap, math.ceil(load / replica_load - 1e-9)))


class KeySums:
    """An exponentially decayed sum per placement key (time constant ``window_s``).

    Bounded: beyond ``max_keys`` keys the smallest half is forgotten (a key that mattered
    has a large sum, and comes back at its next observation)."""

    __slots__ = ("_sums", "max_keys", "window_s")

    def __init__(self, window_s: float, max_keys: int = 4096) -> None:
        if window_s <= 0 or max_keys < 1:
            raise ValueError("window_s must be > 0 and max_keys >= 1")
        self.window_s = window_s
        self.max_keys = max_keys
        self._sums: dict[int, tuple[float, float]] = {}  # key -> (decayed sum, at)

    def __len__(self) -> int:
        return len(self._sums)

    def add(self, key: int, now: float, amount: float = 1.0) -> None:
        self._sums[key] = (self.total(key, now) + amount, now)
        if len(self._sums) > self.max_keys:
            self._forget_smallest(now)

    def total(self, key: int, now: float) -> float:
        """The key's decayed sum (0: never seen, or long ago)."""
        entry = self._sums.get(key)
        if entry is None:
            return 0.0
        value, at = entry
        return value if now <= at else value * math.exp(-(now - at) / self.window_s)

    def _forget_smallest(self, now: float) -> None:
        ranked = sorted(self._sums, key=lambda k: self.total(k, now), reverse=True)
        self._sums = {k: self._sums[k] for k in ranked[: self.max_keys // 2]}


class KeyRates(KeySums):
    """Requests per second of each placement key at this node: a decayed count of its
    requests (:class:`KeySums`) over the time it covers.

    A decayed count of a steady rate ``r`` that began ``t`` seconds ago is
    ``r × window × (1 - exp(-t / window))``: it reaches ``r × window`` only after a few
    windows. So the count is divided by that span, with ``t`` the time since this node's
    first observed request (:meth:`span_s`), not by the window: dividing by the window
    under-reported a node's first ~30 s (at one window by 37 %), which on the real
    cluster was the whole of a 100-request run at 80 % load, and the one holder of a hot
    prefix got every request while its owner set stayed at one. ``t`` is floored at
    ``min_span`` × window (a quarter): a prefix seen once must not look hot. Dividing by
    the time observed itself (an earlier design) made a fresh node's first request of any
    prefix count as 64 requests per window; times the members, that made up to every member an
    owner, and the entry node picked among them (itself first, else at random): two entry
    nodes picked different owners for one new prefix (a second copy) in a run's first
    seconds, and in the simulator at 64 nodes (cpu-tiny, uniform) the router tagged 117
    requests a `replica`, 9 without."""

    __slots__ = ("_since", "min_span")

    def __init__(self, window_s: float, max_keys: int = 4096, min_span: float = 0.25) -> None:
        super().__init__(window_s, max_keys)
        if not min_span > 0:
            raise ValueError("min_span must be > 0")
        self.min_span = min_span
        self._since: float | None = None  # this node's first observed request

    def add(self, key: int, now: float, amount: float = 1.0) -> None:
        if self._since is None:
            self._since = now
        super().add(key, now, amount)

    def span_s(self, now: float) -> float:
        """The seconds of traffic a decayed count covers: ``window`` × (1 - exp(-t / window)),
        ``t`` the time observed (at least ``min_span`` windows)."""
        observed = 0.0 if self._since is None else now - self._since
        return decayed_span(self.window_s, observed, self.min_span)

    def rate(self, key: int, now: float) -> float:
        """The key's requests per second here (0: never seen, or long cold)."""
        return self.total(key, now) / self.span_s(now)

    def confident_rate(self, key: int, now: float) -> float:
        """The key's rate less one standard deviation of its count (a Poisson count ``n`` is
        known to about ±√n): what replicas are sized by. A prefix seen once or twice in a
        window is no evidence of a hot one. With the plain rate, one request in the window
        made a key look hot as soon as a warm request took more than ``replica_load`` ×
        window / members (1.25 s on 4 nodes): on the real cluster with 4 and 16 clients,
        where 16 node processes share 2 cores and a warm MMLU request took 1-2 s, 17-25 of
        500 requests made `replica` copies of subjects with a few requests a minute."""
        n = self.total(key, now)
        return max(0.0, n - math.sqrt(n)) / self.span_s(now)
