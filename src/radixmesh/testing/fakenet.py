"""A deterministic in-memory network on a virtual clock: the twin of the real peer transport.

Theory of operation
-------------------
``send(src, dst, payload, now)`` asks the core's in-memory network
(:meth:`radixmesh.core.link.Wire.copies`, with the network's own seeded ``random.Random``;
the simulator asks the same) what happens to one datagram on the link ``src -> dst``::

    partitioned?  -> dropped            loss?      -> dropped
    delay = base + U(0, jitter) [+ U(0, reorder_window) with probability reorder]
    duplicate?    -> a second copy with its own delay

Deliveries wait in the core's queue of datagrams in flight (:class:`radixmesh.core.link.
InFlight`, ordered by (time, order sent)); ``pop_due(now)`` hands out those that are due, in
order. This module adds the per-link table, the default link and the counters. Nothing here
reads a wall clock: whoever drives it owns time (see :class:`VirtualClock` and
:class:`radixmesh.testing.twin.TwinCluster`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from radixmesh.core import link as core_link
from radixmesh.core.link import InFlight, LinkConfig, Wire

__all__ = ["DEFAULT_LINK", "Datagram", "FakeNetwork", "LinkConfig", "VirtualClock"]

DEFAULT_LINK = LinkConfig(delay_s=0.001)  # the link of every pair not given its own


Datagram = core_link.Delivery[str, bytes]  # one datagram arriving: at, src, dst, payload


class VirtualClock:
    """A clock that only moves when told to: ``advance_to`` (never backwards), a test setting
    ``now``, or ``await sleep(s)`` (the sleeper's own wait: ``s`` + ``late`` pass at once).
    Calling it reads it, so it stands in for ``time.monotonic`` / ``loop.time``."""

    def __init__(self, start: float = 0.0, late: float = 0.0) -> None:
        self.now = start
        self.late = late  # each sleep wakes this much late (a loaded machine's timer)

    def __call__(self) -> float:
        return self.now

    def advance_to(self, t: float) -> None:
        if t > self.now:
            self.now = t

    async def sleep(self, seconds: float) -> None:
        self.now += seconds + self.late


class FakeNetwork:
    """Datagrams between addresses, with per-link faults and partitions."""

    def __init__(self, rng: random.Random, default: LinkConfig | None = None) -> None:
        self.default = default or DEFAULT_LINK
        self._links: dict[tuple[str, str], LinkConfig] = {}
        self.wire: Wire[str] = Wire(rng, self.link)
        self._flight: InFlight[str, bytes] = InFlight(self.wire)
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
        copies = self._flight.send(src, dst, payload, now)
        if not copies:
            self.stats["dropped"] += 1
        elif copies > 1:
            self.stats["duplicated"] += 1

    def next_time(self) -> float | None:
        return self._flight.next_time()

    def pop_due(self, now: float) -> list[Datagram]:
        out = self._flight.pop_due(now)
        self.stats["delivered"] += len(out)
        return out

    def pending(self) -> int:
        return len(self._flight)
