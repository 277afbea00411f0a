"""The KV-event fault proxy (``chaos/kv_proxy.py``) between the fake engine's real publisher and
a node's subscriber: dropped, duplicated, reordered and stale batches and a restart of the
socket all end with the index exact, without an index drop; a burst beyond the replay buffer
drops it and it under-reports, never over-reports."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import pytest

from radixmesh.chaos.kv_proxy import KvProxy, ProxyFaults, ProxyLog, choose
from radixmesh.core.blocks import block_hashes
from radixmesh.emulate.fake import FakeEngine, running
from radixmesh.engine.base import GenerateRequest, SamplingParams
from radixmesh.engine.http_engine import HttpEngine
from radixmesh.engine.tokenizers import ByteTokenizer
from radixmesh.runtime.cluster import free_port
from radixmesh.runtime.kv_subscriber import Endpoint, KvSubscriber, plan_endpoints

if TYPE_CHECKING:
    from conftest import Poll

LIMIT_S = 10.0


def test_choose_follows_the_probabilities() -> None:
    rng = random.Random(1)
    faults = ProxyFaults(drop=0.1, duplicate=0.2, reorder=0.3, stale=0.1)
    got = Counter(choose(rng, faults) for _ in range(20_000))
    for name, p in (("drop", 0.1), ("duplicate", 0.2), ("reorder", 0.3), ("stale", 0.1),
                    ("pass", 0.3)):
        assert abs(got[name] / 20_000 - p) < 0.02, (name, got)


@pytest.mark.parametrize("bad", [{"drop": -0.1}, {"drop": 0.6, "stale": 0.6},
                                 {"stale_after": 0}, {"hold_s": 0.0}])
def test_impossible_faults_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ProxyFaults(**bad)  # type: ignore[arg-type]


def test_the_log_knows_when_the_newest_batch_was_not_forwarded() -> None:
    log = ProxyLog(received=[(1.0, 5), (2.0, 6)], forwarded=[(1.1, 5), (3.0, 7)])
    assert not log.hidden_at(1.5)
    assert log.hidden_at(2.5)  # 6 received, not forwarded: the node cannot know yet
    assert not log.hidden_at(3.5)


@contextlib.asynccontextmanager
async def setup(poll: Poll, replay_keep: int = 64
                ) -> AsyncIterator[tuple[FakeEngine, HttpEngine, KvSubscriber, KvProxy]]:
    async with running(replay_keep=replay_keep) as fake:
        engine = HttpEngine("vllm", fake.url, ByteTokenizer(), model_name=fake.model)
        pubs, replays = plan_endpoints(fake.kv_endpoint, fake.replay_endpoint, fake.url)
        proxy = KvProxy(pubs[0].address, free_port(), seed=7)
        proxy.start()
        sub = KvSubscriber(engine.index, [Endpoint(f"tcp://127.0.0.1:{proxy.port}", False)],
                           replays, replay_timeout_s=0.5)
        await sub.start()
        try:
            def handled() -> bool:  # past both slow joiners: a batch made it through
                if sub.counts["applied"]:
                    return True
                fake.clear_all()
                return False

            await poll.until_async(handled, "a batch through the proxy", LIMIT_S,
                                   interval=0.05)
            await settled(poll, fake, sub)
            sub.counts.update(dict.fromkeys(sub.counts, 0))
            yield fake, engine, sub, proxy
        finally:
            await sub.stop()
            proxy.close()
            await engine.aclose()


async def ask(engine: HttpEngine, text: str) -> None:
    await engine.generate(GenerateRequest("r", tuple(text.encode()),
                                          SamplingParams(max_tokens=4)))


def truth(fake: FakeEngine, engine: HttpEngine) -> frozenset[int]:
    seed = engine.fingerprint.digest
    return frozenset(block_hashes(p, 16, seed)[-1] for p in fake.block_prefixes())


async def settled(poll: Poll, fake: FakeEngine, sub: KvSubscriber,
                  proxy: KvProxy | None = None) -> None:
    what = "every batch"
    if proxy is not None:
        what += f" (proxy {proxy.log.actions[-6:]}, {proxy.log.forwarded[-3:]})"
    await poll.until_async(lambda: sub.publishers[0].tracker.next_seq == fake.seq,
                           f"{what}: {fake.seq}, {dict(sub.counts)}", LIMIT_S, interval=0.01)


async def flush(poll: Poll, fake: FakeEngine, engine: HttpEngine, sub: KvSubscriber,
                proxy: KvProxy) -> None:
    """ProxyFaults off, then clean batches until one got through (a loss at the end shows only at
    the next batch, and a burst or a reconnecting socket may still take the first)."""
    proxy.set_faults(ProxyFaults())
    for i in range(5):
        await ask(engine, f"a clean prompt {i} after the faults " * 2)
        with contextlib.suppress(AssertionError):
            await poll.until_async(lambda: sub.publishers[0].tracker.next_seq == fake.seq,
                                   "the clean batch", 1.0, interval=0.01)
            break
    await settled(poll, fake, sub, proxy)


def test_drops_duplicates_reorders_and_stale_copies_end_exact(poll: Poll) -> None:
    async def scenario() -> None:
        async with setup(poll) as (fake, engine, sub, proxy):
            proxy.set_faults(ProxyFaults(drop=0.15, duplicate=0.15, reorder=0.15, stale=0.15,
                                    hold_s=0.2))
            for i in range(30):
                await ask(engine, f"prompt {i % 7} shares a prefix with its group " * 3)
            await flush(poll, fake, engine, sub, proxy)
            done = proxy.log.counts()
            assert min(done["drop"], done["duplicate"], done["reorder"], done["stale"]) > 0
            assert sub.counts["gaps"] > 0 and sub.counts["duplicates"] > 0
            assert sub.counts["resets"] == 0, dict(sub.counts)  # no copy read as a restart
            assert engine.cache_hashes() == truth(fake, engine)

    asyncio.run(scenario())


def test_a_restart_of_the_socket_is_reconnected_and_replayed(poll: Poll) -> None:
    async def scenario() -> None:
        async with setup(poll) as (fake, engine, sub, proxy):
            await ask(engine, "before the socket restarts " * 3)
            proxy.restart(0.3)
            await poll.until_async(lambda: not sub.connected, "the socket lost", LIMIT_S)
            for i in range(3):  # published while the proxy's socket is down: lost live
                await ask(engine, f"while it is down {i} " * 4)
            await poll.until_async(lambda: sub.connected, "reconnected", LIMIT_S)
            await flush(poll, fake, engine, sub, proxy)
            assert proxy.log.counts()["restart_drop"] >= 1
            assert sub.counts["gaps"] >= 1 and sub.counts["resets"] == 0
            assert engine.cache_hashes() == truth(fake, engine)

    asyncio.run(scenario())


def test_a_burst_beyond_the_replay_buffer_under_reports(poll: Poll) -> None:
    async def scenario() -> None:
        async with setup(poll, replay_keep=2) as (fake, engine, sub, proxy):
            proxy.burst(4)
            for i in range(4):
                await ask(engine, f"lost for good {i} " * 4)
            await flush(poll, fake, engine, sub, proxy)
            assert sub.counts["resets"] == 1
            assert engine.cache_hashes() < truth(fake, engine)  # never more than the truth

    asyncio.run(scenario())
