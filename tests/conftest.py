"""Helpers shared by every test directory: one bounded poll, one small engine, one tokenizer.

Theory of operation
-------------------
Tests that drive real processes, threads or event loops wait for a *condition* (a node sees a
peer, a queue drains), never for a fixed time: ``poll.until(cond, what, timeout)`` calls
``cond`` every ``interval`` seconds until it returns something truthy and returns that value;
past ``timeout`` it fails the test with "timed out after T s waiting for WHAT".
``await poll.until_async(...)`` is the same on a running event loop (the loop keeps running
between checks). ``watch`` (sync only) is called between checks and may raise to fail fast,
e.g. when a process the condition depends on has exited. ``await poll.past_slow_joiner(fake,
arrived, what)`` waits until a KV-event subscriber of a fake engine gets its first batch (ZMQ's
slow joiner), publishing harmless ones meanwhile. ``load_thread`` is the class ``Load``: a
client thread sending requests one after another while a test does something to the mesh.

``virtual_loop`` is a fresh event loop on virtual time (closed after the test): a wait of T
seconds (``asyncio.sleep``, a timeout, any timer) moves its clock (``loop.time()``) on by T at
once, timers fire in order, and no real time passes; run a coroutine on it with
``virtual_loop.run_until_complete(...)``. Code that reads another clock is given
``virtual_loop.time`` instead (``monkeypatch``).

``engine`` is the built-in engine of the ``micro`` preset (4096 cache tokens, one thread), one
per test module, for the tests that serve nodes on it; a module that needs another engine
defines its own ``engine`` fixture, which pytest prefers. ``tokenizer_dir`` is a model
directory of the ``micro`` preset with random weights (its tokenizer files are what the fake
and emulated engines load), one per test module.

All are fixtures (``def test_x(poll: Poll)``), not importable functions, because test
directories have conftest files of their own and no ``__init__.py``: ``import conftest`` would
find whichever was loaded last.
"""

from __future__ import annotations

import asyncio
import selectors
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

T = TypeVar("T")


class Poll:
    """Bounded polling of a condition (see the module docstring)."""

    def until(self, cond: Callable[[], T], what: str, timeout: float = 10.0, *,
              interval: float = 0.02, watch: Callable[[], None] | None = None) -> T:
        deadline = time.monotonic() + timeout
        while True:
            value = cond()
            if value:
                return value
            if time.monotonic() >= deadline:
                raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
            if watch is not None:
                watch()
            time.sleep(interval)  # the poll's period, not a synchronisation

    async def until_async(self, cond: Callable[[], T], what: str, timeout: float = 10.0, *,
                          interval: float = 0.01) -> T:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            value = cond()
            if value:
                return value
            if loop.time() >= deadline:
                raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
            await asyncio.sleep(interval)  # lets the loop run the work being waited for

    async def past_slow_joiner(self, fake: Any, arrived: Callable[[], object], what: str,
                               timeout: float = 10.0, *, tracker: Any = None) -> None:
        """Past ZMQ's slow joiner: a subscriber to ``fake``'s KV-event publisher misses what
        is published before its connection is up, so publish harmless batches
        (``fake.clear_all()``) until ``arrived()`` says one got through; with ``tracker``
        (the subscriber's sequence tracker), then until it applied every batch (a first batch
        may still be waiting for the replay of the gap before it)."""
        def got_one() -> bool:
            if arrived():
                return True
            fake.clear_all()  # another harmless batch for the next check
            return False

        await self.until_async(got_one, what, timeout, interval=0.02)
        if tracker is not None:
            await self.until_async(lambda: tracker.next_seq == fake.seq,
                                   "the subscriber to apply every batch", timeout)


@pytest.fixture(scope="session")
def poll() -> Poll:
    return Poll()


class Load:
    """A client thread sending requests one after another until stopped (at most ``limit``):
    ``send(i)`` sends the i-th and returns what to keep in ``results``; an HTTP error is kept
    in ``errors`` as text (``label(i)`` first, when given). ``with load_thread(send, limit)
    as load:`` starts it; leaving the block stops it and joins the thread (<= 60 s)."""

    def __init__(self, send: Callable[[int], Any], limit: int,
                 label: Callable[[int], str] | None = None) -> None:
        self._send, self._limit, self._label = send, limit, label
        self.results: list[Any] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set() and i < self._limit:  # bounded
            try:
                self.results.append(self._send(i))
            except httpx.HTTPError as exc:
                where = "" if self._label is None else f"{self._label(i)}: "
                self.errors.append(f"{where}{type(exc).__name__}: {exc}")
            i += 1


@pytest.fixture(scope="session")
def load_thread() -> type[Load]:
    return Load


class _VirtualSelector(selectors.DefaultSelector):
    """Never blocks: a wait for ``timeout`` seconds moves the loop's clock instead."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout > 0:
            self.now += timeout
        return super().select(0)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time: timers fire in order, and no real time passes."""

    def __init__(self) -> None:
        self._virtual = _VirtualSelector()
        super().__init__(self._virtual)

    def time(self) -> float:
        return self._virtual.now


@pytest.fixture
def virtual_loop() -> Iterator[VirtualTimeLoop]:
    loop = VirtualTimeLoop()
    try:
        yield loop
    finally:
        loop.close()


@pytest.fixture(scope="module")
def engine() -> Any:
    from radixmesh.engine.factory import build_engine  # torch: only where a test asks

    return build_engine("micro", cache_tokens=4096, threads=1)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from radixmesh.engine.testing import save_random_model_dir

    return save_random_model_dir(tmp_path_factory.mktemp("tok"), "micro")
