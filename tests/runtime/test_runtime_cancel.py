"""A client that goes away stops its request — non-streaming too, local and forwarded alike;
a full node answers 429 with Retry-After instead of queueing without bound.

Real HTTP on 127.0.0.1 (uvicorn in this process), a micro engine whose tokens each take
50 ms, so a 150-token request would run ~7.5 s: the client gives up after 0.5 s and the
engine work must stop (the core's ``RequestCancelled`` → ``Abort``), not run to the end.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

import aiohttp

from radixmesh.engine.testing import SlowTokens
from radixmesh.runtime.inprocess import serving_node
from radixmesh.runtime.node import NodeService

if TYPE_CHECKING:
    from conftest import Poll

TOKEN_S = 0.05
MAX_TOKENS = 150


def _serving(engine: Any, name: str, **overrides: Any
             ) -> contextlib.AbstractAsyncContextManager[tuple[NodeService, str]]:
    return serving_node(SlowTokens(engine, TOKEN_S), name, **overrides)


async def _give_up(address: str, headers: dict[str, str]) -> None:
    body = {"model": "micro", "prompt": "cancel me " * 4, "max_tokens": MAX_TOKENS,
            "temperature": 0}
    async with aiohttp.ClientSession() as http:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(
                http.post(f"http://{address}/v1/completions", json=body, headers=headers), 0.5
            )
            raise AssertionError("the request answered before the client gave up")


def test_a_non_streaming_client_that_goes_away_cancels_its_local_request(
    engine: Any, poll: Poll
) -> None:
    async def scenario() -> None:
        async with _serving(engine, "solo") as (node, address):
            await _give_up(address, {})
            await poll.until_async(lambda: node.queue_depth == 0, "node.queue_depth == 0")
            assert node.metrics.cancelled == 1
            assert node.metrics.client_disconnects == 1
            core = node.core.metrics()
            assert core["requests_cancelled"] == 1 and core["requests_in_flight"] == 0
            assert node.metrics.completion_tokens < MAX_TOKENS  # stopped midway

    asyncio.run(scenario())


def test_a_non_streaming_client_that_goes_away_cancels_the_forwarded_request(
    engine: Any, poll: Poll,
) -> None:
    async def scenario() -> None:
        async with _serving(engine, "peer") as (peer, peer_address), \
                _serving(engine, "entry") as (entry, entry_address):
            entry.core.peer_address = (  # type: ignore[method-assign]
                lambda p: peer_address if p == "peer" else None
            )
            await _give_up(entry_address, {"x-radixmesh-target": "peer"})
            await poll.until_async(lambda: peer.queue_depth == 0, "peer.queue_depth == 0")
            assert peer.metrics.served_for_peers == 1
            assert peer.metrics.cancelled == 1  # the peer's engine stopped too
            assert peer.metrics.completion_tokens < MAX_TOKENS
            assert entry.core.metrics()["requests_cancelled"] == 1
            assert entry.metrics.requests["forwarded"] == 1
            assert entry.queue_depth == 0  # nothing ran on the entry node

    asyncio.run(scenario())


def test_a_full_node_answers_429_with_retry_after(engine: Any, poll: Poll) -> None:
    async def scenario() -> None:
        async with _serving(engine, "full", max_queue_requests=1) as (node, address):
            body = {"model": "micro", "prompt": "fill me " * 4, "max_tokens": 20,
                    "temperature": 0}
            url = f"http://{address}/v1/completions"
            async with aiohttp.ClientSession() as http:
                first = asyncio.ensure_future(http.post(url, json=body))
                await poll.until_async(lambda: node.queue_depth == 1, "node.queue_depth == 1")
                async with http.post(url, json=body) as second:
                    assert second.status == 429
                    assert int(second.headers["retry-after"]) >= 1
                    error = (await second.json())["error"]
                    assert error["type"] == "rate_limit_error" and error["code"] == "overloaded"
                async with await first as ok:
                    assert ok.status == 200  # the admitted one is served as usual
            assert node.metrics.rejected == 1
            assert node.core.metrics()["requests_rejected"] == 1

    asyncio.run(scenario())


def test_forwards_in_a_row_reuse_one_keep_alive_connection(engine: Any) -> None:
    """A finished forward's connection goes back to the pool (keep-alive) whether or not the
    end of its body has arrived when the answer is complete: four forwards in a row, one
    TCP connection (``peer_connections_opened`` in /metrics)."""

    async def scenario() -> None:
        async with _serving(engine, "peer") as (peer, peer_address), \
                _serving(engine, "entry") as (entry, entry_address):
            entry.core.peer_address = (  # type: ignore[method-assign]
                lambda p: peer_address if p == "peer" else None
            )
            body = {"model": "micro", "prompt": "reuse me " * 4, "max_tokens": 2,
                    "temperature": 0}
            async with aiohttp.ClientSession() as http:
                for _ in range(4):
                    async with http.post(f"http://{entry_address}/v1/completions", json=body,
                                         headers={"x-radixmesh-target": "peer"}) as resp:
                        assert resp.status == 200, await resp.text()
                        assert resp.headers["x-radixmesh-served-by"] == "peer"
            assert peer.metrics.served_for_peers == 4
            assert entry.metrics.requests["forwarded"] == 4
            assert entry.peers.connections_opened == 1

    asyncio.run(scenario())
