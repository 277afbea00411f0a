"""The KV-event subscriber against the fake engine's real ZMQ publisher and replay socket:
a gap is replayed, a duplicate dropped, a restart drops the index and rebuilds it, a malformed
batch is counted and drops the index, a dead replay socket is survived; which side binds."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import pytest

from radixmesh.core.blocks import block_hashes
from radixmesh.emulate.fake import FakeEngine, running
from radixmesh.engine.base import GenerateRequest, SamplingParams
from radixmesh.engine.http_engine import HttpEngine
from radixmesh.engine.tokenizers import ByteTokenizer
from radixmesh.runtime.cluster import free_port
from radixmesh.runtime.kv_subscriber import (
    Endpoint,
    KvSubscriber,
    plan_endpoints,
    resolve_endpoint,
)

if TYPE_CHECKING:
    from conftest import Poll

LIMIT_S = 10.0


@contextlib.asynccontextmanager
async def setup(
    poll: Poll, **fake_kwargs: object
) -> AsyncIterator[tuple[FakeEngine, HttpEngine, KvSubscriber]]:
    async with running(**fake_kwargs) as fake:  # type: ignore[arg-type]
        engine = HttpEngine("vllm", fake.url, ByteTokenizer(), model_name=fake.model)
        pubs, replays = plan_endpoints(fake.kv_endpoint, fake.replay_endpoint, fake.url)
        if fake.kv_connect:
            pubs = [Endpoint(fake.kv_connect, bind=True)]
        changes: list[int] = []
        sub = KvSubscriber(engine.index, pubs, replays, replay_timeout_s=0.5,
                           on_change=lambda: changes.append(1))
        await sub.start()
        try:
            # past the slow joiner: wait for a batch to be *handled* (on_change fires after
            # it, and after any replay it triggers), not merely received; waiting on
            # counts["messages"] raced a first batch still awaiting its gap's replay
            await poll.past_slow_joiner(fake, lambda: changes, "a batch handled (on_change)",
                                        LIMIT_S)
            assert sub.counts["messages"] > 0
            await settled(poll, fake, sub)
            sub.counts.update(dict.fromkeys(sub.counts, 0))  # count from here (warm-up gap)
            yield fake, engine, sub
        finally:
            await sub.stop()
            await engine.aclose()


async def ask(engine: HttpEngine, text: str, max_tokens: int = 8) -> None:
    await engine.generate(GenerateRequest("r", tuple(text.encode()),
                                          SamplingParams(max_tokens=max_tokens)))


def truth(fake: FakeEngine, engine: HttpEngine) -> frozenset[int]:
    seed = engine.fingerprint.digest
    return frozenset(block_hashes(p, 16, seed)[-1] for p in fake.block_prefixes())


async def settled(poll: Poll, fake: FakeEngine, sub: KvSubscriber) -> None:
    # polled every loop iteration (interval 0): the test then stops the subscriber in the very
    # iteration the last replayed batch lands, the race that once hung ``stop`` (a cancel
    # lost in wait_for while the replay's end marker arrived)
    await poll.until_async(lambda: sub.publishers[0].tracker.next_seq == fake.seq,
                           "every batch", LIMIT_S, interval=0.0)


@pytest.mark.parametrize("replay_topic", [True, False], ids=["vllm-0.32-framing", "older"])
def test_a_gap_is_filled_from_the_replay_socket(replay_topic: bool, poll: Poll) -> None:
    async def scenario() -> None:
        async with setup(poll) as (fake, engine, sub):
            fake.faults.replay_topic = replay_topic
            await ask(engine, "the first prompt, long enough for blocks " * 2)
            fake.faults.skip_live = 1  # the next batch is lost on the PUB stream (kept for replay)
            await ask(engine, "the second prompt, also long enough " * 2)
            await ask(engine, "a third prompt reveals the gap " * 2)
            await settled(poll, fake, sub)
            assert sub.counts["gaps"] == sub.counts["replays"] == 1
            assert sub.counts["replay_failures"] == sub.counts["resets"] == 0
            assert engine.cache_hashes() == truth(fake, engine)

    asyncio.run(scenario())


def test_a_gap_the_replay_cannot_cover_drops_the_index_and_under_reports(poll: Poll) -> None:
    async def scenario() -> None:
        async with setup(poll) as (fake, engine, sub):
            await ask(engine, "the first prompt, long enough for blocks " * 2)
            fake.faults.skip_live, fake.faults.skip_replay = 1, True  # lost for good
            await ask(engine, "the second prompt, also long enough " * 2)
            await ask(engine, "a third prompt reveals the gap " * 2)
            await settled(poll, fake, sub)
            assert sub.counts["resets"] == 1 and engine.index.counters()["drops"] == 1
            assert engine.cache_hashes() < truth(fake, engine)  # never more than the truth

    asyncio.run(scenario())


def test_a_live_batch_the_replay_already_delivered_is_a_duplicate_not_a_restart(
    poll: Poll,
) -> None:
    """A replay answers up to the newest batch; the live copy of a batch published while the
    gap was being filled arrives after the replay and must not read as a restart."""
    async def scenario() -> None:
        async with setup(poll) as (fake, _, sub):
            assert fake.events is not None
            fake.faults.skip_live = 1
            fake.events.publish_cleared()  # seq k: lost live, kept for replay
            fake.events.publish_cleared()  # k + 1: reveals the gap
            fake.events.publish_cleared()  # k + 2: queued live behind k + 1, also replayed
            await settled(poll, fake, sub)
            assert sub.counts["gaps"] == sub.counts["replays"] == 1, dict(sub.counts)
            # k + 1 held during the replay and k + 2 live: both already replayed
            assert sub.counts["duplicates"] == 2 and sub.counts["resets"] == 0, dict(sub.counts)

    asyncio.run(scenario())


def test_a_duplicate_is_dropped(poll: Poll) -> None:
    async def scenario() -> None:
        async with setup(poll) as (fake, engine, sub):
            fake.faults.duplicate_next = 2
            await ask(engine, "a prompt whose batch arrives twice " * 2)
            await ask(engine, "and another one " * 4)
            await settled(poll, fake, sub)
            assert sub.counts["duplicates"] >= 1
            assert sub.counts["resets"] == sub.counts["gaps"] == 0
            assert engine.cache_hashes() == truth(fake, engine)

    asyncio.run(scenario())


def test_an_engine_restart_drops_the_index_and_rebuilds_it_fresh(poll: Poll) -> None:
    async def scenario() -> None:
        async with setup(poll) as (fake, engine, sub):
            await ask(engine, "before the restart, a cached prefix " * 2)
            await settled(poll, fake, sub)
            before = engine.cache_hashes()
            assert before
            engine.drain_cache_delta()
            fake.restart()  # seq back to 0, empty cache, no event
            await ask(engine, "after the restart, another prefix " * 2)
            await settled(poll, fake, sub)
            assert sub.counts["resets"] == 1
            assert engine.cache_hashes() == truth(fake, engine)
            assert not engine.cache_hashes() & before
            delta = engine.drain_cache_delta()  # the fresh summary the node gossips
            assert set(delta.removed) == before and set(delta.added) == truth(fake, engine)

    asyncio.run(scenario())


def test_a_malformed_batch_is_counted_and_drops_the_index_without_a_crash(poll: Poll) -> None:
    async def scenario() -> None:
        async with setup(poll) as (fake, engine, sub):
            await ask(engine, "a prompt cached before the bad batch " * 2)
            await settled(poll, fake, sub)
            assert len(engine.index) > 0
            fake.publish_malformed()
            await settled(poll, fake, sub)
            assert sub.counts["malformed"] == 1 and len(engine.index) == 0
            await ask(engine, "the index refills from later batches " * 2)
            await settled(poll, fake, sub)
            assert len(engine.index) > 0 and engine.cache_hashes() <= truth(fake, engine)
            assert sub.counts["socket_errors"] == 0

    asyncio.run(scenario())


def test_a_replay_socket_that_never_answers_is_survived(poll: Poll) -> None:
    async def scenario() -> None:
        async with setup(poll) as (fake, engine, sub):
            await ask(engine, "the first prompt, long enough for blocks " * 2)
            fake.faults.replay_enabled = False
            fake.faults.skip_live = 1
            await ask(engine, "the second prompt, also long enough " * 2)
            await ask(engine, "a third prompt reveals the gap " * 2)
            await settled(poll, fake, sub)
            assert sub.counts["replay_failures"] == 1 and sub.counts["resets"] == 1
            assert engine.cache_hashes() <= truth(fake, engine)
            state = sub.mesh_state()
            assert state["connected"] is True and state["stale_since"] is None

    asyncio.run(scenario())


def test_the_subscriber_binds_when_the_engine_connects(poll: Poll) -> None:
    async def scenario() -> None:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        assert resolve_endpoint(endpoint, "127.0.0.1") == Endpoint(endpoint, bind=True)
        async with setup(poll, kv_connect=endpoint) as (fake, engine, sub):
            await ask(engine, "events over a connecting publisher " * 2)
            await settled(poll, fake, sub)
            assert engine.cache_hashes() == truth(fake, engine)
            assert sub.metrics()["kv_events_connected"] == 1.0

    asyncio.run(scenario())


@pytest.mark.parametrize(("text", "host", "want"), [
    ("tcp://*:5557", "10.0.0.7", Endpoint("tcp://10.0.0.7:5557", bind=False)),
    ("tcp://[::]:5557", "fe80::1", Endpoint("tcp://[fe80::1]:5557", bind=False)),
    ("ipc:///tmp/kv", "h", Endpoint("ipc:///tmp/kv", bind=False)),
    ("tcp://10.0.0.9:5557", "h", Endpoint("tcp://10.0.0.9:5557", bind=True)),
    ("connect:tcp://e:5557", "h", Endpoint("tcp://e:5557", bind=False)),
    ("bind:tcp://*:5557", "h", Endpoint("tcp://*:5557", bind=True)),
])
def test_which_side_binds_follows_the_engines_rule(text: str, host: str, want: Endpoint) -> None:
    assert resolve_endpoint(text, host) == want


def test_one_replay_endpoint_serves_every_dp_rank_on_port_plus_rank() -> None:
    pubs, replays = plan_endpoints("tcp://*:5557,tcp://*:5558", "tcp://*:6000",
                                   "http://engine:8000")
    assert [p.address for p in pubs] == ["tcp://engine:5557", "tcp://engine:5558"]
    assert replays == ["tcp://engine:6000", "tcp://engine:6001"]
