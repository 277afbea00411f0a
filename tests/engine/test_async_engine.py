"""The AsyncEngine contract: ThreadedEngine over a fake synchronous engine (FIFO, counts,
cancellation while waiting or running, errors, tokens on the loop), and a fake *concurrent*
AsyncEngine under NodeService (the runtime does not assume one request at a time)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import pytest

from radixmesh.core.blocks import Fingerprint
from radixmesh.core.byte_tokenizer import ByteTokenizer
from radixmesh.core.events import LoadChanged
from radixmesh.core.prefix_cache import CacheUsage
from radixmesh.engine.base import (
    AsyncEngine,
    CacheDelta,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    TokenCallback,
)
from radixmesh.engine.worker import RequestStopped, ThreadedEngine, as_async_engine
from radixmesh.runtime.config import ServeConfig
from radixmesh.runtime.node import NodeService

if TYPE_CHECKING:
    from conftest import Poll

WAIT_S = 5.0


class _CacheView:
    """An empty prefix cache and a fixed identity, shared by both fakes."""

    model_name = "fake"
    fingerprint = Fingerprint("fake-model", "bytes")
    max_context = 1024
    tokenizer = ByteTokenizer()

    def match(self, prompt_ids: Sequence[int]) -> int:
        return 0

    def usage(self) -> CacheUsage:
        return CacheUsage(0, 4096, 0)

    def drain_cache_delta(self) -> CacheDelta:
        return CacheDelta()

    def cache_hashes(self) -> frozenset[int]:
        return frozenset()


class StepEngine(_CacheView):
    """Synchronous fake: each token waits for one ``step`` the test releases."""

    def __init__(self) -> None:
        self.steps = threading.Semaphore(0)
        self.order: list[str] = []  # requests in the order they started
        self.produced: dict[str, int] = {}  # tokens computed per request
        self.stopped: list[str] = []  # requests stopped by RequestStopped
        self.thread_ids: set[int] = set()
        self.on_token: dict[str, TokenCallback | None] = {}  # what each request was given

    def generate(self, req: GenerateRequest, on_token: TokenCallback | None = None
                 ) -> GenerateResult:
        rid = req.request_id
        self.order.append(rid)
        self.thread_ids.add(threading.get_ident())
        self.produced[rid] = 0
        self.on_token[rid] = on_token
        if rid.startswith("bad"):
            raise ValueError("bad request")
        out: list[int] = []
        for tok in range(req.sampling.max_tokens):
            assert self.steps.acquire(timeout=WAIT_S), "the test never released a step"
            out.append(tok)
            self.produced[rid] += 1
            try:
                if on_token is not None:
                    on_token(tok)
            except RequestStopped:
                self.stopped.append(rid)
                raise
        return GenerateResult(rid, out, "length", len(req.prompt_ids), 0, 0.0, 0.0, 0.0)


def _req(rid: str, tokens: int = 2) -> GenerateRequest:
    return GenerateRequest(rid, (1, 2, 3), SamplingParams(max_tokens=tokens))


def _run(scenario: Callable[[ThreadedEngine, StepEngine], object]) -> None:
    async def main() -> None:
        fake = StepEngine()
        engine = ThreadedEngine(fake)  # type: ignore[arg-type]
        try:
            await scenario(engine, fake)  # type: ignore[misc]
        finally:
            fake.steps.release(1000)
            await engine.aclose()

    asyncio.run(main())


# ------------------------------------------------------------------------------ adapter
def test_fifo_order_and_running_waiting_counts(poll: Poll) -> None:
    async def scenario(engine: ThreadedEngine, fake: StepEngine) -> None:
        seen: dict[str, list[int]] = {r: [] for r in "abc"}
        tasks = [asyncio.create_task(engine.generate(_req(r), seen[r].append)) for r in "abc"]
        await poll.until_async(lambda: fake.order == ["a"], "fake.order == ['a']")
        assert (engine.running, engine.waiting) == (1, 2)
        fake.steps.release(6)
        results = await asyncio.gather(*tasks)
        assert fake.order == ["a", "b", "c"]
        assert [r.request_id for r in results] == ["a", "b", "c"]
        assert all(seen[r.request_id] == r.output_ids == [0, 1] for r in results)
        assert results[2].queue_s >= results[0].queue_s
        assert (engine.running, engine.waiting) == (0, 0)  # before generate returned

    _run(scenario)


def test_cancel_while_waiting_never_runs(poll: Poll) -> None:
    async def scenario(engine: ThreadedEngine, fake: StepEngine) -> None:
        first = asyncio.create_task(engine.generate(_req("a")))
        queued = asyncio.create_task(engine.generate(_req("b")))
        await poll.until_async(lambda: fake.order == ["a"] and engine.waiting == 1,
                               "a running, b waiting")
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert (engine.running, engine.waiting) == (1, 0)  # uncounted at once
        fake.steps.release(2)
        assert (await first).output_ids == [0, 1]
        await poll.until_async(lambda: engine.worker.cancelled == 1, "engine.worker.cancelled == 1")
        assert fake.order == ["a"]  # b never started
        assert engine.worker.completed == 1 and engine.worker.failed == 0

    _run(scenario)


def test_cancel_while_running_stops_at_the_next_token(poll: Poll) -> None:
    async def scenario(engine: ThreadedEngine, fake: StepEngine) -> None:
        seen: list[int] = []
        task = asyncio.create_task(engine.generate(_req("a", tokens=50), seen.append))
        fake.steps.release(1)
        await poll.until_async(lambda: seen == [0], "seen == [0]")
        task.cancel()
        relay = getattr(fake.on_token["a"], "__self__", None)  # the adapter's token path
        await poll.until_async(lambda: relay is not None and relay.stopped,
                               "the cancellation to reach the engine's token path")
        assert not task.done()  # CancelledError waits until the engine let go
        fake.steps.release(1)  # the next token: on_token raises RequestStopped there
        with pytest.raises(asyncio.CancelledError):
            await task
        assert fake.stopped == ["a"] and fake.produced["a"] == 2
        assert seen == [0]  # nothing delivered after the cancellation
        assert (engine.running, engine.waiting) == (0, 0)
        assert (engine.worker.cancelled, engine.worker.failed) == (1, 0)

    _run(scenario)


def test_an_exception_in_generate_propagates_and_the_next_request_runs() -> None:
    async def scenario(engine: ThreadedEngine, fake: StepEngine) -> None:
        with pytest.raises(ValueError, match="bad request"):
            await engine.generate(_req("bad"))
        fake.steps.release(2)
        assert (await engine.generate(_req("ok"))).request_id == "ok"
        assert (engine.worker.failed, engine.worker.completed) == (1, 1)

    _run(scenario)


def test_on_token_runs_on_the_event_loop_thread() -> None:
    async def scenario(engine: ThreadedEngine, fake: StepEngine) -> None:
        threads: list[int] = []
        fake.steps.release(3)
        await engine.generate(_req("a", tokens=3), lambda _: threads.append(threading.get_ident()))
        assert threads == [threading.get_ident()] * 3
        assert threading.get_ident() not in fake.thread_ids

    _run(scenario)


def test_an_exception_in_on_token_stops_the_request_and_is_raised(poll: Poll) -> None:
    async def scenario(engine: ThreadedEngine, fake: StepEngine) -> None:
        calls: list[int] = []

        def boom(tok: int) -> None:
            calls.append(tok)
            raise KeyError(tok)

        task = asyncio.create_task(engine.generate(_req("a", tokens=50), boom))
        fake.steps.release(1)
        await poll.until_async(lambda: calls == [0], "calls == [0]")
        fake.steps.release(1)  # the next token stops it
        with pytest.raises(KeyError):
            await task
        assert fake.stopped == ["a"] and fake.produced["a"] == 2 and calls == [0]

    _run(scenario)


def test_aclose_cancels_waiting_requests_then_refuses_new_ones(poll: Poll) -> None:
    async def main() -> None:
        fake = StepEngine()
        engine = ThreadedEngine(fake)  # type: ignore[arg-type]
        running = asyncio.create_task(engine.generate(_req("a")))
        waiting = asyncio.create_task(engine.generate(_req("b")))
        await poll.until_async(lambda: fake.order == ["a"] and engine.waiting == 1,
                               "a running, b waiting")
        closing = asyncio.create_task(engine.aclose())
        await poll.until_async(lambda: waiting.done(), "waiting.done()")
        fake.steps.release(2)
        await closing
        assert (await running).output_ids == [0, 1]
        assert waiting.cancelled() and fake.order == ["a"]
        with pytest.raises(RuntimeError):
            await engine.generate(_req("c"))

    asyncio.run(main())


def test_as_async_engine_wraps_only_synchronous_engines() -> None:
    concurrent = ConcurrentEngine()
    assert as_async_engine(concurrent) is concurrent  # type: ignore[arg-type]
    wrapped = as_async_engine(StepEngine())  # type: ignore[arg-type]
    assert isinstance(wrapped, ThreadedEngine)
    asyncio.run(wrapped.aclose())


# ------------------------------------------------------------------------------ the runtime
class ConcurrentEngine(_CacheView):
    """A batching AsyncEngine fake: every request runs at once; one token, then the gate."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.peak = 0
        self.closed = False
        self.gate: asyncio.Event | None = None

    async def generate(self, req: GenerateRequest, on_token: TokenCallback | None = None
                       ) -> GenerateResult:
        gate = self.gate = self.gate or asyncio.Event()
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            if on_token is not None:
                on_token(7)
            await gate.wait()
        finally:
            self.running -= 1
        return GenerateResult(req.request_id, [7], "length", len(req.prompt_ids), 0, 0.0,
                              0.0, 0.0)

    async def aclose(self) -> None:
        self.closed = True


def _gauge(text: str, name: str) -> float:
    [line] = [x for x in text.splitlines() if x.startswith(name + " ")]
    return float(line.split()[1])


def test_the_node_runs_requests_concurrently_and_reports_them_inflight(poll: Poll) -> None:
    async def main() -> None:
        fake = ConcurrentEngine()
        engine: AsyncEngine = fake
        service = NodeService(ServeConfig(node_id="batch", port=18_996, gossip_interval=5.0),
                              engine)
        assert service.engine is fake
        loads: list[LoadChanged] = []
        dispatch = service.dispatch

        def recording(event):  # type: ignore[no-untyped-def]
            if isinstance(event, LoadChanged):
                loads.append(event)
            return dispatch(event)

        service.dispatch = recording  # type: ignore[method-assign]
        await service.start()
        try:
            sampling = SamplingParams(max_tokens=1)
            runs = [await service.execute(list(range(i, i + 20)), sampling, stream=False)
                    for i in (0, 50)]
            results = [asyncio.create_task(ex.result()) for ex in runs]
            await poll.until_async(lambda: fake.running == 2, "fake.running == 2")
            assert (service.queue_depth, service.inflight) == (2, 2)
            assert any((ev.queue_depth, ev.inflight) == (2, 2) for ev in loads)
            assert _gauge(service.prometheus(), "radixmesh_inflight") == 2.0
            assert fake.gate is not None
            fake.gate.set()
            outcomes = await asyncio.gather(*results)
            assert [o.output_ids for o in outcomes] == [[7], [7]]
            assert fake.peak == 2 and service.queue_depth == 0
            assert (loads[-1].queue_depth, loads[-1].inflight) == (0, 0)
        finally:
            await service.stop()
        assert fake.closed

    asyncio.run(main())
