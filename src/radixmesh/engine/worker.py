"""``EngineWorker``: one thread runs an engine's requests in FIFO order.

Theory of operation
-------------------
::

    submit(req) ──▶ [ FIFO queue ] ──▶ worker thread: engine.generate(req, on_token)
        │                                   │
        └─ Future[GenerateResult] ◀─────────┘ result with queue_s = start - submit

``queue_depth`` counts waiting + running requests and ``inflight`` the running one (0 or 1);
both are what a node gossips as its load. ``on_token`` and the Future's callbacks run on the
worker thread: an asyncio caller must hop back with ``loop.call_soon_threadsafe`` (or wrap the
future with ``asyncio.wrap_future``). A future cancelled before it starts is skipped. If
``generate`` (or ``on_token``) raises, the future carries the exception and the worker goes
on with the next request. ``close()`` cancels waiting requests, lets the running one finish,
and joins the thread.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from radixmesh.engine.base import Engine, GenerateRequest, GenerateResult, TokenCallback


@dataclass(slots=True)
class _Job:
    req: GenerateRequest
    on_token: TokenCallback | None
    future: Future[GenerateResult]
    submitted: float


class EngineWorker:
    def __init__(self, engine: Engine, name: str = "radixmesh-engine") -> None:
        self.engine = engine
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._running = 0
        self._closed = False
        self.completed = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        """Requests waiting or running."""
        with self._lock:
            return self._waiting + self._running

    @property
    def inflight(self) -> int:
        with self._lock:
            return self._running

    def submit(
        self, req: GenerateRequest, on_token: TokenCallback | None = None
    ) -> Future[GenerateResult]:
        future: Future[GenerateResult] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("engine worker is closed")
            self._waiting += 1
            self._queue.put(_Job(req, on_token, future, time.perf_counter()))
        return future

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
                with self._lock:
                    self._waiting -= 1
                job.future.cancel()

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                self._waiting -= 1
                self._running = 1
            try:
                self._run(job)
            finally:
                with self._lock:
                    self._running = 0

    def _run(self, job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        queue_s = time.perf_counter() - job.submitted
        try:
            result = self.engine.generate(job.req, job.on_token)
        except BaseException as exc:
            self.failed += 1
            job.future.set_exception(exc)
            return
        self.completed += 1
        job.future.set_result(dataclasses.replace(result, queue_s=queue_s))
