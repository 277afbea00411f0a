"""Schedules: who receives each request, and when.

* ``sequential`` (the paper's): entry nodes round-robin, one request at a time, each sent
  after the previous one completed — no ``t``.
* ``poisson``: open-loop arrivals at ``rate`` requests/s with exponential gaps (seeded); the
  client sends at ``t`` whether or not earlier requests finished, so queues and push-back
  matter. Entries still round-robin.
A request that already names an ``entry`` (e.g. from a trace) keeps it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from enum import StrEnum

from radixmesh.workload.request import Request


class Schedule(StrEnum):
    SEQUENTIAL = "sequential"
    POISSON = "poisson"


def round_robin(requests: Sequence[Request], nodes: int) -> list[Request]:
    if nodes < 1:
        raise ValueError("nodes must be >= 1")
    return [r if r.entry is not None else r.with_entry(i % nodes) for i, r in enumerate(requests)]


def sequential(requests: Sequence[Request], nodes: int) -> list[Request]:
    return [r.with_time(None) for r in round_robin(requests, nodes)]


def poisson(requests: Sequence[Request], nodes: int, rate: float, seed: int) -> list[Request]:
    if rate <= 0:
        raise ValueError("rate must be > 0 requests/s")
    rng = random.Random(f"poisson/{seed}")
    t = 0.0
    out: list[Request] = []
    for r in round_robin(requests, nodes):
        out.append(r.with_time(t))
        t += rng.expovariate(rate)
    return out


def apply(
    requests: Sequence[Request], schedule: Schedule, nodes: int, rate: float | None, seed: int
) -> list[Request]:
    if schedule is Schedule.POISSON:
        if rate is None:
            raise ValueError("the poisson schedule needs an arrival rate")
        return poisson(requests, nodes, rate, seed)
    return sequential(requests, nodes)
