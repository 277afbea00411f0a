"""Two radixmesh nodes, each in front of its own fake vLLM engine, in this process on loopback:
what engine 1 caches (learnt from its KV events, gossiped) makes node 2 forward the prefix to
node 1; an engine killed mid-test loses no request (fallback, or a clear 5xx)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import aiohttp
import uvicorn

from radixmesh.emulate.fake import FakeEngine
from radixmesh.engine.tokenizers import ByteTokenizer
from radixmesh.runtime.app import create_app, node_server
from radixmesh.runtime.cluster import free_port
from radixmesh.runtime.config import ServeConfig
from radixmesh.runtime.node import NodeService
from radixmesh.runtime.serve_cli import build_external_service

if TYPE_CHECKING:
    from conftest import Poll

LIMIT_S = 10.0
PREFIX = "You are a careful assistant. Answer the multiple choice question below. " * 4


@contextlib.asynccontextmanager
async def node(poll: Poll, fake: FakeEngine, name: str, port: int, peer_port: int,
               gossip_interval: float = 0.1, gossip_announce: float | None = 0.05,
               **options: Any) -> AsyncIterator[NodeService]:
    """A node in front of ``fake``; ``options``: more ServeConfig fields (other tests' nodes)."""
    # policy "paper": forward to the deepest match; "cost" weighs measured speeds, and on a
    # loaded CI box it may rightly decide that running a ~300-token prompt locally is faster
    fields: dict[str, Any] = {"policy": "paper", **options}
    cfg = ServeConfig(node_id=name, port=port, peers=(f"127.0.0.1:{peer_port}",),
                      gossip_interval=gossip_interval, gossip_announce=gossip_announce,
                      forward_timeout=2.0, engine="vllm",
                      engine_url=fake.url, kv_events=fake.kv_endpoint,
                      kv_replay=fake.replay_endpoint, model=fake.model, cache_tokens=4096,
                      **fields)
    service = build_external_service(cfg, tokenizer=ByteTokenizer())
    server = node_server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port,
                                        log_level="warning", lifespan="on"), service)
    task = asyncio.create_task(server.serve())
    await poll.until_async(lambda: server.started, f"{name} to start", LIMIT_S)
    try:
        yield service
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, LIMIT_S)


async def complete(http: aiohttp.ClientSession, port: int, prompt: str,
                   headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    body = {"model": "fake-model", "prompt": prompt, "max_tokens": 8}
    async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                         headers=headers or {}) as resp:
        return resp.status, dict(resp.headers), await resp.json(content_type=None)


async def subscribed(poll: Poll, service: NodeService, fake: FakeEngine) -> None:
    """Past ZMQ's slow joiner: harmless batches until the node's subscriber gets one."""
    sub = service.attachments[0]

    def got_a_batch() -> bool:
        if sub.counts["messages"]:
            return True
        fake.clear_all()  # another harmless batch for the next check
        return False

    await poll.until_async(got_a_batch, "the node's subscriber to get a batch", LIMIT_S,
                           interval=0.02)
    # and handled: a first batch may still be awaiting the replay of the gap before it
    tracker = sub.publishers[0].tracker
    await poll.until_async(lambda: tracker.next_seq == fake.seq,
                           "the node's subscriber to catch up", LIMIT_S)


def view_blocks(service: NodeService, peer: str) -> int:
    peers = service.mesh()["peers"]
    assert isinstance(peers, list)
    return next((int(p["view_blocks"]) for p in peers if p["node_id"] == peer), 0)


def test_a_prefix_cached_on_engine_1_is_served_by_node_1_and_a_dead_engine_loses_nothing(
    poll: Poll,
) -> None:
    async def scenario() -> None:
        fake1, fake2 = FakeEngine(cache_tokens=4096), FakeEngine(cache_tokens=4096)
        await fake1.start()
        await fake2.start()
        p1, p2 = free_port(), free_port()
        try:
            async with (node(poll, fake1, "node-1", p1, p2) as n1,
                        node(poll, fake2, "node-2", p2, p1) as n2,
                        aiohttp.ClientSession() as http):
                await poll.until_async(lambda: n1.peer_states() == {"node-2": "alive"}
                                       and n2.peer_states() == {"node-1": "alive"},
                                       "the mesh", LIMIT_S)
                await subscribed(poll, n1, fake1)
                status, headers, _ = await complete(http, p1, PREFIX + "Question 1?")
                assert status == 200 and headers["x-radixmesh-served-by"] == "node-1"
                await poll.until_async(lambda: len(n1.engine.cache_hashes()) >= 10,
                                       "engine 1's events", LIMIT_S)
                await poll.until_async(lambda: view_blocks(n2, "node-1") >= 10,
                                       "node 2's view of node 1", LIMIT_S)

                status, headers, body = await complete(http, p2, PREFIX + "Question 2?")
                assert status == 200, body
                assert headers["x-radixmesh-route"] == "forwarded"
                assert headers["x-radixmesh-served-by"] == "node-1"
                assert int(headers["x-radixmesh-cached-tokens"]) > 0
                assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                mesh = n1.mesh()
                assert mesh["kv_events"]["connected"] is True  # type: ignore[index]
                assert mesh["engine"]["cache_view"] == "exact"  # type: ignore[index]
                assert "kv_events_applied" in n1.prometheus()

                await fake2.stop()  # engine 2 dies
                status, headers, body = await complete(
                    http, p1, "a fresh prompt sent to node 2 on purpose",
                    {"x-radixmesh-target": "node-2"})
                assert status == 200, body  # node 2 failed it: node 1 ran it itself
                assert headers["x-radixmesh-route"] == "fallback"
                assert headers["x-radixmesh-served-by"] == "node-1"

                status, _, body = await complete(http, p2, "another fresh prompt, node 2")
                assert status == 200 or (status >= 500 and "error" in body), (status, body)
        finally:
            await fake1.stop()
            await fake2.stop()

    asyncio.run(scenario())


def test_a_new_copy_is_announced_before_the_next_round(poll: Poll) -> None:
    """Rounds every 30 s: node 2 still hears of what engine 1 cached within seconds, because
    the cache change brings node 1's next round forward (--gossip-announce)."""
    async def scenario() -> None:
        fake1, fake2 = FakeEngine(cache_tokens=4096), FakeEngine(cache_tokens=4096)
        await fake1.start()
        await fake2.start()
        p1, p2 = free_port(), free_port()
        slow = {"gossip_interval": 30.0}
        try:
            async with (node(poll, fake1, "node-1", p1, p2, **slow) as n1,
                        node(poll, fake2, "node-2", p2, p1, **slow) as n2,
                        aiohttp.ClientSession() as http):
                await poll.until_async(lambda: n1.peer_states() == {"node-2": "alive"}
                                       and n2.peer_states() == {"node-1": "alive"},
                                       "the mesh", LIMIT_S)
                await subscribed(poll, n1, fake1)
                announced = n1.core.metrics()["gossip_rounds_announced"]
                status, headers, _ = await complete(http, p1, PREFIX + "Question 1?")
                assert status == 200 and headers["x-radixmesh-served-by"] == "node-1"
                await poll.until_async(lambda: len(n1.engine.cache_hashes()) >= 10,
                                       "engine 1's events", LIMIT_S)
                # well before the next round (30 s): only an announcement gets it there
                await poll.until_async(lambda: view_blocks(n2, "node-1") >= 10,
                                       "node 2's view of node 1", 5.0)
                assert n1.core.metrics()["gossip_rounds_announced"] > announced
        finally:
            await fake1.stop()
            await fake2.stop()

    asyncio.run(scenario())
