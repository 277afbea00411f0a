"""Network emulation for experiments: delay, jitter, loss and partitions on peer messages.

Theory of operation
-------------------
Every peer exchange is initiated by one node (gossip push, forward). The *initiating* node
emulates the link for both directions of that exchange, so each direction is delayed exactly
once even when nodes run with different settings::

    A (initiator)                                   B
      ── sleep(delay + U(0, jitter)) ── request ──▶      (B adds nothing)
      ◀── response chunk ── released at arrival + delay + U(0, jitter), in order

Loss and duplication apply to gossip only (a lost forward would just be a slow failure); a
duplicate is sent again after a further one-way delay, so it also arrives out of order. A
partition is a set of peers (node ids or ``host:port`` addresses) this node is cut off from:
messages to them are not sent (forwards fail at once, like an unreachable host) and messages
from them are dropped on arrival. Partitions are changed at run time (``POST /admin/partition``).

Per-peer delays (``serve --net-peer-delays ADDRESS=OUT[/BACK],...``, what ``radixmesh bench
--regions`` gives each node): the exchanges this node starts with that peer take OUT as the
request's one-way delay and BACK (default OUT) as each response chunk's, instead of
``--net-delay``; jitter, loss and the rest still come from the one link config. A peer is named
by the address this node reaches it at (``host:port``).

Every decision (lost? duplicated? which delay? cut off?) is the core's in-memory network's
(:class:`radixmesh.core.link.Wire`, as for the simulator and the tests: this node is one endpoint
of it, each peer name another); this module only sleeps, delays streams and counts. Its
``reorder`` probability adds a hold-back to a delay (gossip then arrives out of order; the
chunks of one stream stay in order, as on TCP).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import TypeVar

from radixmesh.core.link import LinkConfig, Wire
from radixmesh.core.units import parse_duration

T = TypeVar("T")

__all__ = ["Netem", "NetemConfig", "PeerDelays", "format_peer_delays", "parse_peer_delays"]

NetemConfig = LinkConfig  # the runtime's name for the link one node emulates
PeerDelays = Mapping[str, tuple[float, float]]  # peer address -> (out, back) one-way delays
TIMER_RESOLUTION_S = 0.001  # uvloop's (libuv's) timers: whole milliseconds
SELF = ""  # this node's endpoint on its wire (no peer is named "": partitions strip names)


def parse_peer_delays(text: str) -> dict[str, tuple[float, float]]:
    """``"127.0.0.1:8001=40ms,127.0.0.1:8002=90ms/120ms"`` -> {address: (out_s, back_s)};
    BACK defaults to OUT. ValueError naming the bad entry."""
    out: dict[str, tuple[float, float]] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        address, sep, delays = part.rpartition("=")
        there, _, back = delays.partition("/")
        try:
            if not sep or not address.strip():
                raise ValueError("no ADDRESS=")
            pair = (parse_duration(there), parse_duration(back or there))
        except ValueError as exc:
            raise ValueError(f"net_peer_delays: {part!r} is not ADDRESS=OUT[/BACK] ({exc})"
                             ) from None  # fmt: skip
        if min(pair) < 0:
            raise ValueError(f"net_peer_delays: {part!r}: delays must be >= 0")
        out[address.strip()] = pair
    return out


def format_peer_delays(delays: PeerDelays) -> str:
    """The flag text :func:`parse_peer_delays` reads back (seconds, 9 significant digits)."""
    return ",".join(f"{a}={o:.9g}/{b:.9g}" for a, (o, b) in delays.items())


class Netem:
    """The link model one node applies; owns its own ``random.Random``."""

    def __init__(self, config: LinkConfig, seed: int = 0, peers: PeerDelays | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock  # what delays are measured on (a virtual loop's time in tests)
        self.peers = dict(peers or {})  # address -> (out, back): this peer's own delays
        self.wire: Wire[str] = Wire(random.Random(seed), self._link)  # SELF <-> each peer
        self.dropped_loss = 0  # gossip messages dropped by emulated loss
        self.dropped_partition = 0  # messages (either direction) dropped by a partition
        self.duplicated = 0  # gossip messages sent a second time by emulated duplication

    # ------------------------------------------------------------------------ partitions
    @property
    def partitioned(self) -> frozenset[str]:
        return self.wire.partitions[0].groups[0] if self.wire.partitions else frozenset()

    def set_partition(self, peers: Iterable[str]) -> None:
        """Cut this node off from ``peers`` (node ids or addresses; none: heal)."""
        cut = {p.strip() for p in peers if p.strip()}
        if cut:
            self.wire.partition(cut)  # one group, the rest (SELF among them) another
        else:
            self.wire.heal()

    def is_cut(self, *names: str | None) -> bool:
        """True if any of the names (node id, address) of a peer is partitioned away."""
        return any(n is not None and self.wire.separated(SELF, n) for n in names)

    def drop_incoming(self, *names: str | None) -> bool:
        if self.is_cut(*names):
            self.dropped_partition += 1
            return True
        return False

    def drop_outgoing(self, *names: str | None, gossip: bool) -> bool:
        if self.is_cut(*names):
            self.dropped_partition += 1
            return True
        if gossip and self.config.lost(self.wire.rng):
            self.dropped_loss += 1
            return True
        return False

    def duplicate_now(self) -> bool:
        """Whether to send this gossip message once more (emulated duplication)."""
        if self.config.duplicated(self.wire.rng):
            self.duplicated += 1
            return True
        return False

    # ------------------------------------------------------------------------ delay
    def _link(self, a: str, b: str) -> LinkConfig:
        """The wire's link ``a -> b`` (one of them is SELF): the peer's own delay that way if
        it has one, else the config's."""
        back = a != SELF
        own = self.peers.get(a if back else b)
        return self.config if own is None else self.config.with_delay(own[1] if back else own[0])

    def _ends(self, peer: str | None, back: bool) -> tuple[str, str]:
        there = SELF if peer is None else peer  # no peer named: the config's own link
        return (there, SELF) if back else (SELF, there)

    def one_way_delay(self, peer: str | None = None, back: bool = False) -> float:
        return self.wire.delay(*self._ends(peer, back))

    async def delay(self, peer: str | None = None) -> None:
        """Sleep one emulated one-way delay toward ``peer`` (no-op without emulation)."""
        if self._link(*self._ends(peer, False)).active:
            await sleep_until(self.clock() + self.one_way_delay(peer), self.clock)

    async def delayed(self, chunks: AsyncIterator[T], peer: str | None = None
                      ) -> AsyncIterator[T]:
        """Relay ``chunks`` as if each crossed the link from ``peer``: arrival + one-way
        delay, in order."""
        if not self._link(*self._ends(peer, True)).active:
            async for chunk in chunks:
                yield chunk
            return
        queue: asyncio.Queue[tuple[float, T | BaseException | None]] = asyncio.Queue()

        async def reader() -> None:
            # Timestamps arrivals independently of the consumer, so delays never accumulate.
            release = 0.0
            try:
                async for chunk in chunks:
                    release = max(release, self.clock() + self.one_way_delay(peer, True))
                    queue.put_nowait((release, chunk))
                queue.put_nowait((release, None))
            except Exception as exc:  # surfaced to the consumer, in order
                queue.put_nowait((release, exc))

        task = asyncio.create_task(reader())
        try:
            while True:
                release, item = await queue.get()
                await sleep_until(release, self.clock)
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:  # stop reading before the caller touches the source again
            task.cancel()  # gather, not suppress(CancelledError): a cancel of ours goes on
            await asyncio.gather(task, return_exceptions=True)


async def sleep_until(deadline: float, clock: Callable[[], float] = time.monotonic) -> None:
    """Sleep until ``clock()`` reaches ``deadline``, never less: uvloop's timers (what uvicorn
    runs on when it is installed) count whole milliseconds on a cached loop clock and can fire
    up to a millisecond early, which a plain ``asyncio.sleep`` would pass on as a shorter
    emulated link. Woken early, it sleeps again for at least a millisecond: a shorter timer
    rounds to 0 ms there and fires at once, again and again (measured on uvloop: one sleep in
    three spun 10-90 loop turns); so it ends at most ~1 ms late, as asyncio's own timers do
    (epoll waits whole milliseconds: 0.7 ms late on average here)."""
    wait = deadline - clock()
    if wait > 0:
        await asyncio.sleep(wait)
    while (wait := deadline - clock()) > 0:  # woken early
        await asyncio.sleep(max(wait, TIMER_RESOLUTION_S))
