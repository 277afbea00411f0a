"""Carrying out the core's request actions: run on the local engine, or stream from a peer.

Theory of operation
-------------------
The core's lifecycle (``core/lifecycle.py``) decides; the classes here only move tokens::

    ExecuteLocally(resume_after=k) ─▶ LocalExecution: a task awaiting engine.generate
                                      (AsyncEngine), tokens via an asyncio queue; prompt +
                                      the k tokens a dead peer sent
    Forward(peer)  ─▶ offer(): POST /peer/forward, first reply ForwardBusy | ForwardAdmitted
                      ─▶ ForwardExecution: relays ForwardTokens, ends on ForwardResult; a
                         failure is reported (ForwardFailed with the tokens so far) and the
                         core's answer (ExecuteLocally) continues the same answer here

Every end is reported to the core: ``RequestDone`` (a forward's overhead and time), or
``ExecutionAborted`` when the consumer stops early (the client went away), whose ``Abort``
then cancels the engine task or closes the peer stream. A stop string is the consumer's
(it detokenizes): on a match it calls :meth:`Execution.stop` with the tokens so far and closes
:meth:`Execution.tokens`; that end is ``RequestDone`` (finish "stop"), and the same abort
stops the engine or the peer's stream (``NodeService._ended``). Requests served *for* a peer
(``rid=None``) are not the core's flights and report nothing but the engine's own events.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, aclosing
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from radixmesh.core.adapters import Adapter
from radixmesh.core.events import ExecuteLocally, Forward
from radixmesh.core.messages import (
    ForwardAdmitted,
    ForwardError,
    ForwardHeartbeat,
    ForwardReply,
    ForwardRequest,
    ForwardResult,
    ForwardTokens,
)
from radixmesh.engine.base import (
    AsyncEngine,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    TokenLogprob,
    match_in,
)
from radixmesh.engine.http_engine import EngineUnavailable
from radixmesh.runtime.metrics import RuntimeMetrics
from radixmesh.runtime.transport import ForwardFailure, ForwardReplies


@dataclass(frozen=True, slots=True)
class RequestContext:
    rid: int | None  # the core's id of a client request; None: served for a peer
    prompt: tuple[int, ...]
    hashes: tuple[int, ...]
    sampling: SamplingParams
    stream: bool
    namespace: str | None = None  # the cache namespace (core/tenants.py); None: shared
    session: int | None = None  # the session id (core/sessions.py)
    adapter: Adapter | None = None  # its LoRA adapter (core/adapters.py)
    tenant: str | None = None  # its tenant's quota key (core/quotas.py); None: no quota
    arrived_s: float = field(default_factory=time.perf_counter, compare=False)  # perf_counter


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
    # with ``sampling.logprobs`` / ``prompt_logprobs`` (local executions: engine/base.py)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()
    forward_ttft_s: float | None = None  # forwarded: the offer to its first token, by its timings


class Host(Protocol):
    """What an execution needs from its node (``runtime.node.NodeService``)."""

    node_id: str
    engine: AsyncEngine
    metrics: RuntimeMetrics
    pending: int  # generate calls started by this node, not finished (event-loop view)
    clock: Callable[[], float]  # the node's clock: every duration reported to the core

    def push_load(self) -> None: ...
    def first_token(self, ex: LocalExecution) -> None: ...
    def push_cache_and_load(self) -> None: ...
    def local_done(self, result: GenerateResult, service_s: float) -> None: ...
    def tracked(self, ex: Execution) -> AbstractAsyncContextManager[None]: ...
    def forward_failed(self, ctx: RequestContext, peer_id: str, reason: str,
                       tokens_so_far: int) -> Forward | ExecuteLocally: ...
    def start_local(self, ctx: RequestContext, action: Forward | ExecuteLocally,
                    emitted: tuple[int, ...] = ()) -> LocalExecution: ...
    def engine_failed(self, reason: str) -> bool: ...
    async def retry_elsewhere(self, ctx: RequestContext) -> Execution: ...


class ExecutionAborted(Exception):
    """How a local execution ends when it was aborted (the client went away)."""


class Execution:
    """A started request. Headers are known now; tokens and the :class:`Outcome` come later."""

    ctx: RequestContext
    served_by: str
    route: str
    expected_cached: int  # the router's estimate for the node that serves it
    cached_estimate: int  # the serving node's exact match when it accepted the request
    placement: str | None = None  # the router's placement tag of the entry node's choice
    outcome: Outcome | None = None
    # ``sampling.logprobs``: each token's entry, appended before ``tokens`` yields it (local
    # only: never forwarded); ``prompt_logprobs``: the prompt's, set before the first token
    logprobs: list[TokenLogprob]
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()
    stopped = False  # a stop string matched: the consumer ended it (a normal completion)

    def tokens(self) -> AsyncGenerator[int, None]:
        """Generated token ids as they arrive (empty unless started with ``stream=True``)."""
        raise NotImplementedError

    def stop(self, output_ids: Sequence[int]) -> None:
        """A stop string matched: the answer is ``output_ids`` (up to the token that completed
        the match), finish "stop". The consumer then closes :meth:`tokens`; the node reports
        the request done, not cancelled, and aborts what still runs."""
        self.stopped = True
        self.outcome = self._stopped(list(output_ids))

    def _stopped(self, output_ids: list[int]) -> Outcome:
        raise NotImplementedError

    def abort(self) -> None:
        """Stop the work now (the core said so: the client went away)."""
        raise NotImplementedError

    async def result(self) -> Outcome:
        async for _ in self.tokens():
            pass
        assert self.outcome is not None
        return self.outcome


class LocalExecution(Execution):
    """A task awaiting this node's engine; its events land on an asyncio queue."""

    def __init__(self, node: Host, ctx: RequestContext, route: str, expected: int,
                 emitted: tuple[int, ...] = (), placement: str | None = None) -> None:
        self.node, self.ctx, self.route, self.expected_cached = node, ctx, route, expected
        self.placement = placement  # None for a peer's forward: the sender placed it
        self.served_by = node.node_id
        # in the request's namespace: another tenant's (or adapter's) blocks are not its own
        self.cached_estimate = match_in(node.engine, ctx.prompt, ctx.namespace)
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._t0 = node.clock()
        self._emitted = emitted  # tokens a failed peer already sent (the answer goes on)
        self._generated = 0  # tokens delivered so far
        self.may_retry = True  # an unreachable engine: go on elsewhere (once)
        self.first_at: float | None = None  # the node's clock at its first token
        self.logprobs = []
        self._task = self._start(len(emitted))

    def _start(self, resume_after: int) -> asyncio.Task[GenerateResult] | None:
        ctx = self.ctx
        remaining = ctx.sampling.max_tokens - resume_after
        if resume_after and remaining <= 0:  # the peer sent the whole answer before it failed
            self.queue.put_nowait(("full", None))
            return None
        sampling = replace(ctx.sampling, max_tokens=remaining)
        on_logprob = None if sampling.logprobs is None else self.logprobs.append
        on_prompt = None if sampling.prompt_logprobs is None else self._scored
        req = GenerateRequest(uuid.uuid4().hex, (*ctx.prompt, *self._emitted), sampling,
                              on_logprob, on_prompt, cache_namespace=ctx.namespace,
                              adapter=None if ctx.adapter is None else ctx.adapter.name)
        self._t0 = self.node.clock()
        task = asyncio.create_task(self.node.engine.generate(req, self._on_token),
                                   name=f"radixmesh-generate-{req.request_id[:8]}")
        self.node.pending += 1
        task.add_done_callback(self._finished)  # (the node reports the load: ``_queued``)
        return task

    def _scored(self, entries: tuple[TokenLogprob | None, ...]) -> None:  # on the event loop
        self.prompt_logprobs = entries

    def _on_token(self, tok: int) -> None:  # on the event loop
        self._generated += 1
        if self._generated == 1:  # it runs now: the engine's running count changed
            self.first_at = self.node.clock()
            self.node.first_token(self)
        if self.ctx.stream:
            self.queue.put_nowait(("tok", tok))

    def abort(self) -> None:
        """Stop the engine work: skipped if still waiting, stopped at its next token if
        running (no-op once finished)."""
        if self._task is not None:
            self._task.cancel()

    def _finished(self, task: asyncio.Task[GenerateResult]) -> None:
        self.node.pending -= 1
        if task.cancelled():
            self._failed(ExecutionAborted("the client went away"))
            return
        exc = task.exception()
        if exc is not None:
            self._failed(exc)
            return
        result = task.result()
        service_s = max(self.node.clock() - self._t0 - result.queue_s, 0.0)
        self.node.local_done(result, service_s)
        self.queue.put_nowait(("done", (result, service_s)))

    def _failed(self, exc: BaseException) -> None:
        """Ended without a result: the tokens it produced still count."""
        self.node.metrics.completion_tokens += self._generated
        if isinstance(exc, ExecutionAborted) and not self.stopped:
            self.node.metrics.cancelled += 1
        self.queue.put_nowait(("err", exc))
        self.node.push_cache_and_load()

    async def tokens(self) -> AsyncGenerator[int, None]:
        """The engine's tokens; a client request whose engine turned out unreachable before
        its first token goes on elsewhere, once (``NodeService.retry_elsewhere``)."""
        try:
            async for tok in self._engine_tokens():
                yield tok
        except EngineUnavailable as exc:
            if self._generated or self.ctx.rid is None or not self.may_retry or (
                    not self.node.engine_failed(str(exc))):
                raise
            other = await self.node.retry_elsewhere(self.ctx)
            if isinstance(other, LocalExecution):
                other.may_retry = False
            self.served_by, self.route = other.served_by, other.route
            async for tok in other.tokens():
                yield tok
            self.outcome = other.outcome

    async def _engine_tokens(self) -> AsyncGenerator[int, None]:
        async with self.node.tracked(self):
            while True:
                kind, value = await self.queue.get()
                if kind == "tok":
                    yield value
                elif kind in ("done", "full"):
                    self.outcome = self._outcome(value)
                    return
                else:
                    raise value

    def _outcome(self, value: tuple[GenerateResult, float] | None) -> Outcome:
        ctx, emitted = self.ctx, list(self._emitted)
        if value is None:
            return Outcome(emitted, "length", len(ctx.prompt), 0, self.served_by, self.route,
                           0.0, 0.0)
        result, service_s = value
        return Outcome(
            emitted + list(result.output_ids), result.finish_reason, len(ctx.prompt),
            min(result.cached_tokens, len(ctx.prompt)), self.served_by, self.route,
            result.queue_s, service_s, None, list(result.logprobs), result.prompt_logprobs,
        )

    def _stopped(self, output_ids: list[int]) -> Outcome:
        """Ended by a stop string: the engine's own split of the time is not known (queue 0,
        service = since submission) and ``cached_tokens`` is the match at submission."""
        prompt_len = len(self.ctx.prompt)
        cached = 0 if self.ctx.sampling.prompt_logprobs is not None else self.cached_estimate
        return Outcome(output_ids, "stop", prompt_len, min(cached, prompt_len),
                       self.served_by, self.route, 0.0, self.node.clock() - self._t0, None,
                       self.logprobs[: len(output_ids)], self.prompt_logprobs)


def _wire_beat(beat_s: float | None) -> float | None:
    """``beat_s`` within the forward protocol's bound (an hour): a prediction past it (a
    stalled or cold engine here, emulated at a large time scale) is clamped to it — any
    peer predicted faster than an hour beats it; not finite: no condition."""
    if beat_s is None or not math.isfinite(beat_s):
        return None
    return round(max(-3600.0, min(beat_s, 3600.0)), 6)


def forward_request(ctx: RequestContext, beat_s: float | None, heartbeat_s: float
                    ) -> ForwardRequest:
    """The wire form of ``ctx``: it carries plain sampling only (penalties and
    log-probabilities do not cross the forward protocol: such requests run where they
    arrive, ``local_only``)."""
    sp = ctx.sampling
    if not sp.plain:
        raise ValueError("penalties and log-probabilities cannot be forwarded")
    return ForwardRequest(
        ctx.prompt, sp.max_tokens, sp.temperature, sp.top_p, sp.seed, sp.stop_token_ids,
        ctx.stream, heartbeat_s, _wire_beat(beat_s), ctx.namespace,
        ctx.session, None if ctx.adapter is None else ctx.adapter.digest, ctx.tenant,
    )


class ForwardExecution(Execution):
    """Runs on a peer that accepted it; a failure continues locally as the core decides."""

    def __init__(self, node: Host, ctx: RequestContext, action: Forward,
                 stream: ForwardReplies, accepted: ForwardAdmitted, started: float) -> None:
        self.node, self.ctx, self.peer_id = node, ctx, action.peer_id
        self.served_by, self.route = action.peer_id, action.route
        self.expected_cached, self.placement = action.expected_cached, action.placement
        self.cached_estimate = accepted.cached_tokens
        self._stream, self._started = stream, started
        self._vocab = node.engine.tokenizer.vocab_size
        self._local: LocalExecution | None = None  # where the answer went on after a failure
        self.logprobs = []  # never forwarded with log-probabilities

    def abort(self) -> None:
        self._stream.close_now()

    async def tokens(self) -> AsyncGenerator[int, None]:
        emitted: list[int] = []
        async with self.node.tracked(self):
            try:
                async for tok in self._relay(emitted):
                    yield tok
                return
            except ForwardFailure as exc:
                action = self.node.forward_failed(self.ctx, self.peer_id, exc.reason,
                                                  len(emitted))
            finally:
                await self._stream.aclose()
        local = self._local = self.node.start_local(self.ctx, action, tuple(emitted))
        self.route, self.served_by = local.route, local.served_by
        async with aclosing(local.tokens()) as toks:  # closed with ours (a stop string)
            async for tok in toks:
                yield tok
        self.outcome = local.outcome

    def _stopped(self, output_ids: list[int]) -> Outcome:
        """Ended by a stop string; the peer's timings never came (queue 0, service = since
        the offer, no overhead), ``cached_tokens`` is its match at acceptance."""
        if self._local is not None:  # the answer went on here after the peer failed
            self._local.stop(output_ids)
            assert self._local.outcome is not None
            return self._local.outcome
        prompt_len = len(self.ctx.prompt)
        return Outcome(output_ids, "stop", prompt_len, min(self.cached_estimate, prompt_len),
                       self.peer_id, self.route, 0.0, self.node.clock() - self._started)

    async def _relay(self, emitted: list[int]) -> AsyncIterator[int]:
        while True:
            reply = await self._stream.next_reply()
            if isinstance(reply, ForwardTokens):
                for tok in self._checked(reply.ids, len(emitted)):
                    emitted.append(tok)
                    yield tok
            elif isinstance(reply, ForwardResult):
                self.outcome = self._finish(reply, emitted)
                return
            elif isinstance(reply, ForwardError):
                raise ForwardFailure("remote_error", reply.message[:200])
            elif not isinstance(reply, ForwardHeartbeat):
                raise ForwardFailure("bad_response", f"unexpected {type(reply).__name__}")

    def _checked(self, ids: tuple[int, ...], before: int = 0) -> tuple[int, ...]:
        """A peer's token ids (after ``before`` had): in the vocabulary, within max_tokens."""
        if any(t >= self._vocab for t in ids) or before + len(ids) > self.ctx.sampling.max_tokens:
            raise ForwardFailure("bad_response", f"token ids below {self._vocab}, max_tokens")
        return ids

    def _finish(self, res: ForwardResult, emitted: list[int]) -> Outcome:
        output = list(self._checked(res.output_ids))
        if emitted and output[: len(emitted)] != emitted:
            raise ForwardFailure("bad_response", "result disagrees with streamed tokens")
        overhead = max(self.node.clock() - self._started - res.handler_s, 0.0)
        first = None if res.first_token_s is None else overhead + res.first_token_s
        prompt_len = len(self.ctx.prompt)
        return Outcome(
            output, res.finish_reason, prompt_len, min(res.cached_tokens, prompt_len),
            self.peer_id, self.route, res.queue_s, res.service_s, overhead, forward_ttft_s=first,
        )


def result_reply(value: tuple[GenerateResult, float], handler_s: float,
                 first_token_s: float | None = None) -> ForwardReply:
    result, service_s = value
    return ForwardResult(
        tuple(result.output_ids), result.finish_reason, result.prompt_tokens,
        result.cached_tokens, max(result.queue_s, 0.0), service_s, max(handler_s, 0.0),
        None if first_token_s is None else max(first_token_s, 0.0),
    )
