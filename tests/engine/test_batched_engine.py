"""BatchedEngine: the AsyncEngine contract on the batching loop (concurrency, streaming order,
cancellation, counts, close) over the real micro model."""

from __future__ import annotations

import asyncio
import gc
import random

import pytest

from radixmesh.engine.base import GenerateRequest, SamplingParams
from radixmesh.engine.batched import BatchedEngine
from radixmesh.engine.factory import build_engine
from radixmesh.engine.worker import as_async_engine


def _req(i: int, n: int = 40, max_tokens: int = 8) -> GenerateRequest:
    rng = random.Random(i)
    return GenerateRequest(f"r{i}", tuple(rng.randrange(256) for _ in range(n)),
                           SamplingParams(max_tokens=max_tokens))


def test_concurrent_requests_batch_and_stream_in_order() -> None:
    raw = build_engine("micro", cache_tokens=4096)
    alone = [raw.generate(_req(i)).output_ids for i in range(6)]
    raw.clear_cache()

    async def scenario() -> None:
        engine = as_async_engine(raw)
        assert isinstance(engine, BatchedEngine)
        seen: dict[int, list[int]] = {i: [] for i in range(6)}
        results = await asyncio.gather(*(engine.generate(_req(i), seen[i].append)
                                         for i in range(6)))
        for i, res in enumerate(results):
            assert res.output_ids == seen[i] == alone[i]
        assert engine.running == engine.waiting == 0
        assert raw.stats()["max_batch"] >= 2 and raw.stats()["kv_bytes_copied"] == 0
        assert raw.generate(_req(0)).output_ids == alone[0]  # sync API through its thread
        await engine.aclose()

    asyncio.run(scenario())
    assert raw.driver is None  # closed: the synchronous path steps the runner again
    assert raw.generate(_req(1)).output_ids == alone[1]


def test_cancelling_stops_a_request_and_frees_its_blocks() -> None:
    raw = build_engine("micro", cache_tokens=4096)
    unhandled: list[dict[str, object]] = []  # what the loop would log ("never retrieved")

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: unhandled.append(ctx))
        engine = BatchedEngine.for_engine(raw)
        got: list[int] = []
        first = asyncio.Event()

        def on_token(tok: int) -> None:
            got.append(tok)
            first.set()

        task = asyncio.create_task(engine.generate(_req(1, max_tokens=2000), on_token))
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.running == engine.waiting == 0
        assert len(got) < 2000
        assert raw.usage().locked_tokens == 0
        after = await engine.generate(_req(2))  # the engine goes on
        assert len(after.output_ids) == 8
        await engine.aclose()
        gc.collect()  # an unread future's exception is logged when it is collected

    asyncio.run(scenario())
    assert unhandled == []


def test_a_request_the_pool_cannot_hold_fails_alone() -> None:
    raw = build_engine("micro", cache_tokens=64)

    async def scenario() -> None:
        engine = BatchedEngine.for_engine(raw)
        with pytest.raises(ValueError, match="never fit"):
            await engine.generate(_req(1, n=100))
        assert len((await engine.generate(_req(2, n=20))).output_ids) == 8
        await engine.aclose()
        with pytest.raises(RuntimeError):
            await engine.generate(_req(3))

    asyncio.run(scenario())
