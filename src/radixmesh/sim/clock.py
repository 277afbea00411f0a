"""A discrete-event loop on a virtual clock.

Theory of operation
-------------------
Everything that happens in a simulation is a callback scheduled at a virtual time. The loop
pops the earliest one (ties in scheduling order, so a run is a pure function of its seed),
sets ``now`` to its time and calls it; callbacks schedule further callbacks. Nothing sleeps:
a second of virtual time costs only the callbacks inside it.

Entries are plain tuples ``(time, seq, fn, args)`` on a binary heap — the cheapest thing
Python offers, which matters at millions of events.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

Callback = Callable[..., None]


class EventLoop:
    __slots__ = ("_heap", "_seq", "_stop", "events", "now")

    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0  # callbacks run so far
        self._heap: list[tuple[float, int, Callback, tuple[Any, ...]]] = []
        self._seq = 0
        self._stop = False

    def at(self, t: float, fn: Callback, *args: Any) -> None:
        """Run ``fn(*args)`` at virtual time ``t`` (never before ``now``)."""
        self._seq += 1
        heapq.heappush(self._heap, (t if t > self.now else self.now, self._seq, fn, args))

    def after(self, dt: float, fn: Callback, *args: Any) -> None:
        self.at(self.now + dt, fn, *args)

    def pending(self) -> int:
        return len(self._heap)

    def next_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def stop(self) -> None:
        """Make the running :meth:`run` return after the current callback."""
        self._stop = True

    def run(self, until: float | None = None) -> None:
        """Run callbacks in time order until none is left, ``until`` is passed or ``stop()``."""
        heap = self._heap
        pop = heapq.heappop
        limit = float("inf") if until is None else until
        count = self.events
        self._stop = False
        while heap and not self._stop:
            if heap[0][0] > limit:
                self.now = limit
                break
            t, _, fn, args = pop(heap)
            self.now = t
            fn(*args)
            count += 1
        self.events = count
