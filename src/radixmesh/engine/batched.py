"""``BatchedEngine``: the built-in engine as an :class:`~radixmesh.engine.base.AsyncEngine`,
many requests at once on the core scheduler.

Theory of operation
-------------------
::

    generate(req) (event loop) ──inbox──▶ engine thread: runner.submit / runner.abort
                                           loop: runner.step() while anything is in flight,
                                                 else block on the inbox
    tokens, logprobs, the result ◀── call_soon_threadsafe (in order) ── runner callbacks

One thread owns the :class:`~radixmesh.engine.batch.BatchRunner` (scheduler, paged KV, model);
the event loop only posts to its inbox and reads the cache view (``match``, ``usage``,
``drain_cache_delta``, ``cache_hashes``: the runner takes its lock). Between two steps the
thread takes everything in the inbox, so a request arriving mid-step joins the next one.

Cancellation: cancelling the task awaiting ``generate`` marks its relay stopped (the next token
raises ``RequestStopped`` on the engine thread, which aborts the sequence) and posts an abort,
so a request still waiting in the scheduler ends without running; ``generate`` re-raises
``CancelledError`` once the engine let go of it (its ``on_done`` ran). ``aclose`` aborts
everything not yet admitted, lets admitted sequences finish, and joins the thread.

Threads: the model was built (and its weights packed) on the thread that makes this engine, which
leaves an OpenMP team behind it; ``__init__`` lets that team go (``engine/openmp.py``), or every
step's parallel regions would sleep on futexes instead of spinning (a 500-token prefill 1.5x,
a decode step of 8 1.3-1.6x slower on 2 cores).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from radixmesh.engine.base import (
    EngineFacade,
    GenerateRequest,
    GenerateResult,
    TokenCallback,
)
from radixmesh.engine.builtin import TransformersEngine
from radixmesh.engine.openmp import release_thread_team
from radixmesh.engine.relay import CLOSE_WAIT_S, Relay, RequestStopped

log = logging.getLogger("radixmesh.engine")
_Submit = tuple[GenerateRequest, TokenCallback, Any]  # (req, on_token, on_done)


class BatchedEngine(EngineFacade):
    """See the module docstring. ``engine`` stays valid until ``aclose``."""

    extended_sampling = True

    def __init__(self, engine: TransformersEngine, name: str = "radixmesh-engine") -> None:
        if engine.driver is not None:
            raise RuntimeError("the engine already has a BatchedEngine (use ``for_engine``)")
        engine.driver = self
        self.users = 1  # nodes sharing it (``for_engine``); the last ``aclose`` closes it
        self.before_request: Callable[[], None] | None = None  # on the engine thread (debug)
        self.proxy: object = None  # the engine proxy that made this (runtime/debug.py)
        self.engine = engine
        self._runner = engine.runner
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._queued = 0  # submitted, not yet taken by the thread
        self._count_lock = threading.Lock()
        self._closed = False
        self._by_key: dict[int, int] = {}  # id(on_done) -> seq
        release_thread_team()  # the model was built here: only the engine thread's team spins
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------- counts
    @property
    def running(self) -> int:
        return self._runner.in_flight - self._runner.waiting

    @property
    def waiting(self) -> int:
        return self._runner.waiting + self._queued

    def describe(self) -> dict[str, object]:
        """Engine counters for ``/mesh``."""
        return {"batched": True, **self.engine.stats()}

    # ------------------------------------------------------------------------- requests
    async def generate(
        self, req: GenerateRequest, on_token: TokenCallback | None = None
    ) -> GenerateResult:
        if self._closed:
            raise RuntimeError("engine is closed")
        loop = asyncio.get_running_loop()
        relay = Relay(loop, on_token, req.on_logprob, req.on_prompt_logprobs)
        if req.on_logprob is not None:
            req = dataclasses.replace(req, on_logprob=relay.logprob_from_engine)
        if req.on_prompt_logprobs is not None:
            req = dataclasses.replace(req, on_prompt_logprobs=relay.prompt_from_engine)
        self.engine.budget(req)  # a bad request fails here, on the caller's task
        done: asyncio.Future[GenerateResult] = loop.create_future()

        def on_done(outcome: GenerateResult | BaseException) -> None:  # engine thread
            loop.call_soon_threadsafe(_settle, done, outcome)

        with self._count_lock:
            self._queued += 1
        self._inbox.put(("submit", (req, relay.from_engine, on_done)))
        try:
            result = await asyncio.shield(done)
        except asyncio.CancelledError:
            relay.stopped = True
            self._inbox.put(("abort", on_done))
            await asyncio.wait({done})
            if not done.cancelled():
                done.exception()  # the engine's answer to the abort: read, not logged
            raise
        except RequestStopped as stopped:
            raise (relay.error or stopped) from None
        if relay.error is not None:
            raise relay.error
        return result

    def run_blocking(self, req: GenerateRequest, on_token: TokenCallback | None
                     ) -> GenerateResult:
        """``generate`` for a thread other than the engine's (the synchronous engine API):
        ``on_token`` runs on the engine thread; blocks until the request is done."""
        if self._closed:
            raise RuntimeError("engine is closed")
        self.engine.budget(req)
        done: Future[GenerateResult] = Future()

        def on_done(outcome: GenerateResult | BaseException) -> None:
            if isinstance(outcome, BaseException):
                done.set_exception(outcome)
            else:
                done.set_result(outcome)

        with self._count_lock:
            self._queued += 1
        self._inbox.put(("submit", (req, on_token, on_done)))
        return done.result()

    @classmethod
    def for_engine(cls, engine: TransformersEngine) -> BatchedEngine:
        """The engine's BatchedEngine: the running one (one more user), else a new one."""
        driver = engine.driver
        if isinstance(driver, BatchedEngine) and not driver._closed:
            driver.users += 1
            return driver
        return cls(engine)

    async def aclose(self) -> None:
        self.users -= 1
        if self._closed or self.users > 0:
            return
        self._closed = True
        self._inbox.put(("close", None))
        await asyncio.to_thread(self._thread.join, CLOSE_WAIT_S)
        if not self._thread.is_alive() and self.engine.driver is self:
            self.engine.driver = None  # the synchronous API steps the runner again

    # ------------------------------------------------------------------------- the thread
    def _loop(self) -> None:
        closing = False
        while not (closing and self._runner.idle):
            block = self._runner.idle and not closing
            closing = self._take(block) or closing
            if closing:
                for seq in self._runner.waiting_ids():
                    self._runner.abort(seq, asyncio.CancelledError())
            try:
                self._runner.step()
            except Exception as exc:  # a bug: every request fails, the engine goes on
                log.exception("built-in engine step failed; failing %d requests",
                              self._runner.in_flight)
                self._runner.restart(exc)

    def _take(self, block: bool) -> bool:
        """Apply everything in the inbox (waiting for one item if ``block``); True on close."""
        closing = False
        while True:
            try:
                kind, item = self._inbox.get(block=block)
            except queue.Empty:
                return closing
            block = False
            if kind == "close":
                closing = True
            elif kind == "abort":
                seq = self._by_key.pop(id(item), None)
                if seq is not None:
                    self._runner.abort(seq, asyncio.CancelledError())
            else:
                self._submit(item, closing)
                with self._count_lock:
                    self._queued -= 1

    def _submit(self, item: _Submit, closing: bool) -> None:
        req, on_token, on_done = item
        if closing:
            on_done(asyncio.CancelledError())
            return
        key = id(on_done)
        if self.before_request is not None:
            self.before_request()

        def finished(outcome: GenerateResult | BaseException) -> None:
            self._by_key.pop(key, None)
            on_done(outcome)

        try:
            seq = self._runner.submit(req, self.engine.budget(req), on_token, finished)
        except Exception as exc:  # refused (too long for the pool): the caller's error
            on_done(exc)
            return
        if self._runner.has(seq):
            self._by_key[key] = seq



def _settle(done: asyncio.Future[GenerateResult], outcome: GenerateResult | BaseException
            ) -> None:
    if done.done():
        return
    if isinstance(outcome, BaseException):
        done.set_exception(outcome)
    else:
        done.set_result(outcome)
