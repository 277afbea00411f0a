"""A deterministic in-memory network on a virtual clock: the twin of the real peer transport.

Theory of operation
-------------------
``send(src, dst, payload, now)`` asks the core's in-memory network
(:meth:`radixmesh.core.link.Wire.copies`, with the network's own seeded ``random.Random``;
the simulator asks the same) what happens to one datagram on the link ``src -> dst``::

    partitioned?  -> dropped            loss?      -> dropped
    delay = base + U(0, jitter) [+ U(0, reorder_window) with probability reorder]
    duplicate?    -> a second copy with its own delay

Deliveries wait in a heap ordered by (time, sequence number); ``pop_due(now)`` hands out those
that are due, in order. Nothing here reads a wall clock: whoever drives it owns time (see
:class:`VirtualClock` and :class:`radixmesh.testing.cluster.TwinCluster`).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterable
from dataclasses import dataclass

from radixmesh.core.link import LinkConfig, Wire

__all__ = ["DEFAULT_LINK", "Delivery", "FakeNetwork", "LinkConfig", "VirtualClock"]

DEFAULT_LINK = LinkConfig(delay_s=0.001)  # the link of every pair not given its own


@dataclass(frozen=True, slots=True)
class Delivery:
    at: float  # virtual time of arrival
    src: str  # sender address
    dst: str  # receiver address
    payload: bytes  # the datagram


class VirtualClock:
    """A clock that only moves when told to (never backwards)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def advance_to(self, t: float) -> None:
        if t > self.now:
            self.now = t


class FakeNetwork:
    """Datagrams between addresses, with per-link faults and partitions."""

    def __init__(self, rng: random.Random, default: LinkConfig | None = None) -> None:
        self.default = default or DEFAULT_LINK
        self._links: dict[tuple[str, str], LinkConfig] = {}
        self.wire: Wire[str] = Wire(rng, self.link)
        self._queue: list[tuple[float, int, Delivery]] = []
        self._seq = 0
        self.stats = {"sent": 0, "delivered": 0, "dropped": 0, "duplicated": 0, "bytes": 0}

    # --------------------------------------------------------------------------- faults
    def set_link(self, src: str, dst: str, config: LinkConfig) -> None:
        self._links[(src, dst)] = config

    def set_default(self, config: LinkConfig) -> None:
        self.default = config

    def link(self, src: str, dst: str) -> LinkConfig:
        return self._links.get((src, dst), self.default)

    def partition(self, *groups: Iterable[str]) -> None:
        """Split the given addresses into groups that cannot reach each other (addresses no
        group names form one more group)."""
        self.wire.partition(*groups)

    def heal(self) -> None:
        self.wire.heal()

    def reachable(self, src: str, dst: str) -> bool:
        return not self.wire.separated(src, dst)

    # ------------------------------------------------------------------------- datagrams
    def send(self, src: str, dst: str, payload: bytes, now: float) -> None:
        self.stats["sent"] += 1
        self.stats["bytes"] += len(payload)
        if not self.reachable(src, dst):
            self.stats["dropped"] += 1
            return
        copies = self.wire.copies(src, dst)
        if not copies:
            self.stats["dropped"] += 1
        elif len(copies) > 1:
            self.stats["duplicated"] += 1
        for delay in copies:
            self._schedule(src, dst, payload, now + delay)

    def _schedule(self, src: str, dst: str, payload: bytes, at: float) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (at, self._seq, Delivery(at, src, dst, payload)))

    def next_time(self) -> float | None:
        return self._queue[0][0] if self._queue else None

    def pop_due(self, now: float) -> list[Delivery]:
        out = []
        while self._queue and self._queue[0][0] <= now:
            out.append(heapq.heappop(self._queue)[2])
        self.stats["delivered"] += len(out)
        return out

    def pending(self) -> int:
        return len(self._queue)
