"""Two radixmesh nodes, each in front of its own fake vLLM engine, in this process on loopback:
what engine 1 caches (learnt from its KV events, gossiped) makes node 2 forward the prefix to
node 1; an engine killed mid-test loses no request (fallback, or a clear 5xx).

Its helpers (``node``, ``mesh_of_two``, ``complete``, ``subscribed``, ``view_blocks``) are the
ones every test of nodes in front of fake engines imports (``from test_external_mesh import``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
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
async def node(poll: Poll, fake: FakeEngine, name: str, port: int, peer_port: int | None,
               gossip_interval: float = 0.1, gossip_announce: float | None = 0.05,
               **options: Any) -> AsyncIterator[NodeService]:
    """A node in front of ``fake`` (``peer_port`` None: alone); ``options``: more ServeConfig
    fields (other tests' nodes)."""
    # policy "paper": forward to the deepest match; "cost" weighs measured speeds, and on a
    # loaded CI box it may rightly decide that running a ~300-token prompt locally is faster
    fields: dict[str, Any] = {"policy": "paper", **options}
    peers = () if peer_port is None else (f"127.0.0.1:{peer_port}",)
    cfg = ServeConfig(node_id=name, port=port, peers=peers,
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
                   headers: dict[str, str] | None = None, *, key: str | None = None,
                   **fields: Any) -> tuple[int, dict[str, str], Any]:
    """POST /v1/completions: (status, headers, body); ``key``: the client's API key (a bearer
    token under ``headers``); ``fields``: more of the request body (over max_tokens 8)."""
    body = {"model": "fake-model", "prompt": prompt, "max_tokens": 8, **fields}
    sent = {} if key is None else {"authorization": f"Bearer {key}"}
    async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                         headers={**sent, **(headers or {})}) as resp:
        return resp.status, dict(resp.headers), await resp.json(content_type=None)


Scenario = Callable[[aiohttp.ClientSession, NodeService, NodeService, int, int,
                     list[FakeEngine]], Awaitable[None]]


async def mesh_of_two(poll: Poll, scenario: Scenario,
                      fakes: tuple[dict[str, Any], dict[str, Any]] = ({}, {}),
                      per_node: tuple[dict[str, Any], dict[str, Any]] = ({}, {}),
                      **options: Any) -> None:
    """Two fake vLLM engines (4096 cache tokens; ``fakes``: more FakeEngine options for each),
    a node in front of each (``options`` for both, ``per_node`` for each), once each sees the
    other alive: ``scenario(http, n1, n2, p1, p2, engines)``; every engine in ``engines`` (a
    scenario may replace one) is stopped afterwards."""
    engines = [FakeEngine(cache_tokens=4096, **extra) for extra in fakes]
    for fake in engines:
        await fake.start()
    p1, p2 = free_port(), free_port()
    try:
        async with (node(poll, engines[0], "node-1", p1, p2, **options, **per_node[0]) as n1,
                    node(poll, engines[1], "node-2", p2, p1, **options, **per_node[1]) as n2,
                    aiohttp.ClientSession() as http):
            await poll.until_async(lambda: n1.peer_states() == {"node-2": "alive"}
                                   and n2.peer_states() == {"node-1": "alive"},
                                   "the mesh", LIMIT_S)
            await scenario(http, n1, n2, p1, p2, engines)
    finally:
        for fake in engines:
            await fake.stop()


async def subscribed(poll: Poll, service: NodeService, fake: FakeEngine) -> None:
    """Past ZMQ's slow joiner: harmless batches until the node's subscriber gets one."""
    sub = service.attachments[0]
    # and handled: a first batch may still be awaiting the replay of the gap before it
    await poll.past_slow_joiner(fake, lambda: sub.counts["messages"],
                                "the node's subscriber to get a batch", LIMIT_S,
                                tracker=sub.publishers[0].tracker)


def view_blocks(service: NodeService, peer: str) -> int:
    peers = service.mesh()["peers"]
    assert isinstance(peers, list)
    return next((int(p["view_blocks"]) for p in peers if p["node_id"] == peer), 0)


def test_a_prefix_cached_on_engine_1_is_served_by_node_1_and_a_dead_engine_loses_nothing(
    poll: Poll,
) -> None:
    async def scenario(http: aiohttp.ClientSession, n1: NodeService, n2: NodeService,
                       p1: int, p2: int, engines: list[FakeEngine]) -> None:
        await subscribed(poll, n1, engines[0])
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

        await engines[1].stop()  # engine 2 dies
        status, headers, body = await complete(
            http, p1, "a fresh prompt sent to node 2 on purpose",
            {"x-radixmesh-target": "node-2"})
        assert status == 200, body  # node 2 failed it: node 1 ran it itself
        assert headers["x-radixmesh-route"] == "fallback"
        assert headers["x-radixmesh-served-by"] == "node-1"

        status, _, body = await complete(http, p2, "another fresh prompt, node 2")
        assert status == 200 or (status >= 500 and "error" in body), (status, body)

    asyncio.run(mesh_of_two(poll, scenario))


def test_a_new_copy_is_announced_before_the_next_round(poll: Poll) -> None:
    """Rounds every 30 s: node 2 still hears of what engine 1 cached within seconds, because
    the cache change brings node 1's next round forward (--gossip-announce)."""
    async def scenario(http: aiohttp.ClientSession, n1: NodeService, n2: NodeService,
                       p1: int, p2: int, engines: list[FakeEngine]) -> None:
        await subscribed(poll, n1, engines[0])
        announced = n1.core.metrics()["gossip_rounds_announced"]
        status, headers, _ = await complete(http, p1, PREFIX + "Question 1?")
        assert status == 200 and headers["x-radixmesh-served-by"] == "node-1"
        await poll.until_async(lambda: len(n1.engine.cache_hashes()) >= 10,
                               "engine 1's events", LIMIT_S)
        # well before the next round (30 s): only an announcement gets it there
        await poll.until_async(lambda: view_blocks(n2, "node-1") >= 10,
                               "node 2's view of node 1", 5.0)
        assert n1.core.metrics()["gossip_rounds_announced"] > announced

    asyncio.run(mesh_of_two(poll, scenario, gossip_interval=30.0))
