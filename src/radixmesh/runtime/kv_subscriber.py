"""``KvSubscriber``: the asyncio task that keeps an external engine's ``EngineIndex`` exact from
the engine's KV-cache events (vLLM / SGLang ZMQ publisher).

Theory of operation
-------------------
One SUB socket per publisher (one per data-parallel rank, port base + rank), read by one task
each; the core decides, this module carries out::

    SUB recv [topic, seq, payload] ── core.kv_events.decode_live_frames / decode_batch
        ──▶ SequenceTracker.on_live(seq, batch | None) ──▶ steps, in order:
              Apply(batch)      → EngineIndex.apply   (a batch that failed to decode: counted
                                                       malformed, index dropped)
              Drop              → counted
              RequestReplay(n)  → DEALER to the replay ROUTER: [b"", n] → batches, end marker
                                  (timeout → on_replay_failed) → more steps
              Reset             → EngineIndex.drop()
        ──▶ on_change()  (NodeService.push_cache_and_load: the engine's drain_cache_delta is
                          the index's delta → CacheChanged → gossip)

Which side binds follows the engine's rule: the publisher binds when its endpoint has ``*``,
``::``, ``ipc://`` or ``inproc://`` — give ``--kv-events`` exactly the endpoint string of the
engine's ``--kv-events-config``: then this node connects (``*`` / ``::`` replaced by the engine
URL's host), otherwise the engine connects and this node binds. ``connect:`` / ``bind:`` in
front of an endpoint force a side. A live message that repeats, byte for byte, one of the last
``RECENT_MESSAGES`` batches seen live or replayed is dropped as a duplicate (each remembered as
its seq and a 16-byte BLAKE2b digest of its payload, not the payload), the tracker would
read it as a restart: a repeat, a copy delayed past later batches, or the live copy of a batch
the replay already delivered (a replay answers up to the newest batch, so the live copy of a
batch published while the gap was being filled arrives after it). A restarted engine's batch
never equals its predecessor's under the same seq (the batch carries its timestamp). ZMQ
reconnects by itself with exponential backoff (100 ms .. 5 s); a socket error closes the socket
and opens a new one after a backoff. The connection state comes from the socket monitor
(``connected``, and ``stale_since``: since when no publisher connection has been up). Nothing
here blocks the loop, and nothing an engine sends can raise out of it: bad input is counted.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from radixmesh.core.codec import RemoteProtocolError
from radixmesh.core.engine_index import EngineIndex
from radixmesh.core.kv_events import (
    KvBatch,
    KvLimits,
    decode_batch,
)
from radixmesh.core.kv_order import (
    Apply,
    Drop,
    OrderStep,
    ReplayEnd,
    RequestReplay,
    Reset,
    SequenceTracker,
    decode_live_frames,
    decode_replay_frames,
    encode_replay_request,
)

log = logging.getLogger("radixmesh.kv_events")

REPLAY_TIMEOUT_S = 2.0
RECONNECT_MIN_MS = 100
RECONNECT_MAX_MS = 5000
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 5.0
RECENT_MESSAGES = 1024  # batches remembered per publisher to recognise a late duplicate
COUNTERS = ("messages", "applied", "malformed", "duplicates", "gaps", "replays",
            "replay_failures", "resets", "socket_errors")
_UP = zmq.EVENT_HANDSHAKE_SUCCEEDED
_DOWN = zmq.EVENT_DISCONNECTED

Item = KvBatch | None  # None: the batch failed to decode


@dataclass(frozen=True, slots=True)
class Endpoint:
    address: str
    bind: bool  # True: this node binds (the engine's publisher connects)


def _publisher_binds(text: str) -> bool:
    return "*" in text or "::" in text or text.startswith(("ipc://", "inproc://"))


def resolve_endpoint(text: str, engine_host: str) -> Endpoint:
    """The socket side and address for one ``--kv-events`` endpoint (rule above)."""
    text = text.strip()
    for prefix, bind in (("connect:", False), ("bind:", True)):
        if text.startswith(prefix):
            return Endpoint(text[len(prefix):], bind)
    if not _publisher_binds(text):
        return Endpoint(text, bind=True)
    host = f"[{engine_host}]" if ":" in engine_host else engine_host
    for wildcard in ("[::]", "*"):
        text = text.replace(wildcard, host)
    return Endpoint(text, bind=False)


def with_port_offset(address: str, offset: int) -> str:
    """``tcp://h:5557`` + 2 → ``tcp://h:5559`` (the replay socket of DP rank 2)."""
    head, _, port = address.rpartition(":")
    return f"{head}:{int(port) + offset}" if offset else address


def plan_endpoints(events: str, replay: str, engine_url: str
                   ) -> tuple[list[Endpoint], list[str | None]]:
    """Publishers and their replay sockets from the flags; one replay endpoint given for many
    publishers means rank i replays on its port + i."""
    host = urlsplit(engine_url).hostname or "127.0.0.1"
    pubs = [resolve_endpoint(e, host) for e in events.split(",") if e.strip()]
    replays = [r for r in replay.split(",") if r.strip()]
    if len(replays) == 1 and len(pubs) > 1:
        replays = [with_port_offset(replays[0].strip(), i) for i in range(len(pubs))]
    resolved: list[str | None] = []
    for i in range(len(pubs)):
        resolved.append(resolve_endpoint(replays[i], host).address if i < len(replays) else None)
    return pubs, resolved


@dataclass(slots=True)
class _Publisher:
    """One publisher's socket state and seq order."""

    endpoint: Endpoint
    replay: str | None
    tracker: SequenceTracker[Item] = field(default_factory=SequenceTracker)
    links: int = 0  # connections up (socket monitor)
    stale_since: float | None = field(default_factory=time.time)
    last_message: float | None = None  # monotonic
    # seq -> digest of the last RECENT_MESSAGES batches seen live or replayed (duplicates)
    recent: collections.OrderedDict[int, bytes] = field(default_factory=collections.OrderedDict)

    def seen(self, seq: int, payload: bytes) -> bool:
        """Was this exact batch seen already? Records it if not."""
        digest = hashlib.blake2b(payload, digest_size=16).digest()
        if self.recent.get(seq) == digest:
            return True
        self.recent[seq] = digest
        self.recent.move_to_end(seq)
        while len(self.recent) > RECENT_MESSAGES:
            self.recent.popitem(last=False)
        return False

    def link(self, up: bool) -> None:
        self.links = max(self.links + (1 if up else -1), 0)
        if self.links and self.stale_since is not None:
            self.stale_since = None
        elif not self.links and self.stale_since is None:
            self.stale_since = time.time()


class KvSubscriber:
    """Feeds ``index`` from the engine's publishers; ``start`` / ``stop`` with the node."""

    name = "kv_events"

    def __init__(self, index: EngineIndex, endpoints: Sequence[Endpoint],
                 replays: Sequence[str | None] = (), *,
                 on_change: Callable[[], None] | None = None,
                 replay_timeout_s: float = REPLAY_TIMEOUT_S,
                 limits: KvLimits | None = None) -> None:
        if not endpoints:
            raise ValueError("at least one KV-event endpoint is needed")
        self.index = index
        self.on_change = on_change
        self.replay_timeout_s = replay_timeout_s
        self.limits = limits
        self.publishers = [_Publisher(e, replays[i] if i < len(replays) else None)
                           for i, e in enumerate(endpoints)]
        self.counts: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._tasks = [asyncio.create_task(self._run(p), name=f"radixmesh-kv-{i}")
                       for i, p in enumerate(self.publishers)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    @property
    def connected(self) -> bool:
        return all(p.links > 0 for p in self.publishers)

    # ------------------------------------------------------------------------- views
    def mesh_state(self) -> dict[str, object]:
        now = time.monotonic()
        return {
            "connected": self.connected,
            "stale_since": _stale_since(self.publishers),
            "publishers": [{
                "endpoint": p.endpoint.address, "bind": p.endpoint.bind,
                "replay": p.replay, "connected": p.links > 0, "next_seq": p.tracker.next_seq,
                "last_message_age_s": None if p.last_message is None
                else round(now - p.last_message, 3),
            } for p in self.publishers],
            "counters": dict(self.counts),
            "index": {"blocks": len(self.index), "config_error": self.index.config_error,
                      **self.index.counters()},
        }

    def metrics(self) -> dict[str, float]:
        out = {f"kv_events_{k}": float(v) for k, v in self.counts.items()}
        out["kv_events_connected"] = float(self.connected)
        out["kv_index_blocks"] = float(len(self.index))
        return out

    # ------------------------------------------------------------------------- sockets
    async def _run(self, pub: _Publisher) -> None:
        backoff = BACKOFF_MIN_S
        while True:
            try:
                await self._consume(pub)
            except asyncio.CancelledError:
                raise
            except Exception:  # a socket error or a bug: never let the task die
                self.counts["socket_errors"] += 1
                log.exception("KV-event subscriber for %s failed; retrying",
                              pub.endpoint.address)
                pub.links = 0
                pub.link(False)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _consume(self, pub: _Publisher) -> None:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MIN_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = asyncio.create_task(self._monitor(pub, sock.get_monitor_socket(_UP | _DOWN)))
        try:
            (sock.bind if pub.endpoint.bind else sock.connect)(pub.endpoint.address)
            while True:
                await self.on_live(pub, await sock.recv_multipart())
        finally:
            monitor.cancel()
            await asyncio.gather(monitor, return_exceptions=True)
            sock.disable_monitor()
            sock.close(0)

    async def _monitor(self, pub: _Publisher, mon: Any) -> None:
        try:
            while True:
                event = parse_monitor_message(await mon.recv_multipart())
                pub.link(event["event"] == _UP)
        finally:
            mon.close(0)

    # ------------------------------------------------------------------------- events
    async def on_live(self, pub: _Publisher, frames: Sequence[Any]) -> None:
        """One message of the PUB stream (frames as received)."""
        self.counts["messages"] += 1
        pub.last_message = time.monotonic()
        try:
            msg = decode_live_frames(frames)
        except RemoteProtocolError:
            self._malformed()
            self._changed()
            return
        if pub.seen(msg.seq, msg.payload):
            self.counts["duplicates"] += 1
            return
        await self._carry_out(pub, pub.tracker.on_live(msg.seq, self._decode(msg.payload)))
        self._changed()

    def _decode(self, payload: bytes) -> Item:
        try:
            return decode_batch(payload, self.limits)
        except RemoteProtocolError:
            return None

    async def _carry_out(self, pub: _Publisher, steps: list[OrderStep[Item]]) -> None:
        work: collections.deque[OrderStep[Item]] = collections.deque(steps)
        while work:
            step = work.popleft()
            if isinstance(step, RequestReplay):
                self.counts["gaps"] += 1
                work.extendleft(reversed(await self._replay(pub, step.start_seq)))
            else:
                self._do(pub, step)

    def _do(self, pub: _Publisher, step: OrderStep[Item]) -> None:
        """Carry out one step other than a replay request."""
        if isinstance(step, Apply):
            self._apply(step.item)
        elif isinstance(step, Drop):
            self.counts["duplicates"] += 1
        elif isinstance(step, Reset):
            self.counts["resets"] += 1
            log.info("KV events of %s: %s, index dropped", pub.endpoint.address, step.reason)
            self.index.drop()

    def _apply(self, item: Item) -> None:
        if item is None:
            self._malformed()
            return
        self.index.apply(item)
        self.counts["applied"] += 1

    def _malformed(self) -> None:
        """A batch was lost: the index may now over-report, so drop it (it refills)."""
        self.counts["malformed"] += 1
        self.index.drop()

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # the node's problem; never the subscriber's death
                log.exception("on_change failed")

    # ------------------------------------------------------------------------- replay
    async def _replay(self, pub: _Publisher, start_seq: int) -> list[OrderStep[Item]]:
        """Batches from ``start_seq`` on, as tracker steps; a failure gives up on the gap."""
        self.counts["replays"] += 1
        if pub.replay is None or self._ctx is None:
            self.counts["replay_failures"] += 1
            return pub.tracker.on_replay_failed()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(pub.replay)
            await sock.send_multipart(encode_replay_request(start_seq))
            return await self._read_replay(pub, sock)
        except (TimeoutError, RemoteProtocolError, zmq.ZMQError) as exc:
            self.counts["replay_failures"] += 1
            log.warning("replay from %s failed: %r", pub.replay, exc)
            return pub.tracker.on_replay_failed()
        finally:
            sock.close(0)

    async def _read_replay(self, pub: _Publisher, sock: Any) -> list[OrderStep[Item]]:
        """Carry out replayed batches as they come (while replaying, the tracker asks for
        nothing but apply / drop / reset); returns the steps of the end marker."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.replay_timeout_s
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError("replay timed out")
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that
            # lands as the message arrives, and ``stop`` would then wait forever
            async with asyncio.timeout(remaining):
                frames = await sock.recv_multipart()
            msg = decode_replay_frames(frames)
            if isinstance(msg, ReplayEnd):
                return pub.tracker.on_replay_end()
            pub.seen(msg.seq, msg.payload)
            for step in pub.tracker.on_replay(msg.seq, self._decode(msg.payload)):
                self._do(pub, step)


def _stale_since(publishers: Sequence[_Publisher]) -> str | None:
    times = [p.stale_since for p in publishers if p.stale_since is not None]
    if not times:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(min(times)))
