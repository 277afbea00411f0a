"""Engines that share one machine's cores: processor sharing between the simulated nodes.

Theory of operation
-------------------
By default every simulated node has its own hardware: a request's service time is what the
cost model says, whatever the other nodes do. On a real deployment that is one GPU per
node; it is not what happens when several nodes share one device — four engine processes
on one GPU (``--gpu-memory-fraction``), or the benchmark's 4-node clusters on one 2-core
machine. There, a node that is idle adds no capacity: moving a request to it moves the work,
it does not do it sooner, and the policy that computes least wins.

:class:`SharedCompute` models that. Each engine runs one step (or run of decode steps) at a
time, and that step holds *work*: its time on an otherwise idle machine (the step-time
model's figure); below, "a request" is such a step. ``cores`` is how many requests the machine
runs at full speed at once; with ``n`` running, each progresses at ``min(1, cores / n)``
seconds of work per second (egalitarian processor sharing, as the OS scheduler shares cores
between engine processes, each of which runs one request at a time). Whenever a request
starts or ends, the others' remaining work is brought up to date and their completions are
scheduled again; a completion scheduled before the last change is stale and ignored (a
version number per request). A request that ends reports how long it really took, which is
what a real node measures and learns its speed from.

Each change reschedules every running request: O(running) per start or end, fine for the
tens of nodes such a machine holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from radixmesh.sim.clock import EventLoop

OnServed = Callable[[float], None]  # called with the request's elapsed (wall) service time


@dataclass(slots=True)
class _Job:
    remaining: float  # seconds of work left at full speed
    started: float
    done: OnServed
    version: int = 0


class SharedCompute:
    """Processor sharing of ``cores`` between the requests running on one machine."""

    def __init__(self, loop: EventLoop, cores: float) -> None:
        if not cores > 0:
            raise ValueError("shared cores must be > 0")
        self.loop = loop
        self.cores = cores
        self._jobs: dict[int, _Job] = {}
        self._at = 0.0  # when the remaining work was last brought up to date
        self._next_key = 0

    @property
    def running(self) -> int:
        return len(self._jobs)

    def rate(self) -> float:
        """Seconds of work each running request does per second now."""
        n = len(self._jobs)
        return 1.0 if n <= self.cores else self.cores / n

    def start(self, work_s: float, done: OnServed) -> int:
        """Start a request of ``work_s`` seconds of work; ``done(elapsed)`` when it ends.
        Returns its key (for :meth:`cancel`)."""
        if work_s < 0:
            raise ValueError("work must be >= 0")
        self._advance()
        key = self._next_key
        self._next_key += 1
        self._jobs[key] = _Job(work_s, self.loop.now, done)
        self._reschedule()
        return key

    def cancel(self, key: int) -> None:
        """Drop a running request (its node crashed); the others speed up."""
        if key not in self._jobs:
            return
        self._advance()
        del self._jobs[key]
        self._reschedule()

    def _advance(self) -> None:
        now = self.loop.now
        spent = (now - self._at) * self.rate()
        if spent > 0:
            for job in self._jobs.values():
                job.remaining = max(job.remaining - spent, 0.0)
        self._at = now

    def _reschedule(self) -> None:
        rate = self.rate()
        now = self.loop.now
        for key, job in self._jobs.items():
            job.version += 1
            self.loop.at(now + job.remaining / rate, self._fire, key, job.version)

    def _fire(self, key: int, version: int) -> None:
        job = self._jobs.get(key)
        if job is None or job.version != version:
            return  # rescheduled since, or cancelled
        self._advance()
        del self._jobs[key]
        self._reschedule()
        job.done(self.loop.now - job.started)
