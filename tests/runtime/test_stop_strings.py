"""A matched stop string ends decoding: the engine stops, local or forwarded, streaming or not.

Real HTTP on 127.0.0.1 (uvicorn in this process). The engine is a scripted stand-in over the
micro preset (its cache view and byte tokenizer): it generates ``TEXT`` one byte token at a
time, ``TOKEN_S`` each, through the real engine thread (``ThreadedEngine``), so a stop is the
real cancellation contract (the next token raises ``RequestStopped``). With ``max_tokens`` 300 a
request that is not stopped generates 300 tokens; stopped at the ``$`` it generates 17 plus the
few already under way — the counts, never the time, are what is checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from radixmesh.core.forward_codec import encode_reply
from radixmesh.core.messages import ForwardAdmitted, ForwardTokens
from radixmesh.engine.base import SamplingParams
from radixmesh.engine.testing import ScriptedEngine
from radixmesh.runtime.app import _pieces
from radixmesh.runtime.config import ServeConfig
from radixmesh.runtime.inprocess import serving_node
from radixmesh.runtime.node import NodeService
from radixmesh.runtime.openai_api import Detokenizer

if TYPE_CHECKING:
    from conftest import Poll

TOKEN_S = 0.01
MAX_TOKENS = 300
HEAD = "The answer is 42$"  # the stop string "$" completes at token 17
TEXT = HEAD + " and then some more words" * 20
STOPPED_AT = len(HEAD)
FAR_BELOW = MAX_TOKENS // 3  # what the engine may have generated once stopped


@contextlib.asynccontextmanager
async def _serving(
    engine: Any, name: str
) -> AsyncIterator[tuple[NodeService, ScriptedEngine, str]]:
    """A node named ``name`` whose engine is the stand-in: ``TEXT``, ``TOKEN_S`` apart."""
    scripted = ScriptedEngine(engine, TEXT, TOKEN_S)
    async with serving_node(scripted, name) as (service, address):
        yield service, scripted, address


@contextlib.asynccontextmanager
async def _pair(engine: Any) -> AsyncIterator[tuple[NodeService, NodeService, ScriptedEngine, str]]:
    """An entry node whose requests go to ``peer`` (x-radixmesh-target)."""
    async with _serving(engine, "peer") as (peer, peer_engine, peer_address), \
            _serving(engine, "entry") as (entry, _, entry_address):
        entry.core.peer_address = (  # type: ignore[method-assign]
            lambda peer_id: peer_address if peer_id == "peer" else None
        )
        yield entry, peer, peer_engine, entry_address


BODY = {"model": "micro", "prompt": "Say it.", "max_tokens": MAX_TOKENS, "stop": ["$"]}


async def _post(address: str, body: dict[str, Any], headers: dict[str, str] | None = None
                ) -> tuple[str, str, dict[str, Any]]:
    """(text, finish_reason, usage) of a completion, streamed or not."""
    async with aiohttp.ClientSession() as http, \
            http.post(f"http://{address}/v1/completions", json=body,
                      headers=headers or {}) as resp:
        assert resp.status == 200, await resp.text()
        if not body.get("stream"):
            doc = await resp.json()
            return doc["choices"][0]["text"], doc["choices"][0]["finish_reason"], doc["usage"]
        events = [json.loads(line[6:]) for line in (await resp.text()).splitlines()
                  if line.startswith("data: {")]
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]
    return text, finish, events[-1]["usage"]


def _assert_stopped_early(text: str, finish: str, usage: dict[str, Any]) -> None:
    assert (text, finish) == ("The answer is 42", "stop")
    assert usage["completion_tokens"] == STOPPED_AT  # up to the token that completed "$"


def _assert_done_not_cancelled(node: NodeService) -> None:
    core = node.core.metrics()
    assert core["requests_in_flight"] == 0
    assert core["requests_cancelled"] == 0 and core["requests_failed"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_stops_the_local_engine(engine: Any, stream: bool, poll: Poll) -> None:
    async def scenario() -> None:
        async with _serving(engine, "solo") as (node, scripted, address):
            body = {**BODY, "stream": stream,
                    **({"stream_options": {"include_usage": True}} if stream else {})}
            _assert_stopped_early(*await _post(address, body))
            await poll.until_async(lambda: node.queue_depth == 0, "node.queue_depth == 0")
            assert STOPPED_AT <= scripted.generated < FAR_BELOW  # the engine stopped
            assert STOPPED_AT <= node.metrics.completion_tokens < FAR_BELOW
            assert node.metrics.cancelled == 0  # a stop is not a cancellation
            _assert_done_not_cancelled(node)
            assert node.metrics.requests["local"] == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_stops_the_peer_engine_of_a_forwarded_request(
    engine: Any, stream: bool, poll: Poll
) -> None:
    async def scenario() -> None:
        async with _pair(engine) as (entry, peer, peer_engine, address):
            body = {**BODY, "stream": stream,
                    **({"stream_options": {"include_usage": True}} if stream else {})}
            _assert_stopped_early(*await _post(address, body, {"x-radixmesh-target": "peer"}))
            await poll.until_async(lambda: peer.queue_depth == 0, "peer.queue_depth == 0")
            assert entry.metrics.requests["forwarded"] == 1
            assert peer.metrics.served_for_peers == 1
            assert STOPPED_AT <= peer_engine.generated < FAR_BELOW  # the peer's engine stopped
            assert STOPPED_AT <= peer.metrics.completion_tokens < FAR_BELOW
            _assert_done_not_cancelled(entry)
            assert entry.queue_depth == 0 and entry.metrics.completion_tokens == 0

    asyncio.run(scenario())


def test_without_a_match_the_answer_runs_to_max_tokens(engine: Any) -> None:
    """The control: the same request with a stop string that never appears is not cut."""
    async def scenario() -> None:
        async with _serving(engine, "solo") as (node, scripted, address):
            body = {**BODY, "max_tokens": 40, "stop": ["#"]}
            text, finish, usage = await _post(address, body)
            assert (text, finish, usage["completion_tokens"]) == (TEXT[:40], "length", 40)
            assert scripted.generated == 40 and node.metrics.completion_tokens == 40
            _assert_done_not_cancelled(node)

    asyncio.run(scenario())


def test_a_stop_ends_a_node_service_execution_as_done(engine: Any, poll: Poll) -> None:
    """Without HTTP: ``Execution.stop`` then closing ``tokens()`` is a normal end for the core
    (RequestDone), and the engine task is cancelled."""
    async def scenario() -> None:
        scripted = ScriptedEngine(engine, TEXT, TOKEN_S)
        node = NodeService(ServeConfig(node_id="bare", port=18998, gossip_interval=5.0),
                           scripted)
        await node.start()
        try:
            ex = await node.execute(list(b"Say it."), SamplingParams(max_tokens=MAX_TOKENS),
                                    True)
            seen: list[int] = []
            async with contextlib.aclosing(ex.tokens()) as tokens:
                async for tok in tokens:
                    seen.append(tok)
                    if len(seen) == 5:
                        ex.stop(seen)
                        break
            assert ex.outcome is not None
            assert (ex.outcome.output_ids, ex.outcome.finish_reason) == (seen, "stop")
            await poll.until_async(lambda: node.queue_depth == 0, "node.queue_depth == 0")
            assert 5 <= scripted.generated < FAR_BELOW
            _assert_done_not_cancelled(node)
            assert node.metrics.cancelled == 0
        finally:
            await node.stop()

    asyncio.run(scenario())


def test_a_stop_after_a_peer_died_midstream_stops_the_local_continuation(
    engine: Any, poll: Poll
) -> None:
    """The peer sends two tokens and dies; the answer goes on here (the core's fallback) and
    the stop string, matched on all the tokens, ends the local continuation as done."""
    async def dies(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")  # a POST per forward (the fake knows no links)
        head = (b"HTTP/1.1 200 OK\r\ncontent-type: application/x-radixmesh-forward\r\n"
                b"transfer-encoding: chunked\r\n\r\n")
        frames = [encode_reply(ForwardAdmitted("fake", 0)), encode_reply(ForwardTokens((65, 66)))]
        writer.write(head + b"".join(f"{len(f):x}\r\n".encode() + f + b"\r\n" for f in frames))
        await writer.drain()
        writer.transport.abort()

    async def scenario() -> None:
        server = await asyncio.start_server(dies, "127.0.0.1", 0)
        address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        scripted = ScriptedEngine(engine, TEXT, TOKEN_S)
        node = NodeService(ServeConfig(node_id="entry", port=18997, gossip_interval=5.0,
                                       forward_timeout=2.0, peer_transport="http"), scripted)
        node.core.peer_address = (  # type: ignore[method-assign]
            lambda peer_id: address if peer_id == "fake" else None
        )
        await node.start()
        try:
            ex = await node.execute(list(b"Say it."), SamplingParams(max_tokens=MAX_TOKENS),
                                    True, target="fake")
            det = Detokenizer(node.engine.tokenizer.decode, ["$"])
            text = "".join([piece async for piece in _pieces(ex, det)])
            assert text == "AB" + HEAD[:-1]
            assert ex.outcome is not None and ex.outcome.finish_reason == "stop"
            assert len(ex.outcome.output_ids) == 2 + STOPPED_AT
            await poll.until_async(lambda: node.queue_depth == 0, "node.queue_depth == 0")
            assert node.metrics.forward_failures["disconnected"] == 1
            assert STOPPED_AT <= scripted.generated < FAR_BELOW  # the continuation stopped
            _assert_done_not_cancelled(node)
        finally:
            await node.stop()
            server.close()

    asyncio.run(scenario())
