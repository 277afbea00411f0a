"""Bounded admission by tokens in the running node: a node whose queue holds too many tokens
(prompt + max_tokens) forwards the request to a peer with room, or answers 429 when no node
has any; the tokens are released when the work ends.

Two real nodes on 127.0.0.1 (uvicorn in this process) gossiping every 0.1 s, on the ``micro``
engine slowed to 50 ms per token so a request stays queued long enough to look at.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from radixmesh.engine.testing import SlowTokens
from radixmesh.runtime.config import ServeConfig
from radixmesh.runtime.inprocess import free_port, serving
from radixmesh.runtime.node import NodeService

if TYPE_CHECKING:
    from conftest import Poll

TOKEN_S = 0.05
MAX_TOKENS = 30  # with its prompt: over the cap below once a second request queues
FILL_TOKENS = 80  # the requests that fill a node run 4 s (an idle node admits any size)
CAP = 100


@contextlib.asynccontextmanager
async def _mesh(engine: Any, poll: Poll) -> AsyncIterator[list[tuple[NodeService, str]]]:
    ports = [free_port(), free_port()]
    nodes: list[tuple[NodeService, str]] = []
    async with contextlib.AsyncExitStack() as stack:
        for i, port in enumerate(ports):
            other = ports[1 - i]
            cfg = ServeConfig(node_id=f"n{i}", port=port, gossip_interval=0.1,
                              peers=(f"127.0.0.1:{other}",), max_queue_tokens=CAP)
            service = NodeService(cfg, SlowTokens(engine, TOKEN_S))
            nodes.append((service, await stack.enter_async_context(serving(service, port))))
        await poll.until_async(lambda: all(set(n.peer_states().values()) == {"alive"}
                                           and n.peer_states() for n, _ in nodes),
                               "both nodes to see each other alive")
        yield nodes


def _body(text: str, max_tokens: int = MAX_TOKENS) -> dict[str, object]:
    return {"model": "micro", "prompt": text, "max_tokens": max_tokens, "temperature": 0}


def test_a_node_full_of_tokens_forwards_to_a_peer_with_room_then_answers_429(
    engine: Any, poll: Poll,
) -> None:
    async def scenario() -> None:
        async with _mesh(engine, poll) as [(n0, a0), (n1, a1)], aiohttp.ClientSession() as http:
            hop = {"x-radixmesh-hop": "1"}  # executed where it enters: fills that node
            first = asyncio.ensure_future(
                http.post(f"http://{a0}/v1/completions",
                          json=_body("fill n0 " * 6, FILL_TOKENS), headers=hop))
            await poll.until_async(lambda: n0.queue_depth == 1, "n0.queue_depth == 1")
            assert n0.queue_output_tokens == FILL_TOKENS and n0.queue_prompt_tokens > 0
            assert 0 < n0.queue_uncached_tokens <= n0.queue_prompt_tokens  # a cold prompt
            # ... whose blocks n0 advertises while it is queued (QueueChanged), its engine
            # not holding them yet, and n1 hears of them with the next gossip round
            queued = n0.core.local_hashes() - n0.core.cached_hashes()
            assert queued
            await poll.until_async(lambda: queued <= n1.core.estimate("n0"),
                                   "n1 to estimate n0's queued blocks")
            state = n0.mesh()["runtime"]["admission"]  # type: ignore[index]
            assert state["max_queue_tokens"] == CAP and not state["max_queue_tokens_derived"]

            # n0 holds ~130 tokens: over the cap with any other request; n1 has room.
            async with http.post(f"http://{a0}/v1/completions", json=_body("to n1 " * 6)) as r:
                assert r.status == 200
                assert r.headers["x-radixmesh-served-by"] == "n1"
            assert n0.core.metrics()["admission_full_tokens"] >= 1

            second = asyncio.ensure_future(  # now n1 is busy too
                http.post(f"http://{a1}/v1/completions",
                          json=_body("fill n1 " * 6, FILL_TOKENS), headers=hop))
            await poll.until_async(lambda: n1.queue_depth == 1, "n1.queue_depth == 1")
            async with http.post(f"http://{a0}/v1/completions", json=_body("nobody " * 6)) as r:
                assert r.status == 429
                assert int(r.headers["retry-after"]) >= 1
                error = (await r.json())["error"]
                assert error["type"] == "rate_limit_error" and error["code"] == "overloaded"
            assert n1.core.metrics()["forwards_refused_full"] >= 1
            for pending in (first, second):
                async with await pending as ok:
                    assert ok.status == 200
            await poll.until_async(lambda: n0.queue_depth == 0 and n1.queue_depth == 0,
                                   "both queues to empty")
            for node in (n0, n1):  # every token released, however the work ended
                assert node.queue_prompt_tokens == 0 and node.queue_output_tokens == 0
                assert node.queue_uncached_tokens == 0 and not len(node._queued_blocks)
                assert node.core.local_hashes() == node.core.cached_hashes()  # none queued
            assert n0.metrics.rejected == 1

    asyncio.run(scenario())


def test_max_queue_tokens_from_toml_and_flags() -> None:
    from radixmesh.runtime.config import config_from_mapping, config_to_argv

    assert ServeConfig().admission_config().max_queue_tokens == 0  # derived from speed
    assert config_from_mapping({"max-queue-tokens": 5000}).admission_config().max_queue_tokens \
        == 5000
    assert config_from_mapping({"max_queue_tokens": "off"}).max_queue_tokens is None
    assert config_from_mapping({"max_queue_tokens": "auto"}).max_queue_tokens == 0
    assert config_to_argv({"max_queue_tokens": None}) == ["--max-queue-tokens", "off"]
    for bad in ("-1", "many", True):
        with pytest.raises(ValueError):
            config_from_mapping({"max_queue_tokens": bad})
