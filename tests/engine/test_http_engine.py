"""HttpEngine against the fake vLLM / SGLang engine on 127.0.0.1: token streaming, concurrent
requests, cancellation closing the stream, cached tokens, and the exact index rebuilt from the
fake's real KV events equal to the fake's own cache."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import pytest

from radixmesh.core.blocks import block_hashes
from radixmesh.core.kv_events import EngineBlockStored, KvBatch
from radixmesh.emulate.fake import FakeEngine, next_token, running
from radixmesh.engine.base import GenerateRequest, SamplingParams
from radixmesh.engine.http_engine import EngineUnavailable, HttpEngine, mesh_block_size
from radixmesh.engine.tokenizers import ByteTokenizer
from radixmesh.runtime.kv_subscriber import KvSubscriber, plan_endpoints

if TYPE_CHECKING:
    from conftest import Poll

LIMIT_S = 10.0


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        tok = next_token([*seq[-4:]])
        seq.append(tok)
        out.append(tok)
    return out


def request(prompt: list[int], max_tokens: int = 8, rid: str = "r") -> GenerateRequest:
    return GenerateRequest(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens))


def prompt_of(text: str) -> list[int]:
    return list(text.encode())


def http_engine(fake: FakeEngine, kind: str = "vllm") -> HttpEngine:
    return HttpEngine(kind, fake.url, ByteTokenizer(), model_name=fake.model, block_size=16,
                      cache_tokens=fake.cache_tokens)


@contextlib.asynccontextmanager
async def subscribed(
    poll: Poll, fake: FakeEngine, engine: HttpEngine
) -> AsyncIterator[KvSubscriber]:
    pubs, replays = plan_endpoints(fake.kv_endpoint, fake.replay_endpoint, fake.url)
    sub = KvSubscriber(engine.index, pubs, replays, replay_timeout_s=1.0)
    await sub.start()
    try:
        await poll.past_slow_joiner(fake, lambda: sub.counts["messages"],
                                    "the subscriber to receive a batch", LIMIT_S)
        await settled(poll, fake, sub)  # and handled (a first batch may still await its replay)
        yield sub
    finally:
        await sub.stop()


def truth(fake: FakeEngine, seed: int) -> frozenset[int]:
    return frozenset(block_hashes(p, 16, seed)[-1] for p in fake.block_prefixes())


async def settled(poll: Poll, fake: FakeEngine, sub: KvSubscriber) -> None:
    await poll.until_async(lambda: sub.publishers[0].tracker.next_seq == fake.seq,
                           "all batches applied", LIMIT_S)


@pytest.mark.parametrize("kind", ["vllm", "sglang", "openai"])
def test_tokens_stream_back_through_on_token(kind: str) -> None:
    async def scenario() -> None:
        async with running() as fake:
            engine = http_engine(fake, kind)
            prompt = prompt_of("The following are multiple choice questions")
            seen: list[int] = []
            result = await engine.generate(request(prompt, 12), seen.append)
            await engine.aclose()
            assert seen == result.output_ids == expected_tokens(prompt, 12)
            assert result.finish_reason == "length"
            assert result.prompt_tokens == len(prompt)
            assert engine.running == engine.waiting == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_cached_tokens_come_from_the_engine(kind: str) -> None:
    async def scenario() -> None:
        async with running() as fake:
            engine = http_engine(fake, kind)
            prompt = prompt_of("a shared prefix of some length, " * 4)
            first = await engine.generate(request(prompt))
            second = await engine.generate(request(prompt))
            await engine.aclose()
            assert first.cached_tokens == 0
            # vLLM's reuse: whole blocks below the last prompt token, floor(127 / 16) * 16
            assert second.cached_tokens == (len(prompt) - 1) // 16 * 16 == 112

    asyncio.run(scenario())


def test_two_requests_are_in_flight_at_once() -> None:
    async def scenario() -> None:
        async with running() as fake:
            fake.faults.barrier = 2  # the fake holds generation until two requests are running
            engine = http_engine(fake)
            in_flight: list[int] = []

            def note(_: int) -> None:
                in_flight.append(engine.running + engine.waiting)

            a, b = await asyncio.gather(
                engine.generate(request(prompt_of("first prompt"), 4, "a"), note),
                engine.generate(request(prompt_of("second prompt"), 4, "b"), note),
            )
            await engine.aclose()
            assert fake.peak_active == 2
            assert max(in_flight) == 2
            assert len(a.output_ids) == len(b.output_ids) == 4

    asyncio.run(scenario())


def test_cancelling_the_caller_closes_the_engine_stream(poll: Poll) -> None:
    async def scenario() -> None:
        async with running() as fake:
            fake.faults.token_delay_s = 0.02
            engine = http_engine(fake)
            seen: list[int] = []
            work = engine.generate(request(prompt_of("long"), 500), seen.append)
            task = asyncio.create_task(work)
            await poll.until_async(lambda: len(seen) >= 3, "the first tokens", LIMIT_S)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert engine.running == engine.waiting == 0
            await poll.until_async(lambda: fake.active == 0, "the fake to stop generating", LIMIT_S)
            assert fake.disconnects == 1
            await engine.aclose()
        assert len(seen) < 500

    asyncio.run(scenario())


def test_an_on_token_error_stops_the_request_and_is_raised() -> None:
    async def scenario() -> None:
        async with running() as fake:
            engine = http_engine(fake)

            def boom(_: int) -> None:
                raise KeyError("callback")

            with pytest.raises(KeyError):
                await engine.generate(request(prompt_of("x y z"), 50), boom)
            assert engine.running == engine.waiting == 0
            await engine.aclose()

    asyncio.run(scenario())


def test_an_engine_error_or_a_dead_engine_is_engine_unavailable() -> None:
    async def scenario() -> None:
        async with running() as fake:
            engine = http_engine(fake)
            fake.faults.fail_status = 503
            with pytest.raises(EngineUnavailable):
                await engine.generate(request(prompt_of("abc")))
            await fake.stop()
            with pytest.raises(EngineUnavailable):
                await engine.generate(request(prompt_of("abc")))
            assert engine.failed == 2 and engine.running == engine.waiting == 0
            await engine.aclose()

    asyncio.run(scenario())


def test_the_exact_index_equals_the_fake_engines_cache_after_evictions(poll: Poll) -> None:
    async def scenario() -> None:
        async with running(cache_tokens=512) as fake:
            engine = http_engine(fake)
            async with subscribed(poll, fake, engine) as sub:
                stem = prompt_of("shared system prompt; " * 6)
                for i in range(12):  # ~230-token prompts into a 512-token cache: it evicts
                    await engine.generate(request([*stem, *prompt_of(f"question {i} " * 9)], 8))
                await settled(poll, fake, sub)
                assert fake.cache.evicted_tokens > 0
                want = truth(fake, engine.fingerprint.digest)
                assert want and engine.cache_hashes() == want
                assert sub.counts["resets"] == sub.counts["malformed"] == 0
                # the view the node reads: the index's match, capped at len - 1, in whole
                # engine blocks (what vLLM reuses: floor((len - 1) / block) * block)
                probe = [*stem, *prompt_of("question 11 " * 9)]
                full_blocks = fake.cache.match(probe) // 16 * 16
                assert engine.match(probe) == min(full_blocks, len(probe) - 1) // 16 * 16 > 0
                delta = engine.drain_cache_delta()  # net since the start: just what is cached
                assert set(delta.added) == want and not set(delta.removed) & want
            await engine.aclose()

    asyncio.run(scenario())


def test_openai_kind_keeps_an_approximate_lru_view() -> None:
    async def scenario() -> None:
        async with running() as fake:
            engine = HttpEngine("openai", fake.url, ByteTokenizer(), model_name=fake.model,
                                cache_tokens=256)
            assert engine.describe()["cache_view"] == "approximate"
            prompt = prompt_of("approximately cached prefix " * 3)
            await engine.generate(request(prompt))
            assert engine.match(prompt) >= 64
            assert engine.drain_cache_delta().added
            for i in range(6):  # more than the 256-token budget: LRU evicts the first
                await engine.generate(request(prompt_of(f"{i} other text " * 8)))
            assert engine.usage().tokens <= 256
            assert engine.match(prompt) == 0
            await engine.aclose()

    asyncio.run(scenario())


def test_llamacpp_kind_predicts_the_slot_it_will_get() -> None:
    """One slot (``LlamaCppSlots``): the local match is the LCP with the slot's last tokens,
    token granular, not the LRU's best block match."""
    async def scenario() -> None:
        async with running() as fake:
            engine = HttpEngine("llamacpp", fake.url, ByteTokenizer(), model_name=fake.model,
                                cache_tokens=0)  # --cache-ram 0: the slot only
            assert engine.describe()["cache_view"] == "slots"
            first, second = prompt_of("a shared prefix, then " * 4), prompt_of("x" * 90)
            out = (await engine.generate(request(first, max_tokens=3))).output_ids
            assert engine.match([*first, *out, 0]) == len(first) + 2  # + decoded output
            await engine.generate(request(second, max_tokens=1))
            assert engine.match([*first, 1]) == 0  # the slot now holds the second prompt
            assert engine.match([*second[:50], 0]) == 50
            engine.forget_cache()
            assert engine.match(second) == 0
            await engine.aclose()

    asyncio.run(scenario())


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.close()


def test_a_connection_the_server_dropped_before_answering_is_tried_once_more() -> None:
    """llama-server and uvicorn close idle keep-alive connections; a request written to one
    never reached the engine, so it goes again on a fresh connection (once)."""
    async def scenario() -> None:
        async with running() as fake:
            host, port = fake.url.removeprefix("http://").rsplit(":", 1)
            accepted = 0

            async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
                nonlocal accepted
                accepted += 1
                if accepted == 1:  # the first connection: dropped unanswered
                    w.close()
                    return
                ur, uw = await asyncio.open_connection(host, int(port))
                await asyncio.gather(_pipe(r, uw), _pipe(ur, w))

            server = await asyncio.start_server(handle, "127.0.0.1", 0)
            proxy = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            engine = HttpEngine("llamacpp", proxy, ByteTokenizer(), model_name=fake.model)
            result = await engine.generate(request(prompt_of("dropped once"), max_tokens=2))
            assert len(result.output_ids) == 2 and accepted == 2 and engine.failed == 0
            await engine.aclose()
            server.close()

    asyncio.run(scenario())


def test_larger_engine_blocks_become_the_mesh_block_size() -> None:
    """vLLM's CPU build caches 128-token blocks: the mesh then hashes at 128 (every gossiped
    hash is a prefix the engine can reuse whole); sizes that do not fit keep the mesh's."""
    assert mesh_block_size(16, 128) == 128 and mesh_block_size(16, None) == 16
    assert mesh_block_size(16, 8) == 16 and mesh_block_size(16, 40) == 16
    engine = HttpEngine("vllm", "http://127.0.0.1:1", ByteTokenizer(), model_name="m",
                        engine_block_size=128)
    assert engine.fingerprint.block_size == engine.index.block_size == 128


def test_match_counts_whole_engine_blocks_below_the_last_prompt_token() -> None:
    """What vLLM reuses: floor((len - 1) / block) * block of the cached prefix (a real vLLM
    0.32 answered cached_tokens 256 for a 303-token prompt sharing 300 with a cached one)."""
    engine = HttpEngine("vllm", "http://127.0.0.1:1", ByteTokenizer(), model_name="m",
                        block_size=16)
    cached = list(range(1, 301))  # engine blocks of 128: two full ones, as vLLM stores them
    engine.index.apply(KvBatch(0.0, (EngineBlockStored((11, 12), None, tuple(cached[:256]),
                                                       128),)))
    assert engine.index.reuse_block_size == 128
    assert engine.match([*cached, 7, 8, 9]) == 256
    assert engine.match(cached[:200]) == 128  # a prefix ending inside block 2: only block 1
    assert engine.match(cached[:256]) == 128  # the last token is always computed
    assert engine.match(cached[:257]) == 256


def test_engine_kv_blocks_count_what_the_requests_ahead_evict_and_store() -> None:
    """``--engine-kv-blocks``: 3 usable blocks (4 less vLLM's null block), 2 cached; a request
    sent ahead needs 3 fresh ones, so vLLM evicts both before scheduling the next one (its
    queue: core/free_queue.py); once it finished, its own prompt is cached for the next."""
    def engine(kv_blocks: int) -> HttpEngine:
        e = HttpEngine("vllm", "http://127.0.0.1:1", ByteTokenizer(), model_name="m",
                       block_size=16, engine_block_size=16, kv_blocks=kv_blocks)
        e.index.apply(KvBatch(0.0, (EngineBlockStored((1, 2), None, tuple(cached), 16),)))
        return e

    cached, other = list(range(1, 33)), list(range(100, 141))
    plain, aware = engine(0), engine(4)
    assert plain.queue is None and aware.queue is not None
    assert plain.match([*cached, 9]) == aware.match([*cached, 9]) == 32
    aware.queue.sent("r1", aware._held(other, None))
    assert aware.match([*cached, 9]) == 0 and plain.match([*cached, 9]) == 32
    assert aware.match([*other, 9]) == 32  # it stores its first two blocks before
    aware.queue.finished("r1")
    assert aware.match([*cached, 9]) == 32


def test_with_engine_kv_blocks_requests_enter_and_leave_the_queue() -> None:
    """Each request joins the shell's queue estimate when sent, runs from its first token
    and leaves it at its end, its prompt's and output's full blocks released."""
    async def scenario() -> None:
        async with running() as fake:
            fake.faults.barrier = 2
            engine = HttpEngine("vllm", fake.url, ByteTokenizer(), model_name=fake.model,
                                block_size=16, engine_block_size=16, kv_blocks=64)
            assert engine.queue is not None
            seen: list[tuple[int, int]] = []

            def note(_: int) -> None:
                assert engine.queue is not None
                seen.append((len(engine.queue), len(engine.queue._running)))

            await asyncio.gather(
                engine.generate(request(prompt_of("first prompt " * 4), 20, "a"), note),
                engine.generate(request(prompt_of("second prompt " * 4), 20, "b"), note))
            await engine.aclose()
            assert (2, 2) in seen and len(engine.queue) == 0
            assert len(engine.queue.order) >= 2 * 4  # 48 + 19 tokens: 4 full blocks each

    asyncio.run(scenario())
