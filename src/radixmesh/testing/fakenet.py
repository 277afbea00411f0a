"""A deterministic in-memory network on a virtual clock: the twin of the real peer transport.

Theory of operation
-------------------
``send(src, dst, payload, now)`` decides, with the network's own seeded ``random.Random``,
what happens to one datagram on the link ``src -> dst``::

    partitioned?  -> dropped            loss?      -> dropped
    delay = base + U(0, jitter) [+ U(0, reorder_window) with probability reorder]
    duplicate?    -> a second copy with its own delay

Deliveries wait in a heap ordered by (time, sequence number); ``pop_due(now)`` hands out those
that are due, in order. Nothing here reads a wall clock: whoever drives it owns time (see
:class:`VirtualClock` and :class:`radixmesh.testing.cluster.Cluster`).
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LinkConfig:
    """How one direction of a link misbehaves."""

    delay_s: float = 0.001  # base one-way delay
    jitter_s: float = 0.0  # plus uniform [0, jitter_s)
    loss: float = 0.0  # probability a datagram is dropped
    duplicate: float = 0.0  # probability a datagram is delivered twice
    reorder: float = 0.0  # probability a datagram is held back by up to reorder_window_s
    reorder_window_s: float = 0.05

    def __post_init__(self) -> None:
        if self.delay_s < 0 or self.jitter_s < 0 or self.reorder_window_s < 0:
            raise ValueError("delays must be >= 0")
        for name in ("loss", "duplicate", "reorder"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be a probability")


@dataclass(frozen=True, slots=True)
class Delivery:
    at: float
    src: str
    dst: str
    payload: bytes


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
        self._rng = rng
        self.default = default or LinkConfig()
        self._links: dict[tuple[str, str], LinkConfig] = {}
        self._group: dict[str, int] = {}  # address -> partition group (absent: group 0)
        self._queue: list[tuple[float, int, Delivery]] = []
        self._seq = 0
        self.stats = {"sent": 0, "delivered": 0, "dropped": 0, "duplicated": 0, "bytes": 0}

    # --------------------------------------------------------------------------- faults
    def set_link(self, src: str, dst: str, config: LinkConfig) -> None:
        self._links[(src, dst)] = config

    def set_default(self, config: LinkConfig) -> None:
        self.default = config

    def partition(self, *groups: set[str] | frozenset[str] | list[str]) -> None:
        """Split the given addresses into groups that cannot reach each other."""
        self._group = {addr: i + 1 for i, group in enumerate(groups) for addr in group}

    def heal(self) -> None:
        self._group = {}

    def reachable(self, src: str, dst: str) -> bool:
        return self._group.get(src, 0) == self._group.get(dst, 0)

    # ------------------------------------------------------------------------- datagrams
    def send(self, src: str, dst: str, payload: bytes, now: float) -> None:
        self.stats["sent"] += 1
        self.stats["bytes"] += len(payload)
        link = self._links.get((src, dst), self.default)
        if not self.reachable(src, dst) or self._rng.random() < link.loss:
            self.stats["dropped"] += 1
            return
        self._schedule(src, dst, payload, now + self._delay(link))
        if link.duplicate and self._rng.random() < link.duplicate:
            self.stats["duplicated"] += 1
            self._schedule(src, dst, payload, now + self._delay(link))

    def _delay(self, link: LinkConfig) -> float:
        delay = link.delay_s + self._rng.random() * link.jitter_s
        if link.reorder and self._rng.random() < link.reorder:
            delay += self._rng.random() * link.reorder_window_s
        return delay

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
