"""``NodeService``: the asyncio interpreter of one ``NodeCore`` (clock, timers, sockets, engine).

Theory of operation
-------------------
The core decides, this module carries out. Everything that happens becomes an event handed
to ``NodeCore.serve(event, now)`` (``now`` = ``time.monotonic()``; ``serve`` is ``handle``
that answers a core bug with ``CoreFailed`` instead of raising, counted and logged here, and
never leaves a request without its next step), and every returned action is executed here::

    timer task ── Tick at next_deadline() ──┐
    POST /peer/gossip ── MessageReceived ───┤
    engine finished ── RequestServed,       ├─▶ NodeCore.serve ──▶ Send ─▶ PeerClient (netem)
       CacheChanged, LoadChanged ───────────┤                     Log, PeerStateChanged
    a request's life ── RequestArrived,     │                     Forward, ExecuteLocally,
       Forward*, RequestDone/Cancelled ─────┤                     Abort (runtime/execution)
    POST /peer/forward ── ForwardArrived ───┘                     AcceptForward, RefuseForward

A client request: tokens → block hashes → ``engine.match`` (exact, local) → ``RequestArrived``;
the core answers ``Forward(peer)`` or ``ExecuteLocally``, and every outcome of a forward
(busy, failed, accepted, done) goes back to the core, which says what to do next. Which peer
next, how many peers, the route label and where an answer continues after a peer died
mid-stream are the core's (``core/lifecycle.py``), shared with the simulator; so are
keeping a request whose sampling the forward protocol cannot carry here and sending a
prompt's later samples where its first went (``RequestArrived.plain``, ``sample_of``).

Why one file over 400 lines: it is the whole asyncio interpreter — timer, gossip I/O, the
carrying out of every request action and the peer side of forwards — kept together so that
every core event the runtime produces can be found in one place.

Hop limit 1: the receiver of ``/peer/forward`` always executes; it never routes.

Leaving (``leave``, on SIGTERM): ``LeaveRequested`` makes the core refuse new work and gossip
push-back at once; this shell then waits until nothing runs (client requests, work for
peers, engine calls, and whatever the caller counts, e.g. uvicorn's open requests) or the
grace has passed, aborts what is left and counts it. Joining by DNS: a task resolves
``--join-dns`` (``getaddrinfo`` on a thread) at start and every ``--join-dns-interval`` and
hands the addresses to the core as ``SeedsDiscovered``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from radixmesh.core.adapters import (
    Adapter,
    by_name,
    files_digest,
    given_digest,
    parse_adapter_spec,
)
from radixmesh.core.admission import token_cap
from radixmesh.core.blocks import Fingerprint, block_hashes, namespace_seed
from radixmesh.core.config import NodeConfig
from radixmesh.core.events import (
    Abort,
    AcceptForward,
    Action,
    CacheChanged,
    CoreFailed,
    EngineStateChanged,
    Event,
    ExecuteLocally,
    Forward,
    ForwardAccepted,
    ForwardArrived,
    ForwardFailed,
    ForwardRefused,
    LeaveRequested,
    LoadChanged,
    Log,
    MessageReceived,
    PeerStateChanged,
    QueueChanged,
    RefuseForward,
    RejectRequest,
    RequestAction,
    RequestArrived,
    RequestCancelled,
    RequestDone,
    RequestServed,
    SeedsDiscovered,
    Send,
    Tick,
)
from radixmesh.core.forward_codec import encode_forward_request, encode_reply
from radixmesh.core.load_estimates import QueuedBlocks
from radixmesh.core.messages import (
    ForwardAdmitted,
    ForwardBusy,
    ForwardError,
    ForwardHeartbeat,
    ForwardRequest,
    ForwardTokens,
    busy_reply,
)
from radixmesh.core.node import NodeCore
from radixmesh.core.profile import resolve as resolve_profile
from radixmesh.core.quotas import Bounds, TenantQuotas, admission_bounds
from radixmesh.core.shadow import Shadow
from radixmesh.core.tenants import Namespacer, parse_api_keys
from radixmesh.engine.base import (
    AsyncEngine,
    Engine,
    GenerateResult,
    SamplingParams,
    match_in,
)
from radixmesh.engine.worker import as_async_engine
from radixmesh.runtime import metrics as prom
from radixmesh.runtime.config import ServeConfig
from radixmesh.runtime.execution import (
    Execution,
    ForwardExecution,
    LocalExecution,
    RequestContext,
    forward_request,
    result_reply,
)
from radixmesh.runtime.netem import Netem, NetemConfig, parse_peer_delays
from radixmesh.runtime.peer_auth import (
    ENV_API_KEY,
    ENV_CLUSTER_KEY,
    ApiKeyCheck,
    PeerAuth,
    resolve_secret,
)
from radixmesh.runtime.peer_client import ForwardFailure, PeerClient
from radixmesh.runtime.peer_link import LinkRegistry
from radixmesh.runtime.transport import PeerTransport

log = logging.getLogger("radixmesh.node")


# request actions the caller that owns the request carries out (Abort is carried out here)
_OWNED = (Forward, ExecuteLocally, AcceptForward, RefuseForward, RejectRequest)


class Overloaded(Exception):
    """This node is full and no peer took the request (the core's ``RejectRequest``)."""

    def __init__(self, retry_after_s: float, quota: bool = False) -> None:
        super().__init__(f"overloaded: retry after {retry_after_s:.1f} s")
        self.retry_after_s = retry_after_s
        self.quota = quota  # the request's tenant was over its share here (core/quotas.py)

MAX_TIMER_SLEEP_S = 1.0  # the timer re-reads next_deadline() at least this often
STOP_WAIT_S = 2.0  # stop(): how long to wait for the timer task to finish
MIN_TICK_GAP_S = 0.001  # if a Tick leaves the deadline in the past, wait this long
DRAIN_POLL_S = 0.05  # leave(): how often to look whether the in-flight work is done


# ------------------------------------------------------------------------------ the service
class NodeService:
    """Owns NodeCore, the engine, the peer client, netem, timers and counters.

    ``engine``: an :class:`AsyncEngine` is used as is, a synchronous :class:`Engine` is put on
    a ``ThreadedEngine`` (its thread). ``self.engine`` is that AsyncEngine, closed by ``stop``.
    """

    def __init__(
        self,
        config: ServeConfig,
        engine: Engine | AsyncEngine,
        *,
        clock: Callable[[], float] = time.monotonic,
        incarnation: int | None = None,
        peers: PeerTransport | None = None,
    ) -> None:
        self.config = config
        self.engine: AsyncEngine = as_async_engine(engine)
        self.clock = clock
        self.incarnation = incarnation or config.incarnation or time.time_ns() // 1_000_000
        node_cfg = self._node_config(config, engine.fingerprint)
        self.node_config = node_cfg
        self.node_id = node_cfg.node_id
        self.address = node_cfg.address
        self.core = NodeCore(node_cfg, random.Random(config.seed ^ self.incarnation), clock())
        self._wire(config, peers)
        self.metrics = prom.RuntimeMetrics()
        self.started_monotonic = clock()
        self._init_work(config, engine.fingerprint.block_size)

    def _init_work(self, config: ServeConfig, block_size: int) -> None:
        """The service's own state: its tasks, the requests in flight and what they hold of
        the engine (admission's token counts, the shadow), and its counters."""
        self._wake: asyncio.Future[None] | None = None  # the timer's sleep; set = wake up
        self._tasks: set[asyncio.Task[Any]] = set()
        self._timer: asyncio.Task[None] | None = None
        self.pending = 0  # submitted to the engine, not finished (event-loop view)
        self._rids = itertools.count(1)  # the core's ids of client requests
        self._running: dict[int, Execution] = {}  # client requests, for the core's Abort
        self._peer_work: set[LocalExecution] = set()  # requests executed for peers
        self.drain_cancelled = 0  # leave(): requests still running at the deadline
        self._drain_cut: set[int] = set()  # id() of the client executions cut by leave()
        # bounded admission by tokens: prompt and max_tokens of the engine work started here
        # and not finished (client requests and work for peers), reported in LoadChanged;
        # and the prompt tokens not cached when each was queued (what one place in the queue
        # costs: core ``SpeedReport.queued_service_s``)
        self.queue_prompt_tokens = self.queue_output_tokens = self.queue_uncached_tokens = 0
        self._queued_blocks = QueuedBlocks(block_size)
        # an external engine with a --profile: the node's shadow of its scheduler
        # (core/shadow.py), fed the engine work started here, keyed by execution
        self.shadow = (Shadow(resolve_profile(config.profile), config.profile_time_scale)
                       if config.profile else None)
        self._shadowed: dict[int, int] = {}  # id(execution) -> shadow sequence number
        self._shadow_ids = itertools.count(1)
        self.dns_resolutions = self.dns_failures = 0  # --join-dns: answers / failed look-ups
        # started and stopped with the node, shown in /mesh and /metrics (the KV-event
        # subscriber of an external engine): start(), stop(), name, mesh_state(), metrics()
        self.attachments: list[Any] = []

    def _node_config(self, config: ServeConfig, fingerprint: Fingerprint) -> NodeConfig:
        """The core's configuration, with the adapters this node serves (``--adapters``)."""
        self.adapters = load_adapters(config.adapters)  # (tenants) served name -> Adapter
        return replace(config.node_config(fingerprint, self.incarnation),
                       adapters=tuple(self.adapters.values()))

    def _wire(self, config: ServeConfig, peers: PeerTransport | None) -> None:
        """The network side: emulation, peer authentication, client key, peer client."""
        self.netem = Netem(
            NetemConfig(config.net_delay, config.net_jitter, config.net_loss,
                        config.net_duplicate),
            seed=config.seed ^ self.incarnation ^ 0x5EED,
            peers=parse_peer_delays(config.net_peer_delays),
            clock=self.clock,  # its delays on the node's one clock
        )
        self.auth = PeerAuth(resolve_secret(config.cluster_key, var=ENV_CLUSTER_KEY),
                             self.node_id)
        self.api_key = ApiKeyCheck(resolve_secret(config.api_key, var=ENV_API_KEY),
                                   load_api_keys(config.api_keys))
        self.namespacer = Namespacer(self.auth.key.secret if self.auth.key else None)
        self.quotas = TenantQuotas(config.tenant_queue_share)  # (core/quotas.py)
        self.peers: PeerTransport = peers or PeerClient(
            self.node_id, self.address, self.netem, config.connect_timeout,
            config.forward_timeout, self.auth, use_links=config.peer_transport == "link")
        self.links = LinkRegistry()  # the links peers opened to this node (their forwards)

    # ------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self.auth.warn_if_open()
        self.push_cache_and_load()
        self.dispatch(Tick())
        self._timer = asyncio.create_task(self._timer_loop(), name="radixmesh-timer")
        target = self.config.join_dns_target
        if target is not None:
            self._spawn(self._join_dns_loop(*target))
        for attached in self.attachments:
            await attached.start()

    # ------------------------------------------------------------------- leave and join
    async def leave(self, grace_s: float | None = None,
                    busy: Callable[[], int] = lambda: 0, linger_s: float = 0.0) -> int:
        """Stop taking work, tell the peers, finish what runs within ``grace_s`` (default
        ``--drain-grace``); ``busy``: the caller's own count of open requests; ``linger_s``
        (at most the grace): return no sooner than this, even when nothing runs, so that
        clients and load balancers that only see ``/health`` (503 now) stop sending here
        before the caller closes the port (what arrives meanwhile goes to peers). Returns how
        many requests were still running at the deadline (aborted)."""
        grace = self.config.drain_grace if grace_s is None else grace_s
        start = self.clock()
        deadline, linger_until = start + grace, start + min(linger_s, grace)
        before = set(self._tasks)
        self.dispatch(LeaveRequested(grace))
        announced = self._tasks - before  # the gossip round that advertises the push-back
        log.warning("leaving: draining %d requests for up to %.1f s", self._work(), grace)
        while self.clock() < deadline and (self._work() or busy()
                                           or self.clock() < linger_until):
            await asyncio.sleep(DRAIN_POLL_S)
        if announced:
            await asyncio.wait(announced, timeout=self.config.connect_timeout + 1.0)
        left: list[Execution] = [*self._running.values(), *self._peer_work]
        self._drain_cut.update(id(ex) for ex in self._running.values())
        for ex in left:
            ex.abort()
        self.drain_cancelled += len(left)
        log.warning("drained: %d requests cancelled at the deadline", len(left))
        return len(left)

    def cut_by_drain(self, ex: Execution) -> bool:
        """Whether ``ex`` failed because :meth:`leave` aborted it at the drain deadline (the
        client then gets 503 with a retry-after, not a 500: retrying elsewhere succeeds)."""
        return id(ex) in self._drain_cut

    def _work(self) -> int:
        """Requests in flight here (a lower bound: engine calls not yet tracked count too)."""
        return max(len(self._running) + len(self._peer_work), self.pending)

    async def _join_dns_loop(self, name: str, port: int) -> None:
        while True:
            await self.resolve_join_dns(name, port)
            await asyncio.sleep(self.config.join_dns_interval)

    async def resolve_join_dns(self, name: str, port: int) -> tuple[str, ...]:
        """Resolve ``name`` (A and AAAA, on a thread: the loop never blocks) and hand the
        addresses other than our own to the core as seeds. A failure is counted and logged."""
        try:
            infos = await asyncio.to_thread(socket.getaddrinfo, name, port, 0,
                                            socket.SOCK_STREAM)
        except OSError as exc:  # socket.gaierror included
            self.dns_failures += 1
            log.warning("--join-dns %s: %s", name, exc)
            return ()
        self.dns_resolutions += 1
        own = {self.address, f"{self.config.host}:{self.config.port}"}
        found = [addr for addr in socket_addresses(infos) if addr not in own]
        if found:
            self.dispatch(SeedsDiscovered(tuple(found)))
        return tuple(found)

    async def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            await asyncio.wait({self._timer}, timeout=STOP_WAIT_S)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for attached in self.attachments:
            await attached.stop()
        await self.peers.aclose()
        await self.engine.aclose()

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
    def dispatch(self, event: Event) -> list[RequestAction]:
        """Hand one event to the core and carry out its actions; returns those about one
        request (``Forward``, ``ExecuteLocally``, ``AcceptForward``, ``RefuseForward``) for the
        caller that owns that request. Never raises (``NodeCore.serve`` answers a core bug
        with ``CoreFailed``, and a request's next step with it)."""
        actions = self.core.serve(event, self.clock())
        mine: list[RequestAction] = []
        for action in actions:
            if isinstance(action, _OWNED):
                mine.append(action)
            else:
                self._act(action)
        _wake_up(self._wake)
        return mine

    def _act(self, action: Action) -> None:
        if isinstance(action, Send):
            self._spawn(self._send(action))
        elif isinstance(action, Log):
            level = logging.getLevelName(action.level.upper())
            log.log(level if isinstance(level, int) else logging.INFO, "%s", action.message)
        elif isinstance(action, CoreFailed):
            self.metrics.core_errors += 1
            log.error("NodeCore.handle failed on %s:\n%s", action.event, action.error)
        elif isinstance(action, PeerStateChanged):
            self.metrics.peer_state_changes[action.new] += 1
            log.info("peer %s: %s -> %s", action.peer_id, action.old, action.new)
        elif isinstance(action, Abort):
            running = self._running.get(action.rid)
            if running is not None:
                running.abort()

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
        """Requests running or waiting on the engine: ``running + waiting``, and never less
        than this node's own unfinished ``generate`` calls (``pending``: it counts a call the
        moment it is made, before the engine has seen it)."""
        return max(self.pending, self.engine.running + self.engine.waiting)

    @property
    def inflight(self) -> int:
        """Requests the engine executes now (a batching engine: many)."""
        return self.engine.running

    def push_load(self) -> None:
        usage = self.engine.usage()
        batch = None if self.shadow is None else self.shadow.state(self.clock())
        self.dispatch(LoadChanged(self.queue_depth, self.inflight, usage.tokens, usage.budget,
                                  self.queue_prompt_tokens, self.queue_output_tokens,
                                  self.queue_uncached_tokens, batch))

    def first_token(self, ex: LocalExecution) -> None:
        """``ex``'s engine call sent its first token: the shadow catches up if behind."""
        seq = self._shadowed.get(id(ex))
        if self.shadow is not None and seq is not None:
            self.shadow.first_token(seq, self.clock())
        self.push_load()

    def _shadow_add(self, ex: LocalExecution, prompt: int, output: int, uncached: int) -> None:
        """The engine work ``ex`` started goes into the shadow (until it ends)."""
        if self.shadow is None:
            return
        seq = next(self._shadow_ids)
        self._shadowed[id(ex)] = seq
        self.shadow.add(seq, ex.ctx.prompt, max(output, 1), self.clock(),
                        min(prompt - uncached, len(ex.ctx.prompt) - 1))

    def _shadow_done(self, ex: LocalExecution) -> None:
        seq = self._shadowed.pop(id(ex), None)
        if self.shadow is not None and seq is not None:
            self.shadow.finished(seq, self.clock())

    def _queued(self, ex: LocalExecution, emitted: int = 0) -> LocalExecution:
        """Count ``ex``'s tokens (prompt + max_tokens, as the engine gets them) as queued
        until its engine call ends, however it ends; the core sees them at once."""
        task = ex._task
        if task is None or task.done():
            return ex
        prompt = len(ex.ctx.prompt) + emitted
        output = max(ex.ctx.sampling.max_tokens - emitted, 0)
        hashes = ex.ctx.hashes
        uncached = self._queued_blocks.uncached(hashes, prompt, ex.cached_estimate)
        self._queued_blocks.add(hashes)
        self.dispatch(QueueChanged(hashes, True))
        self.queue_prompt_tokens += prompt
        self.queue_output_tokens += output
        self.queue_uncached_tokens += uncached
        self._shadow_add(ex, prompt, output, uncached)
        ticket = self.quotas.admit(ex.ctx.tenant, prompt + output)

        def finished(_: object) -> None:  # (after the execution's own callback: its cache
            self._shadow_done(ex)  # change reaches the core first)
            self.quotas.release(ticket)
            self._queued_blocks.remove(hashes)
            self.dispatch(QueueChanged(hashes, False))
            self.queue_prompt_tokens -= prompt
            self.queue_output_tokens -= output
            self.queue_uncached_tokens -= uncached
            self.push_load()

        task.add_done_callback(finished)
        self.push_load()
        return ex

    def quota_key(self, tenant: str | None) -> str | None:
        """The quota key of ``tenant`` (core/quotas.py): a keyed hash, as forwards carry it;
        None without a tenant or with quotas off."""
        if tenant is None or self.quotas.share is None:
            return None
        return self.namespacer.keyed(b"quota", tenant)

    def over_quota(self, key: str | None, tokens: int, requests: int = 1) -> bool:
        """Whether ``requests`` requests of ``tokens`` in all (one API request's samples and
        prompts) would take tenant ``key`` over its share of this node's admission bounds
        (core/quotas.py; the core counts it where the quota decides). ValueError when they
        exceed the tenant's request cap: they can never run here at once."""
        if key is None or self.quotas.share is None:
            return False
        adm = self.node_config.admission
        # a 400 only against the configured count (the wait bound moves with speed: a 429)
        cap = self.quotas.never_fits(key, requests, Bounds(adm.max_queue_requests, None))
        if cap is not None:
            raise ValueError(f"this request's {requests} samples and prompts exceed your "
                             f"tenant's share of this node's queue ({cap} at once): send "
                             "fewer ('n' x prompts) per request")
        streams = self.core.streams(self.clock())
        bounds = admission_bounds(adm.max_queue_requests, adm.max_queue_wait_s,
                                  self.core.own_speed().mean_service_s,
                                  token_cap(adm, self.core.token_rate(), streams), streams)
        return self.quotas.over(key, tokens, bounds, requests)

    def _cached_here(self, prompt: Sequence[int], hashes: Sequence[int],
                     namespace: str | None = None) -> int:
        """Tokens of ``prompt`` this node will have cached when it runs it (in ``namespace``)."""
        here = match_in(self.engine, prompt, namespace)
        return self._queued_blocks.cached_when_run(hashes, len(prompt), here)

    def adapter_of(self, digest: str | None) -> Adapter | None:
        """This node's adapter of that content digest (None: none, or no digest)."""
        return next((a for a in self.adapters.values() if a.digest == digest), None)

    def hashes_of(self, prompt: Sequence[int], namespace: str | None) -> tuple[int, ...]:
        """The mesh's block hashes of ``prompt`` in cache ``namespace`` (core/blocks.py)."""
        fp = self.engine.fingerprint
        seed = namespace_seed(fp.digest, namespace, fp.block_size)
        return tuple(block_hashes(prompt, fp.block_size, seed))

    def push_cache(self) -> None:
        delta = self.engine.drain_cache_delta()
        if delta.added or delta.removed:
            self.dispatch(CacheChanged(delta.added, delta.removed))

    def push_cache_and_load(self) -> None:
        self.push_cache()
        self.push_load()

    def local_done(self, result: GenerateResult, service_s: float) -> None:
        m = self.metrics
        m.prompt_tokens += result.prompt_tokens
        m.cached_tokens += result.cached_tokens
        m.completion_tokens += len(result.output_ids)
        m.observe_engine(result.queue_s, result.prefill_s, result.prompt_tokens,
                         result.cached_tokens)
        self.dispatch(RequestServed(result.prompt_tokens, result.cached_tokens, result.prefill_s,
                                    len(result.output_ids), result.decode_s, service_s))
        self.push_cache()  # the load follows once the request has left the queue (_queued)

    # ------------------------------------------------------------------- engine health
    def engine_state(self, up: bool, reason: str, forget: bool = False) -> None:
        """The engine went down or came back (``runtime/engine_health.py``): the core is told
        (no new work here while down); ``forget``: its cache went with it, drop the index
        (gossip withdraws it)."""
        drop = getattr(self.engine, "forget_cache", None)
        if forget and drop is not None:
            drop()
            self.push_cache_and_load()
        self.dispatch(EngineStateChanged(up, reason))

    def engine_failed(self, reason: str) -> bool:
        """A request found the engine unreachable: down at once when a health monitor will
        bring it back (True), else nothing changes (False: the request may not be retried)."""
        health = next((a for a in self.attachments if a.name == "engine_health"), None)
        if health is None:
            return False
        # down, not gone: a dropped or reset connection under load is no proof the cache went
        # (a 16-in-flight vLLM run lost its index that way); the next probe tells (≤ 1 s)
        health.mark(False, reason, gone=False)
        return True

    async def retry_elsewhere(self, ctx: RequestContext) -> Execution:
        """A client request whose engine call failed before its first token, this node's
        engine now down: routed again (to a peer; ``Overloaded`` when none takes it)."""
        self.metrics.engine_retries += 1
        return await self.execute(ctx.prompt, ctx.sampling, ctx.stream)

    # ------------------------------------------------------------------------- requests
    async def execute(
        self,
        prompt: Sequence[int],
        sampling: SamplingParams,
        stream: bool,
        *,
        local_only: bool = False,
        target: str | None = None,
        sample_of: str | None = None,
        namespace: str | None = None,
        session: int | None = None,
        adapter: Adapter | None = None,
        tenant: str | None = None,
        over_quota: bool = False,
    ) -> Execution:
        """Start one client request where the core says (``local_only``: hop-limited;
        ``sample_of``: the node serving the first sample of the prompt this one samples;
        ``namespace``: its cache namespace, core/tenants.py; ``session``: its session id,
        core/sessions.py; ``tenant``: its tenant's quota key, :meth:`quota_key`;
        ``over_quota``: that tenant is over its share here, :meth:`over_quota`, checked once
        for all the samples and prompts of an API request)."""
        ctx = RequestContext(next(self._rids), tuple(prompt), self.hashes_of(prompt, namespace),
                             sampling, stream, namespace, session, adapter, tenant)
        local_cached = self._cached_here(ctx.prompt, ctx.hashes, namespace)
        event = RequestArrived(ctx.rid or 0, ctx.hashes, len(ctx.prompt), local_cached,
                               sampling.max_tokens, local_only, target, sampling.plain,
                               sample_of, session, None if adapter is None else adapter.key,
                               over_quota)
        ex = await self._start(ctx, self._one(self.dispatch(event), ctx))
        self.metrics.requests[ex.route] += 1
        return ex

    async def _start(self, ctx: RequestContext, action: Forward | ExecuteLocally) -> Execution:
        while isinstance(action, Forward):
            started = await self._offer(ctx, action)
            if isinstance(started, Execution):
                return started
            action = started
        return self.start_local(ctx, action)

    def _one(self, actions: list[RequestAction], ctx: RequestContext) -> Forward | ExecuteLocally:
        """The core's next step for ``ctx`` (``NodeCore.serve`` always gives one: run it
        here when nothing else is decided, never a lost request)."""
        for action in actions:
            if isinstance(action, Forward | ExecuteLocally):
                return action
            if isinstance(action, RejectRequest):
                self.metrics.rejected += 1
                raise Overloaded(action.retry_after_s, action.quota)
        raise RuntimeError(f"request {ctx.rid}: the core gave no next step")

    async def _offer(self, ctx: RequestContext, action: Forward
                     ) -> ForwardExecution | Forward | ExecuteLocally:
        """Send the forward; the peer's first reply decides between streaming and next try."""
        self.metrics.forward_attempts += 1
        started = self.clock()
        body = forward_request(ctx, action.beat_s, self.node_config.forward.heartbeat_s)
        try:
            stream = await self.peers.open_forward(action.address, action.peer_id,
                                                   encode_forward_request(body))
        except ForwardFailure as exc:
            self.metrics.observe_forward(exc.reason, time.perf_counter() - started)
            return self.forward_failed(ctx, action.peer_id, exc.reason, 0)
        try:
            first = await stream.next_reply()
        except ForwardFailure as exc:
            self.metrics.observe_forward(exc.reason, time.perf_counter() - started)
            await stream.aclose()
            return self.forward_failed(ctx, action.peer_id, exc.reason, 0)
        except asyncio.CancelledError:  # the client went away: the peer stops too
            stream.close_now()
            raise
        outcome = ("accepted" if isinstance(first, ForwardAdmitted)
                   else "busy" if isinstance(first, ForwardBusy) else "bad_response")
        self.metrics.observe_forward(outcome, time.perf_counter() - started)
        if isinstance(first, ForwardAdmitted):
            self.dispatch(ForwardAccepted(ctx.rid or 0, action.peer_id, first.cached_tokens))
            return ForwardExecution(self, ctx, action, stream, first, started)
        await stream.aclose()
        if isinstance(first, ForwardBusy):
            return self._refused(ctx, action.peer_id, first.retry_after_s, first.queue_s)
        return self.forward_failed(ctx, action.peer_id, "bad_response", 0)

    def _refused(self, ctx: RequestContext, peer_id: str, retry_after_s: float,
                 queue_s: float | None) -> Forward | ExecuteLocally:
        self.metrics.forward_failures["busy"] += 1
        log.debug("forward to %s refused: busy (retry after %.2fs, queue %s)", peer_id,
                  retry_after_s, "?" if queue_s is None else f"{queue_s:.2f}s")
        refused = ForwardRefused(ctx.rid or 0, peer_id, retry_after_s, queue_s)
        return self._one(self.dispatch(refused), ctx)

    def forward_failed(self, ctx: RequestContext, peer_id: str, reason: str,
                       tokens_so_far: int) -> Forward | ExecuteLocally:
        self.metrics.forward_failures[reason] += 1
        log.warning("forward to %s failed: %s", peer_id, reason)
        event = ForwardFailed(ctx.rid or 0, peer_id, reason, tokens_so_far)
        return self._one(self.dispatch(event), ctx)

    def start_local(self, ctx: RequestContext, action: Forward | ExecuteLocally,
                    emitted: tuple[int, ...] = ()) -> LocalExecution:
        """Carry out ``ExecuteLocally`` (after a mid-stream death: continue after ``emitted``)."""
        if isinstance(action, Forward):  # the core never forwards after acceptance
            raise RuntimeError(f"request {ctx.rid}: a peer try after acceptance")
        ex = LocalExecution(self, ctx, action.route, action.expected_cached, emitted,
                            action.placement)
        return self._queued(ex, len(emitted))

    @contextlib.asynccontextmanager
    async def tracked(self, ex: Execution) -> AsyncIterator[None]:
        """While ``ex`` runs: reachable by the core's ``Abort``; its end reported to the core
        (done, failed, or cancelled when the consumer stops early: the client went away —
        unless a stop string ended it, ``ex.stop``: done, and the work is aborted)."""
        rid = ex.ctx.rid
        if rid is not None:
            self._running[rid] = ex
        try:
            yield
        except (GeneratorExit, asyncio.CancelledError):
            self._ended(rid, ex, cancelled=True)
            raise
        except BaseException as exc:
            self._ended(rid, ex, error=f"{type(exc).__name__}: {exc}")
            raise
        else:
            self._ended(rid, ex)

    def _ended(self, rid: int | None, ex: Execution, cancelled: bool = False,
               error: str | None = None) -> None:
        if ex.stopped:  # a stop string matched and the consumer closed it: a normal end
            cancelled, error = False, None
            ex.abort()  # what still runs stops: the engine task, or the peer's stream
        if rid is None:  # served for a peer: not the core's flight
            if cancelled:
                ex.abort()
            return
        ctx = ex.ctx
        if cancelled:  # the core answers with Abort, which reaches ``ex`` through _running
            self.metrics.observe_request(ex.route, "cancelled",
                                         time.perf_counter() - ctx.arrived_s)
            self.dispatch(RequestCancelled(rid))
        elif error is not None or ex.outcome is not None:
            self.metrics.observe_request(ex.route, "done" if error is None else "error",
                                         time.perf_counter() - ctx.arrived_s)
            out = ex.outcome
            overhead = None if out is None else out.forward_overhead_s
            waited = None if out is None or overhead is None else out.queue_s  # forwarded only
            self.dispatch(RequestDone(rid, overhead, error, forward_queue_s=waited,
                                      forward_ttft_s=None if out is None else out.forward_ttft_s))
            if overhead is not None:
                self.metrics.forward_overhead_s_sum += overhead
                self.metrics.forward_overhead_count += 1
        if self._running.get(rid) is ex:
            del self._running[rid]

    # ------------------------------------------------------------------------- peer side
    async def serve_forward(self, req: ForwardRequest) -> AsyncGenerator[bytes, None]:
        """The framed replies to a forwarded request, executed here (never routed again) — or
        a single ``ForwardBusy`` when the core refuses it (queue at the push-back threshold,
        or slower than ``beat_s``): the sender then falls back at once."""
        t0 = self.clock()
        hashes = self.hashes_of(req.prompt, req.namespace)
        here = match_in(self.engine, req.prompt, req.namespace)
        # the core prices it with what will be cached when it runs; the reply says what the
        # index holds now (x-radixmesh-cached-tokens: one meaning on every route)
        cached = self._queued_blocks.cached_when_run(hashes, len(req.prompt), here)
        event = ForwardArrived(0, len(req.prompt), cached, req.max_tokens, req.beat_s,
                               req.session,
                               self.over_quota(req.tenant, len(req.prompt) + req.max_tokens))
        answer = self.dispatch(event)
        if answer and isinstance(answer[0], RefuseForward):
            self.metrics.refused_for_peers += 1
            no = answer[0]
            yield encode_reply(busy_reply(self.node_id, no.retry_after_s, no.queue_s))
            return
        self.metrics.served_for_peers += 1
        # First byte before the engine starts: once it computes, this thread waits for the GIL.
        yield encode_reply(ForwardAdmitted(self.node_id, here))
        sampling = SamplingParams(req.max_tokens, req.temperature, req.top_p, req.seed,
                                  req.stop_token_ids)
        ctx = RequestContext(None, req.prompt, hashes, sampling, req.stream, req.namespace,
                             req.session, self.adapter_of(req.adapter), req.tenant)
        ex = self._queued(LocalExecution(self, ctx, "local", cached))
        self._peer_work.add(ex)
        try:
            async for frame in _replies(ex, req.heartbeat_s, self.clock, t0):
                yield frame
        finally:
            self._peer_work.discard(ex)
            ex.abort()  # no-op once finished; frees the engine if the sender went away

    # ------------------------------------------------------------------------- views
    def peer_states(self) -> dict[str, str]:
        return peer_states_of(self.core.mesh_state(self.clock()))

    def health(self) -> dict[str, object]:
        states = self.peer_states()
        return {
            "status": "leaving" if self.core.leaving else "ok",
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
            "admission": self.admission_state(),
        }
        describe = getattr(self.engine, "describe", None)
        if callable(describe):
            state["engine"] = describe()
        for attached in self.attachments:
            state[attached.name] = attached.mesh_state()
        return state

    def decisions(self, limit: int = 100, placement: str | None = None,
                  request: int | None = None) -> dict[str, object]:
        """The routing decisions kept (``core/decisions.py``), oldest first, for
        ``GET /mesh/decisions``: the last ``limit``, of one placement tag or request; and
        (without those filters) the last ``limit`` verdicts on peers' forwards."""
        log = self.core.decisions
        kept = log.recent(limit, placement, request)
        # a query for some of the routing decisions leaves the verdicts on forwards out
        admissions = [] if placement or request is not None else log.recent_admissions(limit)
        return {"node_id": self.node_id, "capacity": log.capacity, "recorded": log.recorded,
                "admissions_recorded": log.admissions_recorded,
                "decisions": [d.to_json() for d in kept],
                "admissions": [a.to_json() for a in admissions]}

    def admission_state(self) -> dict[str, object]:
        """Bounded admission's bounds in force and what the queue holds (``/mesh``)."""
        adm = self.node_config.admission
        speed = self.core.own_speed()
        rate = self.core.token_rate()
        streams = self.core.streams(self.clock())
        return {
            "tokens_per_s": round(rate, 1),  # per request stream, measured
            "prefill_s_per_token": speed.prefill_s_per_token,  # the measured speeds it uses
            "decode_s_per_token": speed.decode_s_per_token,
            "mean_service_s": speed.mean_service_s,
            "max_queue_requests": adm.max_queue_requests,
            "max_queue_wait_s": adm.max_queue_wait_s,
            "max_queue_tokens": token_cap(adm, rate, streams),
            "streams": round(streams, 2),  # requests the engine serves at once, measured
            "max_queue_tokens_derived": adm.max_queue_tokens == 0,
            "queue_prompt_tokens": self.queue_prompt_tokens,
            "queue_output_tokens": self.queue_output_tokens,
            "queue_uncached_tokens": self.queue_uncached_tokens,
        }

    def prometheus(self) -> str:
        usage = self.engine.usage()
        gauges = {
            "queue_depth": float(self.queue_depth),
            "queue_tokens": float(self.queue_prompt_tokens + self.queue_output_tokens),
            "inflight": float(self.inflight),
            "cache_tokens": float(usage.tokens),
            "cache_budget_tokens": float(usage.budget),
            "cache_locked_tokens": float(usage.locked_tokens),
            "netem_dropped_loss": float(self.netem.dropped_loss),
            "netem_dropped_partition": float(self.netem.dropped_partition),
            "netem_duplicated": float(self.netem.duplicated),
            "peer_connections_opened": float(getattr(self.peers, "connections_opened", 0)),
            "peer_links_opened": float(getattr(self.peers, "links_opened", 0)),
            "peer_links_served": float(self.links.opened),
            "peer_links_rejected": float(self.links.rejected),
            "peer_links_open": float(len(self.links)),
            "api_key_rejected": float(self.api_key.rejected),
            "drain_cancelled": float(self.drain_cancelled),
            "join_dns_resolutions": float(self.dns_resolutions),
            "join_dns_failures": float(self.dns_failures),
            **self.auth.metrics(),
            "incarnation": float(self.incarnation),
        }
        for attached in self.attachments:
            gauges.update(attached.metrics())
        core = {k: float(v) for k, v in self.core.metrics().items()}
        return prom.render(self.metrics, gauges, core, self.peer_states(), self.node_id)


def _wake_up(fut: asyncio.Future[None] | None) -> None:
    if fut is not None and not fut.done():
        fut.set_result(None)


async def _replies(ex: LocalExecution, heartbeat_s: float, clock: Callable[[], float],
                   t0: float) -> AsyncIterator[bytes]:
    """Frames of a local execution for the peer that forwarded it, received at ``t0`` on
    ``clock``: heartbeats while it waits, tokens as they come (batched), then the result
    (its handling time and its first token's, since the receipt) or an error."""
    pending: asyncio.Task[tuple[str, Any]] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(ex.queue.get())
            done, _ = await asyncio.wait({pending}, timeout=heartbeat_s)
            if not done:
                yield encode_reply(ForwardHeartbeat())
                continue
            items = [pending.result()]
            pending = None
            while not ex.queue.empty():
                items.append(ex.queue.get_nowait())
            first = None if ex.first_at is None else ex.first_at - t0
            for frame in _frames(items, clock() - t0, first):
                yield frame
            if items[-1][0] != "tok":
                return
    finally:
        if pending is not None:
            pending.cancel()


def _frames(items: list[tuple[str, Any]], handler_s: float,
            first_token_s: float | None) -> list[bytes]:
    frames: list[bytes] = []
    toks: list[int] = []
    for kind, value in items:
        if kind == "tok":
            toks.append(value)
            continue
        if toks:
            frames.append(encode_reply(ForwardTokens(tuple(toks))))
            toks = []
        if kind == "done":
            frames.append(encode_reply(result_reply(value, handler_s, first_token_s)))
        else:
            text = f"{type(value).__name__}: {value}"
            frames.append(encode_reply(ForwardError.truncated(text)))
    if toks:
        frames.append(encode_reply(ForwardTokens(tuple(toks))))
    return frames


def load_adapters(spec: str) -> dict[str, Adapter]:
    """``--adapters``: each name with its digest, given or computed from its directory's
    files (core/adapters.py); ValueError naming the adapter otherwise."""
    out = []
    for name, value in parse_adapter_spec(spec):
        digest = given_digest(value)
        if digest is None:
            root = Path(value)
            if not root.is_dir():
                raise ValueError(f"--adapters {name}: {value} is neither a digest nor a folder")
            files = [(str(p.relative_to(root)), p.read_bytes())
                     for p in root.rglob("*") if p.is_file()]
            digest = files_digest(files)
        out.append(Adapter(name, digest))
    return dict(by_name(out))


def load_api_keys(path: str) -> dict[str, str]:
    """The tenants' keys of ``--api-keys FILE`` (none without one); ValueError naming the
    file and line."""
    if not path.strip():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"--api-keys {path}: {exc.strerror or exc}") from None
    return parse_api_keys(text, path)


def socket_addresses(infos: Sequence[tuple[Any, ...]]) -> list[str]:
    """``host:port`` peer addresses (``[v6]:port``) from ``getaddrinfo`` answers, deduplicated."""
    out: dict[str, None] = {}
    for family, *_, sockaddr in infos:
        host, port = sockaddr[0], sockaddr[1]
        out[f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"] = None
    return list(out)


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
