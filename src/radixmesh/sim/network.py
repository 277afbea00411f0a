"""The simulated network: the simulator's shell around :mod:`radixmesh.core.link` — node
crashes/restarts, the partition schedule, region assignment and the CLI spellings of them.

Theory of operation
-------------------
Nodes are numbered ``0..N-1``. A message from ``a`` to ``b`` sent at ``t`` either arrives at
``t + delay(a, b)`` or never; every decision is the core's in-memory network's
(:class:`radixmesh.core.link.Wire` over :class:`radixmesh.core.link.LinkConfig`, drawn from
this run's own ``random.Random``; the twin cluster and the in-memory peer transport of the
tests use the same ``Wire``):

* ``delay(a, b)`` is one sample of the link ``a -> b``: its base is ``delay_s`` or, with
  regions, the one-way delay between the two nodes' regions (nodes are assigned to regions
  round-robin: node ``i`` lives in region ``i mod R``), plus jitter uniform in ``[0, jitter_s)``
  (as the runtime's ``--net-jitter``);
* gossip is lost with probability ``loss`` (forwards are not lost: they ride on TCP, which
  retransmits; a lossy link shows up in their latency instead);
* a message between the two sides of an active :class:`PartitionWindow` is dropped (a forward across
  it times out);
* a crashed node receives nothing (a forward to it is refused after one round trip).

Crashes and partitions are a schedule (:class:`Fault`, :class:`PartitionWindow`), applied by the
runner at their times; this module only answers "can a reach b now, and how late".
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from radixmesh.core import link as core_link
from radixmesh.core.link import LinkConfig, RegionDelays, Wire
from radixmesh.core.units import parse_duration

__all__ = [
    "Fault",
    "Network",
    "NetworkConfig",
    "PartitionWindow",
    "parse_duration",
    "parse_fault",
    "parse_nodes",
    "parse_partition",
    "parse_regions",
]


@dataclass(frozen=True, slots=True)
class PartitionWindow:
    """During ``[start_s, end_s)`` nodes in ``side`` cannot reach the others (both ways)."""

    start_s: float  # simulated seconds after warm-up at which the cut starts
    end_s: float  # ... and heals (exclusive)
    side: frozenset[int]  # the nodes cut off from all the others

    def __post_init__(self) -> None:
        if not self.side:
            raise ValueError("a partition needs at least one node on its side")
        self.cut()  # the core model validates the window

    def cut(self) -> core_link.Partition[int]:
        """This schedule entry as the core model: ``side`` against the rest, in its window."""
        return core_link.Partition((self.side,), self.start_s, self.end_s)

    def separates(self, a: int, b: int, now: float) -> bool:
        return self.cut().separates(a, b, now)


@dataclass(frozen=True, slots=True)
class Fault:
    """Node ``node`` crashes at ``crash_s`` (cache and queue lost) and, if ``restart_s`` is
    given, comes back then with a new incarnation and an empty cache."""

    node: int  # the node that crashes
    crash_s: float  # simulated seconds after warm-up at which it crashes
    restart_s: float | None = None  # when it comes back (None: never)

    def __post_init__(self) -> None:
        if self.node < 0 or self.crash_s < 0:
            raise ValueError("a fault needs node >= 0 and crash time >= 0")
        if self.restart_s is not None and self.restart_s <= self.crash_s:
            raise ValueError("restart must come after the crash")


@dataclass(frozen=True, slots=True)
class NetworkConfig:
    delay_s: float = 0.002  # one-way delay of every peer message (the paper's Δcomm)
    jitter_s: float = 0.0  # extra one-way delay, uniform in [0, jitter_s)
    loss: float = 0.0  # probability a gossip message is lost
    regions: tuple[str, ...] = ()  # region names; empty = one flat network
    region_delay_s: tuple[tuple[float, ...], ...] = ()  # one-way delay matrix [from][to]
    partitions: tuple[PartitionWindow, ...] = ()  # the partition schedule
    faults: tuple[Fault, ...] = field(default=())  # the crash/restart schedule

    def __post_init__(self) -> None:
        if not 0 <= self.loss < 1:
            raise ValueError("loss must be in [0, 1)")
        if self.region_delay_s and not self.regions:
            raise ValueError("a region delay matrix needs region names")
        self.links()  # the core models validate the delays, the jitter and the matrix

    def links(self) -> tuple[tuple[LinkConfig, ...], ...]:
        """``links()[i][j]``: the core link from region i to region j (1x1 when flat)."""
        flat = LinkConfig(delay_s=self.delay_s, jitter_s=self.jitter_s, loss=self.loss)
        if not self.regions:
            return ((flat,),)
        return RegionDelays(self.regions, self.region_delay_s).links(flat)


class Network:
    """Answers delivery questions for one run; owns the random stream for jitter and loss."""

    def __init__(self, config: NetworkConfig, n_nodes: int, rng: random.Random) -> None:
        self.config = config
        self.n_nodes = n_nodes
        self._rng = rng
        self._regions = len(config.regions)
        self._links = config.links()  # [region of a][region of b]
        self._modulus = len(self._links)
        self._down: set[int] = set()
        self.wire: Wire[int] = Wire(rng, self.link, (p.cut() for p in config.partitions))
        self.time_offset = 0.0  # partition times count from here (the end of warm-up)
        for p in config.partitions:
            if any(not 0 <= i < n_nodes for i in p.side):
                raise ValueError(f"partition names a node outside 0..{n_nodes - 1}")
        for f in config.faults:
            if f.node >= n_nodes:
                raise ValueError(f"fault names node {f.node}, outside 0..{n_nodes - 1}")

    # ----------------------------------------------------------------------------- queries
    def region_of(self, node: int) -> int:
        return node % self._regions if self._regions else 0

    def link(self, a: int, b: int) -> LinkConfig:
        """The link ``a -> b`` (its delay is the one between their regions)."""
        m = self._modulus
        return self._links[a % m][b % m]

    def base_delay(self, a: int, b: int) -> float:
        return self.link(a, b).delay_s

    def delay(self, a: int, b: int) -> float:
        m = self._modulus  # self.wire.delay(a, b), inlined: the simulator's hottest call
        return self._links[a % m][b % m].sample_delay(self._rng)

    def is_up(self, node: int) -> bool:
        return node not in self._down

    def partitioned(self, a: int, b: int, now: float) -> bool:
        return self.wire.separated(a, b, now - self.time_offset)

    def gossip_copies(self, a: int, b: int, now: float) -> tuple[float, ...]:
        """The delays after which a gossip message sent now from ``a`` reaches ``b``: none
        if lost or partitioned (``Wire.copies``: the loss draw, then the delay's)."""
        return self.wire.copies(a, b, now - self.time_offset)

    # --------------------------------------------------------------------------- mutations
    def set_down(self, node: int, down: bool) -> None:
        if down:
            self._down.add(node)
        else:
            self._down.discard(node)


# --------------------------------------------------------------------------------- parsing

def parse_nodes(text: str) -> frozenset[int]:
    """``"0-3,7"`` -> {0, 1, 2, 3, 7}."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi) if hi else int(lo)
        if first < 0 or last < first:
            raise ValueError(f"bad node range {part!r}")
        out.update(range(first, last + 1))
    if not out:
        raise ValueError(f"no nodes in {text!r}")
    return frozenset(out)


def parse_partition(text: str) -> PartitionWindow:
    """``"START-END:NODES"``, e.g. ``"10s-20s:0-1"`` cuts nodes 0 and 1 off for 10 s."""
    window, _, nodes = text.partition(":")
    start, sep, end = window.partition("-")
    if not sep or not nodes:
        raise ValueError(f"partition {text!r}: expected START-END:NODES, e.g. 10s-20s:0-1")
    return PartitionWindow(parse_duration(start), parse_duration(end), parse_nodes(nodes))


def parse_fault(text: str) -> Fault:
    """``"NODE@CRASH[:RESTART]"``, e.g. ``"2@5s:8s"`` (node 2 down from 5 s to 8 s)."""
    node, sep, times = text.partition("@")
    if not sep:
        raise ValueError(f"fault {text!r}: expected NODE@CRASH[:RESTART], e.g. 2@5s:8s")
    crash, _, restart = times.partition(":")
    return Fault(int(node), parse_duration(crash), parse_duration(restart) if restart else None)


def parse_regions(
    names: str, matrix_ms: str
) -> tuple[tuple[str, ...], tuple[tuple[float, ...], ...]]:
    """``"us,eu,ap"`` and ``"1,40,90;40,1,120;90,120,1"`` (one-way ms, rows = from)."""
    regions = tuple(n.strip() for n in names.split(",") if n.strip())
    rows: Sequence[str] = [r for r in matrix_ms.split(";") if r.strip()]
    matrix = tuple(tuple(float(x) / 1000.0 for x in row.split(",")) for row in rows)
    return regions, matrix
