"""``NodeService``: the asyncio interpreter of one ``NodeCore`` (clock, timers, sockets, engine).

Theory of operation
-------------------
The core decides, this module carries out. Everything that happens becomes an event handed
to ``NodeCore.handle(event, now)`` (``now`` = ``time.monotonic()``), and every returned action
is executed here::

    timer task ── Tick at next_deadline() ──┐
    POST /peer/gossip ── MessageReceived ───┤
    engine finished ── RequestServed,       ├─▶ NodeCore.handle ─▶ Send ─▶ PeerClient (netem)
       CacheChanged, LoadChanged ───────────┤                     Log, PeerStateChanged
    forward outcome ── ForwardSucceeded /   │
       ForwardFailed ───────────────────────┘

A client request: tokens → block hashes → ``engine.match`` (exact, local) → ``NodeCore.route``
→ ranked candidates. Self → :class:`LocalExecution` on the :class:`EngineWorker`; a peer →
:class:`ForwardExecution`. A failed forward (connect error, no first byte in time, silence,
disconnect) reports ``ForwardFailed`` and the next candidate is tried (at most
``MAX_PEER_ATTEMPTS`` peers), then local execution: route ``fallback``. A forward that dies
*after* it streamed some tokens continues locally from the prompt plus those tokens, so the
client still receives one complete answer (identical for greedy decoding).

Hop limit 1: the receiver of ``/peer/forward`` always executes; it never routes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from radixmesh.core.blocks import block_hashes
from radixmesh.core.events import (
    Action,
    CacheChanged,
    Event,
    ForwardFailed,
    ForwardRefused,
    ForwardSucceeded,
    LoadChanged,
    Log,
    MessageReceived,
    PeerStateChanged,
    RequestServed,
    Send,
    Tick,
)
from radixmesh.core.node import NodeCore
from radixmesh.core.router import MAX_PEER_ATTEMPTS, Candidate
from radixmesh.engine.base import Engine, GenerateRequest, GenerateResult, SamplingParams
from radixmesh.engine.worker import EngineWorker
from radixmesh.runtime import metrics as prom
from radixmesh.runtime.config import ServeConfig
from radixmesh.runtime.netem import Netem, NetemConfig
from radixmesh.runtime.peer_auth import (
    ENV_API_KEY,
    ENV_CLUSTER_KEY,
    ApiKeyCheck,
    PeerAuth,
    resolve_secret,
)
from radixmesh.runtime.peer_client import ForwardError, ForwardStream, PeerClient

log = logging.getLogger("radixmesh.node")

MAX_TIMER_SLEEP_S = 1.0  # the timer re-reads next_deadline() at least this often
STOP_WAIT_S = 2.0  # stop(): how long to wait for the timer task to finish
MIN_TICK_GAP_S = 0.001  # if a Tick leaves the deadline in the past, wait this long


@dataclass(slots=True)
class Outcome:
    """How a request ended, whoever executed it."""

    output_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int  # what the serving engine actually reused
    served_by: str
    route: str  # local | forwarded | fallback
    queue_s: float  # on the serving node
    service_s: float  # on the serving node, queue excluded
    forward_overhead_s: float | None = None  # forwarded: client time minus remote handling


# ------------------------------------------------------------------------------ executions
class Execution:
    """A started request. Headers are known now; tokens and the :class:`Outcome` come later."""

    served_by: str
    route: str
    expected_cached: int  # the router's estimate for the node that serves it
    cached_estimate: int  # the serving node's exact match when it accepted the request
    outcome: Outcome | None = None

    def tokens(self) -> AsyncIterator[int]:
        """Generated token ids as they arrive (empty unless started with ``stream=True``)."""
        raise NotImplementedError

    async def result(self) -> Outcome:
        async for _ in self.tokens():
            pass
        assert self.outcome is not None
        return self.outcome


class RequestCancelled(Exception):
    """Raised on the engine thread to stop a request whose client went away."""


class LocalExecution(Execution):
    """Runs on this node's engine worker; its events land on an asyncio queue."""

    def __init__(self, node: NodeService, prompt: Sequence[int], sampling: SamplingParams,
                 stream: bool, route: str, expected: int) -> None:
        self.node = node
        self.served_by = node.node_id
        self.route = route
        self.expected_cached = expected
        self.cached_estimate = node.engine.match(prompt)
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._prompt = tuple(prompt)
        self._cancelled = False
        self._over = False
        self._generated = 0  # tokens produced so far (engine thread writes, loop reads after)
        loop = asyncio.get_running_loop()

        def on_token(tok: int) -> None:  # on the engine thread
            if self._cancelled:
                raise RequestCancelled("the client went away")
            self._generated += 1
            if stream:
                loop.call_soon_threadsafe(self.queue.put_nowait, ("tok", tok))

        req = GenerateRequest(uuid.uuid4().hex, self._prompt, sampling)
        self._t0 = time.perf_counter()
        self._job = node.worker.submit(req, on_token)
        node._pending += 1
        asyncio.wrap_future(self._job).add_done_callback(self._finished)
        node.push_load()

    def cancel(self) -> None:
        """Stop the engine work: skipped if still queued, stopped at its next token if running."""
        if not self._over:
            self._cancelled = True
            self._job.cancel()

    def _finished(self, future: asyncio.Future[GenerateResult]) -> None:
        self.node._pending -= 1
        self._over = True
        if future.cancelled():  # cancelled while still queued: never ran
            self.node.metrics.cancelled += 1
            self.queue.put_nowait(("err", RequestCancelled("cancelled before it started")))
            self.node.push_load()
            return
        exc = future.exception()
        if exc is not None:
            self.node.metrics.completion_tokens += self._generated
            if isinstance(exc, RequestCancelled):
                self.node.metrics.cancelled += 1
            self.queue.put_nowait(("err", exc))
            self.node.push_cache_and_load()
            return
        result = future.result()
        service_s = max(time.perf_counter() - self._t0 - result.queue_s, 0.0)
        self.node.local_done(result, service_s)
        self.queue.put_nowait(("done", (result, service_s)))

    async def tokens(self) -> AsyncIterator[int]:
        try:
            while True:
                kind, value = await self.queue.get()
                if kind == "tok":
                    yield value
                elif kind == "done":
                    result, service_s = value
                    self.outcome = Outcome(
                        list(result.output_ids), result.finish_reason, result.prompt_tokens,
                        result.cached_tokens, self.served_by, self.route, result.queue_s,
                        service_s,
                    )
                    return
                else:
                    raise value
        finally:
            self.cancel()  # a consumer that stops early (client gone) frees the engine


class ForwardExecution(Execution):
    """Runs on a peer through ``/peer/forward``; falls back to local execution on failure."""

    def __init__(self, node: NodeService, cand: Candidate, stream_obj: ForwardStream,
                 accepted: dict[str, Any], started: float, ctx: RequestContext) -> None:
        self.node = node
        self.peer_id = cand.node_id
        self.served_by = cand.node_id
        self.route = "forwarded"
        self.expected_cached = cand.expected_cached_tokens
        self.cached_estimate = _int_field(accepted, "cached", 0)
        self._stream = stream_obj
        self._started = started
        self._ctx = ctx
        self._vocab = node.engine.tokenizer.vocab_size

    async def tokens(self) -> AsyncIterator[int]:
        emitted: list[int] = []
        try:
            async for tok in self._relay(emitted):
                yield tok
            return
        except ForwardError as exc:
            self.node.forward_failed(self.peer_id, exc.reason)
        finally:
            await self._stream.aclose()
        async for tok in self._continue_locally(emitted):
            yield tok

    async def _relay(self, emitted: list[int]) -> AsyncIterator[int]:
        while True:
            event = await self._stream.next_event()
            kind = event["t"]
            if kind == "tok":
                for tok in _token_list(event.get("ids"), self._vocab):
                    emitted.append(tok)
                    yield tok
            elif kind == "done":
                self.outcome = self._finish(event, emitted)
                self._stream.completed = True
                return
            elif kind == "error":
                raise ForwardError("remote_error", str(event.get("message", ""))[:200])

    def _finish(self, event: dict[str, Any], emitted: list[int]) -> Outcome:
        elapsed = time.perf_counter() - self._started
        res = event.get("result")
        if not isinstance(res, dict):
            raise ForwardError("bad_response", "done without a result")
        output = _token_list(res.get("output_ids"), self._vocab)
        if emitted and output[: len(emitted)] != emitted:
            raise ForwardError("bad_response", "result disagrees with streamed tokens")
        handler_s = _float_field(event, "handler_s", 0.0)
        overhead = max(elapsed - handler_s, 0.0)
        self.node.forward_succeeded(self.peer_id, self._ctx.hashes, overhead)
        finish = res.get("finish_reason")
        return Outcome(
            output, finish if finish in ("stop", "length") else "length",
            len(self._ctx.prompt), min(_int_field(res, "cached_tokens", 0), len(self._ctx.prompt)),
            self.peer_id, self.route, _float_field(res, "queue_s", 0.0),
            _float_field(event, "service_s", 0.0), overhead,
        )

    async def _continue_locally(self, emitted: list[int]) -> AsyncIterator[int]:
        """The peer failed after accepting: finish the answer here, after what was sent."""
        ctx = self._ctx
        remaining = ctx.sampling.max_tokens - len(emitted)
        self.route, self.served_by = "fallback", self.node.node_id
        if remaining <= 0:
            self.outcome = Outcome(emitted, "length", len(ctx.prompt), 0, self.node.node_id,
                                   "fallback", 0.0, 0.0)
            return
        sampling = replace(ctx.sampling, max_tokens=remaining)
        local = LocalExecution(self.node, (*ctx.prompt, *emitted), sampling, ctx.stream,
                               "fallback", self.node.engine.match(ctx.prompt))
        async for tok in local.tokens():
            yield tok
        assert local.outcome is not None
        out = local.outcome
        self.outcome = replace(out, output_ids=emitted + out.output_ids,
                               prompt_tokens=len(ctx.prompt),
                               cached_tokens=min(out.cached_tokens, len(ctx.prompt)))


def _token_list(value: object, vocab: int) -> list[int]:
    """Token ids from a peer, checked: a broken peer must not break our detokenizer."""
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in value
    ):
        raise ForwardError("bad_response", f"token ids must be a list of ints in [0, {vocab})")
    return value


def _int_field(d: dict[str, Any], key: str, default: int) -> int:
    v = d.get(key, default)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else default


def _float_field(d: dict[str, Any], key: str, default: float) -> float:
    v = d.get(key, default)
    ok = isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < 1e9
    return float(v) if ok else default


@dataclass(frozen=True, slots=True)
class RequestContext:
    prompt: tuple[int, ...]
    hashes: tuple[int, ...]
    sampling: SamplingParams
    stream: bool


# ------------------------------------------------------------------------------ the service
class NodeService:
    """Owns NodeCore, the engine worker, the peer client, netem, timers and counters."""

    def __init__(
        self,
        config: ServeConfig,
        engine: Engine,
        *,
        clock: Callable[[], float] = time.monotonic,
        incarnation: int | None = None,
    ) -> None:
        self.config = config
        self.engine = engine
        self.clock = clock
        self.incarnation = incarnation or config.incarnation or time.time_ns() // 1_000_000
        node_cfg = config.node_config(engine.fingerprint, self.incarnation)
        self.node_config = node_cfg
        self.node_id = node_cfg.node_id
        self.address = node_cfg.address
        self.core = NodeCore(node_cfg, random.Random(config.seed ^ self.incarnation), clock())
        self.worker = EngineWorker(engine)
        self.netem = Netem(
            NetemConfig(config.net_delay, config.net_jitter, config.net_loss,
                        config.net_duplicate),
            seed=config.seed ^ self.incarnation ^ 0x5EED,
        )
        self.auth = PeerAuth(resolve_secret(config.cluster_key, var=ENV_CLUSTER_KEY),
                             self.node_id)
        self.api_key = ApiKeyCheck(resolve_secret(config.api_key, var=ENV_API_KEY))
        self.peers = PeerClient(self.node_id, self.address, self.netem,
                                config.connect_timeout, config.forward_timeout, self.auth)
        self.metrics = prom.RuntimeMetrics()
        self.started_monotonic = clock()
        self._wake: asyncio.Future[None] | None = None  # the timer's sleep; set = wake up
        self._tasks: set[asyncio.Task[Any]] = set()
        self._timer: asyncio.Task[None] | None = None
        self._pending = 0  # submitted to the engine, not finished (event-loop view)

    # ------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self.auth.warn_if_open()
        self.push_cache_and_load()
        self.dispatch(Tick())
        self._timer = asyncio.create_task(self._timer_loop(), name="radixmesh-timer")

    async def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            await asyncio.wait({self._timer}, timeout=STOP_WAIT_S)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.peers.aclose()
        await asyncio.to_thread(self.worker.close, 5.0)

    async def _timer_loop(self) -> None:
        while True:
            try:
                await self._timer_step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug; the timer must outlive it or gossip stops for good
                self.metrics.core_errors += 1
                log.exception("timer step failed")
                await asyncio.sleep(MAX_TIMER_SLEEP_S)

    async def _timer_step(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            delay = self.core.next_deadline() - self.clock()
            if delay <= 0:
                self.dispatch(Tick())
                stuck = self.core.next_deadline() <= self.clock()  # never spin on a bad deadline
                await asyncio.sleep(MIN_TICK_GAP_S if stuck else 0)
                continue
            # Sleep until the deadline or until dispatch() wakes us (the deadline may have
            # moved). A bare future, not wait_for(Event.wait()): on Python 3.11 wait_for can
            # swallow a cancellation that races with the event, and then stop() never returns.
            self._wake = loop.create_future()
            timer = loop.call_later(min(delay, MAX_TIMER_SLEEP_S), _wake_up, self._wake)
            try:
                await self._wake
            finally:
                timer.cancel()

    # ------------------------------------------------------------------------- core I/O
    def dispatch(self, event: Event) -> None:
        """Hand one event to the core and carry out its actions. Never raises."""
        try:
            actions = self.core.handle(event, self.clock())
        except Exception:
            self.metrics.core_errors += 1
            log.exception("NodeCore.handle failed on %s", type(event).__name__)
            return
        for action in actions:
            self._act(action)
        _wake_up(self._wake)

    def _act(self, action: Action) -> None:
        if isinstance(action, Send):
            self._spawn(self._send(action))
        elif isinstance(action, Log):
            level = logging.getLevelName(action.level.upper())
            log.log(level if isinstance(level, int) else logging.INFO, "%s", action.message)
        elif isinstance(action, PeerStateChanged):
            self.metrics.peer_state_changes[action.new] += 1
            log.info("peer %s: %s -> %s", action.peer_id, action.old, action.new)

    async def _send(self, action: Send) -> None:
        ok = await self.peers.send_gossip(action.address, action.payload, action.peer_id)
        if ok:
            self.metrics.gossip_out_messages += 1
            self.metrics.gossip_out_bytes += len(action.payload)
        else:
            self.metrics.gossip_send_failures += 1

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def receive_gossip(self, data: bytes, from_id: str | None, from_address: str | None) -> bool:
        """A peer pushed gossip. False if the emulated network dropped it."""
        if self.netem.drop_incoming(from_id, from_address):
            return False
        self.metrics.gossip_in_messages += 1
        self.metrics.gossip_in_bytes += len(data)
        self.dispatch(MessageReceived(data, from_address))
        return True

    @property
    def queue_depth(self) -> int:
        """Requests submitted to the engine and not yet finished, as the event loop sees it.

        (The worker's own counter lags: its future resolves before it decrements.)
        """
        return self._pending

    def push_load(self) -> None:
        usage = self.engine.usage()
        depth = self._pending
        self.dispatch(LoadChanged(depth, min(depth, 1), usage.tokens, usage.budget))

    def push_cache_and_load(self) -> None:
        delta = self.engine.drain_cache_delta()
        if delta.added or delta.removed:
            self.dispatch(CacheChanged(delta.added, delta.removed))
        self.push_load()

    def local_done(self, result: GenerateResult, service_s: float) -> None:
        m = self.metrics
        m.prompt_tokens += result.prompt_tokens
        m.cached_tokens += result.cached_tokens
        m.completion_tokens += len(result.output_ids)
        self.dispatch(RequestServed(result.prompt_tokens, result.cached_tokens, result.prefill_s,
                                    len(result.output_ids), result.decode_s, service_s))
        self.push_cache_and_load()

    def forward_failed(self, peer_id: str, reason: str) -> None:
        self.metrics.forward_failures[reason] += 1
        log.warning("forward to %s failed: %s", peer_id, reason)
        self.dispatch(ForwardFailed(peer_id, reason))

    def forward_refused(self, peer_id: str, retry_after_s: float) -> None:
        self.metrics.forward_failures["busy"] += 1
        log.debug("forward to %s refused: busy (retry after %.2fs)", peer_id, retry_after_s)
        self.dispatch(ForwardRefused(peer_id, retry_after_s))

    def forward_succeeded(self, peer_id: str, hashes: tuple[int, ...], overhead: float) -> None:
        self.metrics.forward_overhead_s_sum += overhead
        self.metrics.forward_overhead_count += 1
        self.dispatch(ForwardSucceeded(peer_id, hashes, overhead))

    # ------------------------------------------------------------------------- requests
    async def execute(
        self,
        prompt: Sequence[int],
        sampling: SamplingParams,
        stream: bool,
        *,
        local_only: bool = False,
        target: str | None = None,
    ) -> Execution:
        """Route and start one client request (``local_only``: a hop-limited request)."""
        fp = self.engine.fingerprint
        ctx = RequestContext(tuple(prompt), tuple(block_hashes(prompt, fp.block_size, fp.digest)),
                             sampling, stream)
        local_cached = self.engine.match(ctx.prompt)
        candidates = self._candidates(ctx, local_cached, local_only, target)
        failed = False
        for tried, cand in enumerate(candidates):
            if cand.is_self or tried >= MAX_PEER_ATTEMPTS:
                break
            ex = await self._try_forward(cand, ctx)
            if ex is not None:
                ex.route = "fallback" if failed else "forwarded"
                self.metrics.requests[ex.route] += 1
                return ex
            failed = True
        route = "fallback" if failed else "local"
        expected = next((c.expected_cached_tokens for c in candidates if c.is_self), local_cached)
        self.metrics.requests[route] += 1
        return LocalExecution(self, ctx.prompt, sampling, stream, route, expected)

    def _candidates(self, ctx: RequestContext, local_cached: int, local_only: bool,
                    target: str | None) -> list[Candidate]:
        me = Candidate(self.node_id, True, local_cached, 0.0)
        if local_only:
            return [me]
        if target is not None and target != self.node_id:
            return [Candidate(target, False, 0, 0.0), me]
        return self.core.route(ctx.hashes, len(ctx.prompt), local_cached,
                               ctx.sampling.max_tokens, self.clock())

    async def _try_forward(self, cand: Candidate, ctx: RequestContext) -> ForwardExecution | None:
        address = self.core.peer_address(cand.node_id)
        if address is None:  # e.g. an x-radixmesh-target naming no known peer
            self.metrics.forward_failures["unknown_peer"] += 1
            return None
        self.metrics.forward_attempts += 1
        started = time.perf_counter()
        stream: ForwardStream | None = None
        try:
            body = self._forward_body(ctx, cand.beat_s)
            stream = await self.peers.open_forward(address, cand.node_id, body)
            accepted = await stream.next_event()
            if accepted.get("t") == "busy":
                await stream.aclose()
                retry = accepted.get("retry_after_s")
                ok = isinstance(retry, int | float) and not isinstance(retry, bool)
                self.forward_refused(cand.node_id, float(retry) if ok else 1.0)  # core bounds it
                return None
            if accepted.get("t") != "accepted":
                raise ForwardError("bad_response", "first event is not 'accepted'")
        except ForwardError as exc:
            if stream is not None:
                await stream.aclose()
            self.forward_failed(cand.node_id, exc.reason)
            return None
        return ForwardExecution(self, cand, stream, accepted, started, ctx)

    def _forward_body(self, ctx: RequestContext, beat_s: float | None) -> dict[str, object]:
        sp = ctx.sampling
        body: dict[str, object] = {
            "prompt_ids": list(ctx.prompt),
            "sampling": {"max_tokens": sp.max_tokens, "temperature": sp.temperature,
                         "top_p": sp.top_p, "seed": sp.seed,
                         "stop_token_ids": list(sp.stop_token_ids)},
            "stream": ctx.stream,
            "heartbeat_s": max(self.config.forward_timeout / 4, 0.01),
        }
        if beat_s is not None:  # cost routing: what the peer must beat for the forward to pay
            body["beat_s"] = round(beat_s, 6)
        return body

    # ------------------------------------------------------------------------- peer side
    async def serve_forward(self, prompt: tuple[int, ...], sampling: SamplingParams,
                            stream: bool, heartbeat_s: float, beat_s: float | None = None
                            ) -> AsyncIterator[bytes]:
        """NDJSON events of a forwarded request, executed here (never routed again) — or a
        single "busy" event when the core refuses it (queue at the push-back threshold, or
        slower than ``beat_s``): the sender then falls back at once."""
        t0 = time.perf_counter()
        cached = self.engine.match(prompt)
        retry = self.core.admits_forward(self.clock(), len(prompt), cached, sampling.max_tokens,
                                         beat_s)
        if retry is not None:
            self.metrics.refused_for_peers += 1
            yield _line({"t": "busy", "node": self.node_id, "retry_after_s": round(retry, 3)})
            return
        self.metrics.served_for_peers += 1
        # First byte before the engine starts: once it computes, this thread waits for the GIL.
        yield _line({"t": "accepted", "node": self.node_id, "cached": cached})
        ex = LocalExecution(self, prompt, sampling, stream, "local", 0)
        pending: asyncio.Task[tuple[str, Any]] | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(ex.queue.get())
                done, _ = await asyncio.wait({pending}, timeout=heartbeat_s)
                if not done:
                    yield b'{"t":"hb"}\n'
                    continue
                items = [pending.result()]
                pending = None
                while not ex.queue.empty():
                    items.append(ex.queue.get_nowait())
                for line in _event_lines(items, t0):
                    yield line
                if items[-1][0] != "tok":
                    return
        finally:
            if pending is not None:
                pending.cancel()
            ex.cancel()  # no-op once finished; frees the engine if the sender went away

    # ------------------------------------------------------------------------- views
    def peer_states(self) -> dict[str, str]:
        return peer_states_of(self.core.mesh_state(self.clock()))

    def health(self) -> dict[str, object]:
        states = self.peer_states()
        return {
            "status": "ok",
            "node_id": self.node_id,
            "address": self.address,
            "incarnation": self.incarnation,
            "model": self.engine.model_name,
            "uptime_s": round(self.clock() - self.started_monotonic, 3),
            "peers": states,
            "queue_depth": self.queue_depth,
        }

    def mesh(self) -> dict[str, object]:
        state = dict(self.core.mesh_state(self.clock()))
        state["runtime"] = {
            "node_id": self.node_id,
            "incarnation": self.incarnation,
            "partitioned_from": sorted(self.netem.partitioned),
            "net_delay_s": self.netem.config.delay_s,
            "net_jitter_s": self.netem.config.jitter_s,
            "net_loss": self.netem.config.loss,
            "queue_depth": self.queue_depth,
        }
        return state

    def prometheus(self) -> str:
        usage = self.engine.usage()
        gauges = {
            "queue_depth": float(self.queue_depth),
            "inflight": float(min(self.queue_depth, 1)),
            "cache_tokens": float(usage.tokens),
            "cache_budget_tokens": float(usage.budget),
            "cache_locked_tokens": float(usage.locked_tokens),
            "netem_dropped_loss": float(self.netem.dropped_loss),
            "netem_dropped_partition": float(self.netem.dropped_partition),
            "netem_duplicated": float(self.netem.duplicated),
            "api_key_rejected": float(self.api_key.rejected),
            **self.auth.metrics(),
            "incarnation": float(self.incarnation),
        }
        core = {k: float(v) for k, v in self.core.metrics().items()}
        return prom.render(self.metrics, gauges, core, self.peer_states(), self.node_id)


def _wake_up(fut: asyncio.Future[None] | None) -> None:
    if fut is not None and not fut.done():
        fut.set_result(None)


def _line(obj: dict[str, object]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def _event_lines(items: list[tuple[str, Any]], t0: float) -> list[bytes]:
    lines: list[bytes] = []
    toks: list[int] = []
    for kind, value in items:
        if kind == "tok":
            toks.append(value)
            continue
        if toks:
            lines.append(_line({"t": "tok", "ids": toks}))
            toks = []
        if kind == "done":
            result, service_s = value
            lines.append(_line({
                "t": "done",
                "result": {"output_ids": list(result.output_ids),
                           "finish_reason": result.finish_reason,
                           "prompt_tokens": result.prompt_tokens,
                           "cached_tokens": result.cached_tokens,
                           "queue_s": result.queue_s},
                "service_s": service_s,
                "handler_s": time.perf_counter() - t0,
            }))
        else:
            lines.append(_line({"t": "error", "message": f"{type(value).__name__}: {value}"}))
    if toks:
        lines.append(_line({"t": "tok", "ids": toks}))
    return lines


def peer_states_of(mesh: dict[str, object]) -> dict[str, str]:
    """``{peer_id: "alive"|"suspect"|"dead"}`` from a ``NodeCore.mesh_state`` document."""
    peers = mesh.get("peers")
    out: dict[str, str] = {}
    if isinstance(peers, dict):
        items = [dict(v, node_id=v.get("node_id", k)) for k, v in peers.items()
                 if isinstance(v, dict)]
    elif isinstance(peers, list):
        items = [p for p in peers if isinstance(p, dict)]
    else:
        items = []
    for p in items:
        pid, state = p.get("node_id") or p.get("peer_id") or p.get("id"), p.get("state")
        if isinstance(pid, str) and isinstance(state, str):
            out[pid] = state
    return out
