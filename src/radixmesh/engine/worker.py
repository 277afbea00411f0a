"""``EngineWorker`` runs a synchronous engine's requests in FIFO order on one thread;
``ThreadedEngine`` puts it behind the :class:`~radixmesh.engine.base.AsyncEngine` interface.

Theory of operation
-------------------
::

    ThreadedEngine.generate(req, on_token)          (event loop)
        │ submit                      ▲ tokens: call_soon_threadsafe → on_token on the loop
        ▼                             │
    EngineWorker: [ FIFO queue ] ──▶ worker thread: engine.generate(req, relay)
        │                                   │
        └─ Future[GenerateResult] ◀─────────┘ result with queue_s = start - submit

``queue_depth`` counts waiting + running requests, ``waiting`` the queued ones and ``inflight``
the running one (0 or 1); all are updated before the request's future resolves, and a future
cancelled while queued stops counting at once (the worker skips it later). ``on_token`` and
the Future's callbacks run on the worker thread. If ``generate`` (or ``on_token``) raises, the
future carries the exception and the worker goes on with the next request;
:class:`RequestStopped` raised from ``on_token`` counts as ``cancelled``, not ``failed``.
``close()`` cancels waiting requests, lets the running one finish, and joins the thread.

``ThreadedEngine`` never lets its callers touch the engine thread: each token (and with a
request's ``on_logprob`` each log-probability entry, just before its token) hops to the loop
(``call_soon_threadsafe``, in order); cancelling the awaiting task cancels a queued future
(skipped) or makes the next token raise :class:`RequestStopped` on the engine thread (the
engine commits its KV so far and unwinds), and ``generate`` re-raises ``CancelledError`` once
the worker let go.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import cast

from radixmesh.engine.base import (
    AsyncEngine,
    Engine,
    EngineFacade,
    GenerateRequest,
    GenerateResult,
    TokenCallback,
)
from radixmesh.engine.relay import CLOSE_WAIT_S, Relay, RequestStopped


@dataclass(slots=True)
class _Job:
    req: GenerateRequest
    on_token: TokenCallback | None
    future: Future[GenerateResult]
    submitted: float


class EngineWorker:
    def __init__(self, engine: Engine, name: str = "radixmesh-engine", *,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.engine = engine
        self._clock = clock  # seconds, for queue_s (tests pass a virtual one)
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._running = 0
        self._closed = False
        self.completed = 0
        self.failed = 0
        self.cancelled = 0  # skipped before start, or stopped by RequestStopped
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        """Requests waiting or running."""
        with self._lock:
            return self._waiting + self._running

    @property
    def inflight(self) -> int:
        """The running request (0 or 1)."""
        with self._lock:
            return self._running

    @property
    def waiting(self) -> int:
        """Requests queued, not started and not cancelled."""
        with self._lock:
            return self._waiting

    def submit(
        self, req: GenerateRequest, on_token: TokenCallback | None = None
    ) -> Future[GenerateResult]:
        future: Future[GenerateResult] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("engine worker is closed")
            self._waiting += 1
            self._queue.put(_Job(req, on_token, future, self._clock()))
        future.add_done_callback(self._uncount_if_cancelled)
        return future

    def _uncount_if_cancelled(self, future: Future[GenerateResult]) -> None:
        """A future can only be cancelled before it starts: it stops counting as waiting now
        (``_run`` will skip it without counting it again)."""
        if future.cancelled():
            with self._lock:
                self._waiting -= 1
                self.cancelled += 1

    def close(self, timeout: float | None = None) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._drain_waiting()
        self._queue.put(None)
        self._thread.join(timeout)

    def _drain_waiting(self) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.future.cancel()

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            self._run(job)

    def _run(self, job: _Job) -> None:
        with self._lock:
            started = job.future.set_running_or_notify_cancel()
            if started:  # else: uncounted when it was cancelled
                self._waiting -= 1
                self._running = 1
        if not started:
            return
        queue_s = self._clock() - job.submitted
        try:
            result = self.engine.generate(job.req, job.on_token)
        except BaseException as exc:
            self._settle(job, exc)
            return
        self._settle(job, dataclasses.replace(result, queue_s=queue_s))

    def _settle(self, job: _Job, outcome: GenerateResult | BaseException) -> None:
        """Count the outcome and stop counting the job as running, then resolve its future."""
        with self._lock:
            self._running = 0
            if isinstance(outcome, GenerateResult):
                self.completed += 1
            elif isinstance(outcome, RequestStopped):
                self.cancelled += 1
            else:
                self.failed += 1
        if isinstance(outcome, GenerateResult):
            job.future.set_result(outcome)
        else:
            job.future.set_exception(outcome)


# ------------------------------------------------------------------------------ async adapter
class ThreadedEngine(EngineFacade):
    """A synchronous :class:`Engine` as an :class:`AsyncEngine`: one request at a time on an
    :class:`EngineWorker` thread, FIFO. ``engine`` (the wrapped engine) and ``worker`` stay
    valid until ``aclose``; the cache view and identity are the engine's, read directly."""

    def __init__(self, engine: Engine, name: str = "radixmesh-engine") -> None:
        self.engine = engine
        self.worker = EngineWorker(engine, name)

    @property
    def running(self) -> int:
        return self.worker.inflight

    @property
    def waiting(self) -> int:
        return self.worker.waiting

    @property
    def extended_sampling(self) -> bool:
        """The wrapped engine honours penalties and log-probabilities (``SamplingParams``)."""
        return bool(getattr(self.engine, "extended_sampling", False))

    async def generate(
        self, req: GenerateRequest, on_token: TokenCallback | None = None
    ) -> GenerateResult:
        """As :class:`AsyncEngine`; ``req.on_logprob`` and ``req.on_prompt_logprobs`` run on
        the loop too, in the order the engine called them (a logprob just before its token)."""
        relay = Relay(asyncio.get_running_loop(), on_token, req.on_logprob,
                       req.on_prompt_logprobs)
        if req.on_logprob is not None:
            req = dataclasses.replace(req, on_logprob=relay.logprob_from_engine)
        if req.on_prompt_logprobs is not None:
            req = dataclasses.replace(req, on_prompt_logprobs=relay.prompt_from_engine)
        future = self.worker.submit(req, relay.from_engine)
        done = asyncio.wrap_future(future)
        try:
            result = await asyncio.shield(done)
        except asyncio.CancelledError:
            await _let_go(relay, future, done)
            raise
        except RequestStopped as stopped:  # on_token raised: relay.error is why
            raise (relay.error or stopped) from None
        if relay.error is not None:  # on_token failed on the last token
            raise relay.error
        return result

    async def aclose(self) -> None:
        await asyncio.to_thread(self.worker.close, CLOSE_WAIT_S)



async def _let_go(relay: Relay, future: Future[GenerateResult],
                  done: asyncio.Future[GenerateResult]) -> None:
    """Stop a cancelled request and wait until the worker no longer holds it."""
    relay.stopped = True  # running: the next token raises RequestStopped
    future.cancel()  # still queued: skipped
    await asyncio.wait({done})
    if not done.cancelled():
        done.exception()  # retrieved: the result or RequestStopped is dropped


def as_async_engine(engine: Engine | AsyncEngine) -> AsyncEngine:
    """``engine`` itself if its ``generate`` is a coroutine function, the built-in engine on
    its batching loop (``BatchedEngine``), else a ThreadedEngine (one request at a time)."""
    if inspect.iscoroutinefunction(engine.generate):
        return cast(AsyncEngine, engine)
    as_async = getattr(type(engine), "as_async", None)  # a proxy that knows (runtime/debug.py)
    if as_async is not None:
        return cast(AsyncEngine, as_async(engine))
    from radixmesh.engine.builtin import TransformersEngine  # torch: only when needed

    if isinstance(engine, TransformersEngine):
        from radixmesh.engine.batched import BatchedEngine

        return BatchedEngine.for_engine(engine)
    return ThreadedEngine(cast(Engine, engine))
