"""The one model of an unreliable network link, shared by the runtime, the simulator and tests.

Theory of operation
-------------------
A :class:`LinkConfig` says how one direction of a link misbehaves. Each message crossing it is
decided with a caller-supplied ``random.Random``, in this order::

    lost?        rng.random() < loss                      (no draw when loss == 0)
    delay        base + jitter * rng.random()             (no draw when jitter == 0)
                 [+ reorder_window * rng.random()  if rng.random() < reorder]
    duplicated?  rng.random() < duplicate                 (no draw when duplicate == 0)
                 -> a second copy with its own delay

so a fault that is switched off costs no random draw and a fixed seed replays the same run.
:meth:`LinkConfig.copies` is that whole sequence for one datagram; the shells that interleave
it with real time (the runtime sleeps between the steps) call :meth:`LinkConfig.lost`,
:meth:`LinkConfig.sample_delay` and :meth:`LinkConfig.duplicated` themselves, in that order.

A :class:`Partition` splits nodes (any hashable name) into groups that cannot reach each other,
in both directions, during ``[start_s, end_s)``; nodes no group names form one more group, "the
rest". :class:`RegionDelays` replaces the one-way delay by a per-region-pair matrix.
:class:`Wire` is the in-memory network built of them (a link per pair of endpoints, the
partitions, one random stream): the one that the simulator, the twin cluster, the in-memory
peer transport and the runtime's emulated network (each node is one endpoint of its own wire)
share. :class:`InFlight` is a wire with the datagrams on it that have not arrived yet, in order
of arrival (the twin cluster's network; the simulator schedules its arrivals on its own event
loop instead). Nothing here sleeps, reads a clock or owns a random stream: the shells
(``runtime/netem.py``, ``sim/network.py``, ``testing/fakenet.py``,
``testing/memtransport.py``) pass time and randomness in.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field, replace
from random import Random  # the type only: instances are passed in, never the global one
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
P = TypeVar("P")

REST = 0  # the group of a node that no group of a partition names


def _check_seconds(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")


def _check_probability(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1], got {value!r}")


@dataclass(frozen=True, slots=True)
class LinkConfig:
    """How one direction of a link misbehaves; the default is a perfect, instant link."""

    delay_s: float = 0.0  # base one-way delay
    jitter_s: float = 0.0  # extra one-way delay, uniform in [0, jitter_s)
    loss: float = 0.0  # probability that a message is dropped
    duplicate: float = 0.0  # probability that a message is delivered twice (2nd copy later)
    reorder: float = 0.0  # probability that a message is held back by up to reorder_window_s
    reorder_window_s: float = 0.05  # the longest extra hold-back of a reordered message

    def __post_init__(self) -> None:
        for name in ("delay_s", "jitter_s", "reorder_window_s"):
            _check_seconds(name, getattr(self, name))
        for name in ("loss", "duplicate", "reorder"):
            _check_probability(name, getattr(self, name))

    @property
    def active(self) -> bool:
        """Whether the link delays anything (False: messages may pass straight through)."""
        return self.delay_s > 0 or self.jitter_s > 0 or self.reorder > 0

    def with_delay(self, delay_s: float) -> LinkConfig:
        """The same link with another base delay (e.g. the one between two regions)."""
        return replace(self, delay_s=delay_s)

    # ------------------------------------------------------------------------ decisions
    def lost(self, rng: Random) -> bool:
        """Whether this message is dropped (draws only when ``loss > 0``)."""
        return self.loss > 0 and rng.random() < self.loss

    def duplicated(self, rng: Random) -> bool:
        """Whether this message is delivered a second time (draws only when ``duplicate > 0``)."""
        return self.duplicate > 0 and rng.random() < self.duplicate

    def sample_delay(self, rng: Random) -> float:
        """One one-way delay: base + jitter [+ a reorder hold-back], in ``[delay, delay + jitter
        + reorder_window)``."""
        delay = self.delay_s
        if self.jitter_s > 0:
            delay += self.jitter_s * rng.random()
        if self.reorder > 0 and rng.random() < self.reorder:
            delay += rng.random() * self.reorder_window_s
        return delay

    def copies(self, rng: Random) -> tuple[float, ...]:
        """The delays of the copies of one datagram that arrive: none if lost, two if
        duplicated (each with its own delay), otherwise one."""
        if self.lost(rng):
            return ()
        first = self.sample_delay(rng)
        if self.duplicated(rng):
            return (first, self.sample_delay(rng))
        return (first,)


@dataclass(frozen=True, slots=True)
class Partition(Generic[K]):
    """Nodes in different groups cannot reach each other (both ways) during the window; the
    nodes no group names form one more group. With the default window it holds forever."""

    groups: tuple[frozenset[K], ...]  # disjoint sets of nodes; the unnamed rest is one more
    start_s: float = 0.0  # the partition holds from this time on (inclusive)
    end_s: float = math.inf  # until this time (exclusive)
    _group: dict[K, int] = field(init=False, repr=False, compare=False)  # node -> group (1..)

    def __post_init__(self) -> None:
        if not 0 <= self.start_s < self.end_s:
            raise ValueError("a partition needs 0 <= start < end")
        index: dict[K, int] = {}
        for number, group in enumerate(self.groups, start=1):
            for node in group:
                if index.setdefault(node, number) != number:
                    raise ValueError(f"node {node!r} is in two groups of a partition")
        object.__setattr__(self, "_group", index)

    @classmethod
    def of(cls, *groups: Iterable[K], start_s: float = 0.0, end_s: float = math.inf
           ) -> Partition[K]:
        """A partition from any iterables of nodes (``Partition.of({"a"}, ["b", "c"])``)."""
        return cls(tuple(frozenset(g) for g in groups), start_s, end_s)

    def holds(self, now: float) -> bool:
        return self.start_s <= now < self.end_s

    def group_of(self, node: K) -> int:
        """The group number of ``node`` (1, 2, ... in order; :data:`REST` if unnamed)."""
        return self._group.get(node, REST)

    def separates(self, a: K, b: K, now: float = 0.0) -> bool:
        """Whether ``a`` and ``b`` cannot reach each other at ``now`` (symmetric)."""
        return self.holds(now) and self._group.get(a, REST) != self._group.get(b, REST)

    def cut_off(self, node: K, now: float = 0.0) -> bool:
        """Whether ``node`` cannot reach the unnamed rest at ``now`` (i.e. some group names
        it): how a node that keeps a set of peers it is cut off from asks the question."""
        return self.holds(now) and node in self._group


def separated(partitions: Iterable[Partition[K]], a: K, b: K, now: float = 0.0) -> bool:
    """Whether any of the partitions separates ``a`` and ``b`` at ``now``."""
    return any(p.separates(a, b, now) for p in partitions)


@dataclass(frozen=True, slots=True)
class RegionDelays:
    """One-way delays between named regions: ``delay_s[i][j]`` from region i to region j."""

    names: tuple[str, ...]  # the regions, in matrix order
    delay_s: tuple[tuple[float, ...], ...]  # square one-way delay matrix [from][to], seconds

    def __post_init__(self) -> None:
        r = len(self.names)
        if not r:
            raise ValueError("regions need at least one name")
        if len(self.delay_s) != r or any(len(row) != r for row in self.delay_s):
            raise ValueError(f"region delay matrix must be {r}x{r}")
        if any(not (math.isfinite(d) and d >= 0) for row in self.delay_s for d in row):
            raise ValueError("region delays must be finite and >= 0")

    def links(self, base: LinkConfig) -> tuple[tuple[LinkConfig, ...], ...]:
        """``base`` with each region pair's delay: ``links(base)[i][j]`` is the i -> j link."""
        return tuple(tuple(base.with_delay(d) for d in row) for row in self.delay_s)


class Wire(Generic[K]):
    """The in-memory network between named endpoints: which link joins two of them, which
    partitions cut them apart, and so what becomes of each message sent now (the copies that
    arrive, after which delays). One random stream, passed in, decides every message in the
    order it is sent: the simulator (``sim/network.py``), the twin cluster's datagrams
    (``testing/fakenet.py``), the in-memory peer transport (``testing/memtransport.py``) and
    the runtime's emulated network (``runtime/netem.py``) all ask it; none keeps a partition
    or draws a fault of its own."""

    def __init__(self, rng: Random, link: Callable[[K, K], LinkConfig],
                 partitions: Iterable[Partition[K]] = ()) -> None:
        self.rng = rng  # the run's own stream (never the global one)
        self.link = link  # the link a -> b
        self.partitions: tuple[Partition[K], ...] = tuple(partitions)

    def partition(self, *groups: Iterable[K]) -> None:
        """From now on, until :meth:`heal`: the groups cannot reach each other (the endpoints
        no group names form one more group)."""
        self.partitions = (Partition.of(*groups),)

    def heal(self) -> None:
        self.partitions = ()

    def separated(self, a: K, b: K, now: float = 0.0) -> bool:
        """Whether a partition cuts ``a`` from ``b`` at ``now`` (no random draw)."""
        return bool(self.partitions) and separated(self.partitions, a, b, now)

    def copies(self, a: K, b: K, now: float = 0.0) -> tuple[float, ...]:
        """The delays of the copies of one message ``a -> b`` sent at ``now`` that arrive
        (none across a partition: no draw then; see :meth:`LinkConfig.copies`)."""
        if self.separated(a, b, now):
            return ()
        return self.link(a, b).copies(self.rng)

    def delay(self, a: K, b: K) -> float:
        """One one-way delay ``a -> b`` (a message that cannot be lost: a stream's bytes)."""
        return self.link(a, b).sample_delay(self.rng)


@dataclass(frozen=True, slots=True)
class Delivery(Generic[K, P]):
    """One copy of a datagram arriving."""

    at: float  # time of arrival
    src: K  # sender
    dst: K  # receiver
    payload: P  # the datagram


class InFlight(Generic[K, P]):
    """The datagrams on a :class:`Wire` that have not arrived yet: ``send`` asks the wire what
    becomes of one (:meth:`Wire.copies`) and queues each copy at its arrival time; ``pop_due``
    hands out those due, by (arrival time, order sent)."""

    def __init__(self, wire: Wire[K]) -> None:
        self.wire = wire
        self._queue: list[tuple[float, int, Delivery[K, P]]] = []
        self._seq = 0

    def send(self, src: K, dst: K, payload: P, now: float) -> int:
        """Put one datagram on the wire at ``now``; the number of copies that will arrive
        (0: lost or partitioned, 2: duplicated)."""
        copies = self.wire.copies(src, dst)
        for delay in copies:
            self._seq += 1
            at = now + delay
            heapq.heappush(self._queue, (at, self._seq, Delivery(at, src, dst, payload)))
        return len(copies)

    def next_time(self) -> float | None:
        """When the next copy arrives (None: nothing in flight)."""
        return self._queue[0][0] if self._queue else None

    def pop_due(self, now: float) -> list[Delivery[K, P]]:
        """The copies that have arrived by ``now``, in order of arrival."""
        out = []
        while self._queue and self._queue[0][0] <= now:
            out.append(heapq.heappop(self._queue)[2])
        return out

    def __len__(self) -> int:
        return len(self._queue)
