"""Schedules: who receives each request, and when — and what schedule a request list ran.

* ``sequential`` (the paper's): entry nodes round-robin, one request at a time, each sent
  after the previous one completed — no ``t``.
* ``closed``: ``concurrency`` clients, each sending its next request when its previous one
  finished (no ``t``; the runner's choice, recorded here).
* ``poisson``: open-loop arrivals at ``rate`` requests/s with exponential gaps (seeded); the
  client sends at ``t`` whether or not earlier requests finished, so queues and push-back
  matter. Entries still round-robin.
* ``bursty``: open loop at ``rate`` with gamma-distributed gaps of coefficient of variation
  ``cv`` (shape 1/cv², so cv 1 is Poisson; 2-4 is the bursty traffic serving benchmarks use),
  conditioned on the run's length as ``poisson`` is.
* ``trace``: open loop at the arrival times ``t`` a trace's lines carry.
Whatever the schedule, a request naming an earlier one in ``after`` (the next turn of a
conversation, the next step of an agent's task) is not sent before that one has finished
(:class:`Sessions`): a closed-loop client takes the next request that may go, an open-loop
arrival whose predecessor is still running is held until it finishes (its latency counts from
when it was sent: what its user waits). With a think time (:func:`think_time`, ``--think-time``)
such a turn goes no earlier than its predecessor's answer plus the user's think time. A request
list without ``after`` runs as before.
A request that already names an ``entry`` (e.g. from a trace) keeps it, unless entries are
drawn at random (:func:`random_entries`, ``--entry random``: clients spread over the nodes by
DNS or an L4 balancer, where round-robin entry thins the arrivals evenly and so makes no
routing a round-robin balancer). :func:`describe` says which of these a request list *is*
(what the runner will do with it), for ``summary.json``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

from radixmesh.core.units import parse_choice
from radixmesh.workload.request import Request


class Schedule(StrEnum):
    SEQUENTIAL = "sequential"
    CLOSED = "closed"
    POISSON = "poisson"
    BURSTY = "bursty"
    TRACE = "trace"

    @property
    def timed(self) -> bool:
        """Open-loop arrivals at a rate (Poisson or bursty)."""
        return self in (Schedule.POISSON, Schedule.BURSTY)


DEFAULT_CV = 3.0  # bursty arrivals: the gaps' coefficient of variation (--arrival-cv)


class Entry(StrEnum):
    """Which node each request enters at."""

    GIVEN = "given"  # the workload's own (a trace's, chat's random ones), else round-robin
    RANDOM = "random"  # uniform at random, seeded, for every request

    @classmethod
    def parse(cls, text: str) -> Entry:
        return parse_choice(cls, text, "entry")


class Sessions:
    """Which requests of a list may be sent now: a request naming an earlier one in
    ``Request.after`` waits until that one has finished (ok or not). Drives every schedule
    of the benchmark and of the simulator (one implementation of the dependency).

    Closed loop: :meth:`take` returns the first pending request (in list order) that may go,
    None while none may; :meth:`finish` marks one finished. Open loop: :meth:`arrive` says
    whether an arrival may go now; if not, it is held, and the :meth:`finish` of its
    predecessor returns it. An ``after`` naming no request of the list (dropped by admission,
    cut by ``--requests``) is no dependency; one naming a later request is an error."""

    __slots__ = ("_after", "_done", "_first", "_held", "_left", "_taken")

    def __init__(self, requests: Sequence[Request]) -> None:
        ids = {r.id for r in requests}
        index: dict[str, int] = {}  # id -> its latest index so far
        after: list[int] = []
        for i, r in enumerate(requests):
            j = -1 if r.after is None else index.get(r.after, -1)
            if j < 0 and r.after in ids:
                raise ValueError(f"request {r.id!r} waits for {r.after!r}, which comes after it")
            after.append(j)
            index[r.id] = i
        self._after = after
        self._done = [False] * len(requests)
        # closed loop: which requests were taken, the first index not taken, how many are left
        self._taken = [False] * len(requests)
        self._first = 0
        self._left = len(requests)
        self._held: dict[int, list[int]] = {}  # predecessor -> arrivals held for it (open loop)

    def __len__(self) -> int:
        """Requests not taken yet (closed loop)."""
        return self._left

    def ready(self, i: int) -> bool:
        j = self._after[i]
        return j < 0 or self._done[j]

    def take(self) -> int | None:
        """The first pending request that may go (now taken), or None if none may yet."""
        taken = self._taken
        for i in range(self._first, len(taken)):
            if not taken[i] and self.ready(i):
                taken[i] = True
                self._left -= 1
                while self._first < len(taken) and taken[self._first]:
                    self._first += 1
                return i
        return None

    def arrive(self, i: int) -> bool:
        """Request ``i``'s arrival time has come: True if it may go now, else it is held."""
        if self.ready(i):
            return True
        self._held.setdefault(self._after[i], []).append(i)
        return False

    def finish(self, i: int) -> list[int]:
        """Request ``i`` finished; returns the arrivals held for it, which may go now."""
        self._done[i] = True
        return self._held.pop(i, [])


def think_time(request_id: str, mean_s: float, seed: int) -> float:
    """How long a session's user thinks before sending ``request_id`` (a later turn): an
    exponential draw of mean ``mean_s`` from the request's own stream (seed and id), so every
    policy's run waits the same; 0 when ``mean_s`` is 0."""
    if mean_s <= 0:
        return 0.0
    return random.Random(f"think/{seed}/{request_id}").expovariate(1.0 / mean_s)


def random_entries(requests: Sequence[Request], nodes: int, seed: int) -> list[Request]:
    """Every request at a node drawn uniformly at random (seeded), whatever it named."""
    if nodes < 1:
        raise ValueError("nodes must be >= 1")
    rng = random.Random(f"entry/{seed}")
    return [r.with_entry(rng.randrange(nodes)) for r in requests]


def round_robin(requests: Sequence[Request], nodes: int) -> list[Request]:
    if nodes < 1:
        raise ValueError("nodes must be >= 1")
    return [r if r.entry is not None else r.with_entry(i % nodes) for i, r in enumerate(requests)]


def sequential(requests: Sequence[Request], nodes: int) -> list[Request]:
    return [r.with_time(None) for r in round_robin(requests, nodes)]


def poisson(requests: Sequence[Request], nodes: int, rate: float, seed: int) -> list[Request]:
    """Open-loop arrivals offering exactly ``rate``: a Poisson process *conditioned on* the
    run's length. The exponential gaps are drawn (seeded) and scaled so that the n arrivals
    span (n - 1) / rate seconds; given the count, that is the same law as a Poisson process
    over that window (uniform order statistics). Unscaled, a short run's offered rate is
    itself random: one 60-request draw offered 0.73× the rate asked for."""
    if rate <= 0:
        raise ValueError("rate must be > 0 requests/s")
    rng = random.Random(f"poisson/{seed}")
    return _spaced(round_robin(requests, nodes), rate, [rng.expovariate(1.0) for _ in requests[1:]])


def bursty(
    requests: Sequence[Request], nodes: int, rate: float, cv: float, seed: int
) -> list[Request]:
    """Open-loop arrivals offering exactly ``rate`` with gamma gaps of coefficient of
    variation ``cv`` (shape k = 1/cv², scale 1/k: mean 1), conditioned on the run's length as
    :func:`poisson` is. Large ``cv`` = long quiet spells and dense bursts."""
    if rate <= 0:
        raise ValueError("rate must be > 0 requests/s")
    if not cv > 0:
        raise ValueError(f"arrival cv must be > 0, got {cv!r}")
    rng = random.Random(f"bursty/{seed}/{cv!r}")
    k = 1.0 / (cv * cv)
    return _spaced(round_robin(requests, nodes), rate,
                   [rng.gammavariate(k, 1.0 / k) for _ in requests[1:]])  # fmt: skip


def timed(
    requests: Sequence[Request], nodes: int, rate: float, seed: int,
    kind: Schedule = Schedule.POISSON, cv: float = DEFAULT_CV,
) -> list[Request]:
    """``requests`` timed at ``rate`` by the open-loop ``kind`` (poisson or bursty)."""
    if kind is Schedule.BURSTY:
        return bursty(requests, nodes, rate, cv, seed)
    if kind is Schedule.POISSON:
        return poisson(requests, nodes, rate, seed)
    raise ValueError(f"{kind.value} arrivals are not timed at a rate")


def _spaced(timed: list[Request], rate: float, gaps: list[float]) -> list[Request]:
    """``timed`` at ``gaps`` (one fewer than requests) scaled so that the n arrivals span
    (n - 1) / rate seconds."""
    total = sum(gaps)
    scale = len(gaps) / rate / total if gaps and total > 0 else 0.0
    t = 0.0
    out: list[Request] = []
    for i, r in enumerate(timed):
        out.append(r.with_time(t))
        if i < len(gaps):
            t += gaps[i] * scale
    return out


def apply(
    requests: Sequence[Request], schedule: Schedule, nodes: int, rate: float | None, seed: int,
    cv: float = DEFAULT_CV,
) -> list[Request]:
    if schedule.timed:
        if rate is None:
            raise ValueError(f"the {schedule.value} schedule needs an arrival rate")
        return timed(requests, nodes, rate, seed, schedule, cv)
    if schedule is Schedule.TRACE:
        return round_robin(requests, nodes)
    return sequential(requests, nodes)


def is_open_loop(requests: Sequence[Request]) -> bool:
    return any(r.t is not None for r in requests)


def describe(
    requests: Sequence[Request], concurrency: int = 1, rate: float | None = None,
    arrivals: Schedule = Schedule.POISSON, cv: float | None = None,
) -> dict[str, Any]:
    """The schedule a request list runs under, as recorded in ``summary.json``: ``schedule``
    (a :class:`Schedule` value), ``arrival_rate`` (the Poisson rate asked for), the measured
    ``offered_rate`` (requests / arrival span, open loop only), ``concurrency`` and a
    human-readable ``schedule_text``."""
    if not is_open_loop(requests):
        kind = Schedule.CLOSED if concurrency > 1 else Schedule.SEQUENTIAL
        entry = "round-robin entry" if _round_robin(requests) else "the workload's entries"
        text = (f"closed loop, {concurrency} clients" if concurrency > 1
                else f"sequential (one at a time, {entry})")  # fmt: skip
        return _described(kind, None, None, concurrency, text)
    times = [r.t or 0.0 for r in requests]
    span = max(times) - min(times)
    offered = (len(times) - 1) / span if span > 0 else None
    kind = arrivals if rate else Schedule.TRACE
    text = f"open loop, {f'{arrival_text(arrivals, cv)} {rate:g} req/s' if rate else 'trace times'}"
    if offered is not None:
        text += f" (offered {offered:.2f} req/s over {span:.0f} s)"
    out = _described(kind, rate, offered, None, text)
    if kind is Schedule.BURSTY:
        out["arrival_cv"] = cv
    return out


def arrival_text(arrivals: Schedule, cv: float | None) -> str:
    """``Poisson`` or ``bursty (gamma, CV 3)``: how a timed schedule's arrivals come."""
    return "Poisson" if arrivals is Schedule.POISSON else f"bursty (gamma, CV {cv:g})"


def _round_robin(requests: Sequence[Request]) -> bool:
    entries = [r.entry for r in requests if r.entry is not None]
    if len(entries) < len(requests):
        return True  # the runner gives the missing ones in turn
    nodes = max(entries, default=0) + 1
    return all(e == i % nodes for i, e in enumerate(entries))


def _described(
    kind: Schedule, rate: float | None, offered: float | None, conc: int | None, text: str
) -> dict[str, Any]:
    return {"schedule": kind.value, "arrival_rate": rate, "offered_rate": offered,
            "concurrency": conc, "schedule_text": text}  # fmt: skip
