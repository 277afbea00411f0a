"""What the emulated engine says about its cache is what its scheduler did: ``cached_tokens``
in each usage equals the prefix the scheduler reused (``Scheduler.cached_prefix`` just before
the request, vLLM's whole blocks below the last token), the prefix-cache counters in /metrics
sum them, and the KV events, decoded by the node's own subscriber into an ``EngineIndex``,
rebuild exactly the scheduler's cache — with concurrent requests, evictions and preemption."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from radixmesh.core.blocks import block_hashes
from radixmesh.emulate.fake import FakeEngine, running
from radixmesh.engine.base import GenerateRequest, SamplingParams
from radixmesh.engine.http_engine import HttpEngine
from radixmesh.engine.tokenizers import ByteTokenizer
from radixmesh.runtime.kv_subscriber import KvSubscriber, plan_endpoints

if TYPE_CHECKING:
    from conftest import Poll

LIMIT_S = 10.0


def request(prompt: list[int], max_tokens: int, rid: str = "r") -> GenerateRequest:
    return GenerateRequest(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens))


def random_prompt(rng: random.Random, stems: list[list[int]]) -> list[int]:
    stem = rng.choice(stems)
    return [*stem[:rng.randrange(1, len(stem) + 1)],
            *(rng.randrange(32, 127) for _ in range(rng.randrange(1, 40)))]


@contextlib.asynccontextmanager
async def subscribed(poll: Poll, fake: FakeEngine, engine: HttpEngine
                     ) -> AsyncIterator[KvSubscriber]:
    pubs, replays = plan_endpoints(fake.kv_endpoint, fake.replay_endpoint, fake.url)
    sub = KvSubscriber(engine.index, pubs, replays, replay_timeout_s=1.0)
    await sub.start()
    try:
        await poll.past_slow_joiner(fake, lambda: sub.counts["messages"] > 0,
                                    "the subscriber's first batch", LIMIT_S)
        yield sub
    finally:
        await sub.stop()


async def settled(poll: Poll, fake: FakeEngine, sub: KvSubscriber) -> None:
    await poll.until_async(lambda: sub.publishers[0].tracker.next_seq == fake.seq,
                           "every batch applied", LIMIT_S)


def test_cached_tokens_are_what_the_scheduler_reused() -> None:
    async def scenario() -> None:
        rng = random.Random(7)
        stems = [[rng.randrange(32, 127) for _ in range(150)] for _ in range(3)]
        async with running(cache_tokens=512) as fake:
            engine = HttpEngine("vllm", fake.url, ByteTokenizer(), model_name=fake.model)
            reported = 0
            for i in range(30):
                prompt = random_prompt(rng, stems)
                want = fake.loop.scheduler.cached_prefix(prompt)
                result = await engine.generate(request(prompt, rng.randrange(1, 12), str(i)))
                assert result.cached_tokens == want, i
                assert want % 16 == 0 and want <= len(prompt) - 1
                reported += want
            await engine.aclose()
            counters = fake.loop.counters
            assert reported > 0 and counters.prefix_hits == reported
            assert counters.prefix_queries == counters.prompt_tokens
            assert fake.cache.evicted_tokens > 0  # 30 prompts of up to ~190 tokens in 512

    asyncio.run(scenario())


def test_kv_events_rebuild_the_schedulers_cache_under_concurrency(poll: Poll) -> None:
    async def scenario() -> None:
        rng = random.Random(11)
        stems = [[rng.randrange(32, 127) for _ in range(120)] for _ in range(4)]
        # a 384-token pool, 6 requests of up to ~240 tokens at once: it evicts and preempts
        async with running(cache_tokens=384) as fake:
            engine = HttpEngine("vllm", fake.url, ByteTokenizer(), model_name=fake.model)
            async with subscribed(poll, fake, engine) as sub:
                for wave in range(5):
                    fake.faults.barrier = 6  # hold the engine until all six are in
                    await asyncio.gather(*(
                        engine.generate(request(random_prompt(rng, stems), rng.randrange(1, 80),
                                                f"{wave}.{i}"))
                        for i in range(6)))
                    await settled(poll, fake, sub)
                    seed = engine.fingerprint.digest
                    truth = frozenset(block_hashes(p, 16, seed)[-1]
                                      for p in fake.block_prefixes())
                    assert engine.cache_hashes() == truth, wave
                assert fake.cache.evicted_tokens > 0 and fake.loop.scheduler.preemptions > 0
                assert fake.events is not None and fake.events.unresolved == 0
                assert sub.counts["resets"] == sub.counts["malformed"] == 0
                # and the node's prediction is the engine's figure
                probe = random_prompt(rng, stems)
                want = fake.loop.scheduler.cached_prefix(probe)
                assert engine.match(probe) == want
                result = await engine.generate(request(probe, 2))
                assert result.cached_tokens == want
            await engine.aclose()

    asyncio.run(scenario())
