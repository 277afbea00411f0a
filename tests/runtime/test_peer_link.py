"""Links between real nodes (uvicorn in this process, micro engine): many forwards share one
link, each forward is authenticated on its own, a node that stops ends the links it serves,
and a link that sends garbage is closed without harming the node.

The failure modes of a broken peer on a link are in test_runtime_forward_faults.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from radixmesh.core.forward_codec import (
    LINK_CANCEL,
    LINK_HELLO,
    LINK_OPEN,
    LinkDecoder,
    encode_forward_request,
    encode_link_frame,
)
from radixmesh.core.messages import ForwardAdmitted, ForwardRequest, ForwardResult
from radixmesh.runtime import peer_link
from radixmesh.runtime.inprocess import serving_node
from radixmesh.runtime.netem import Netem, NetemConfig
from radixmesh.runtime.node import NodeService
from radixmesh.runtime.peer_auth import forward_purpose
from radixmesh.runtime.peer_client import ForwardFailure
from radixmesh.runtime.peer_link import LINK_PATH, PeerLink

if TYPE_CHECKING:
    from conftest import Poll

KEY = "k" * 32


def _serving(engine: Any, name: str, **overrides: Any
             ) -> contextlib.AbstractAsyncContextManager[tuple[NodeService, str]]:
    return serving_node(engine, name, **overrides)


def _route_to(entry: NodeService, peer_address: str) -> None:
    entry.core.peer_address = (  # type: ignore[method-assign]
        lambda p: peer_address if p == "peer" else None
    )


async def _complete(http: aiohttp.ClientSession, address: str, prompt: str,
                    target: str | None = "peer") -> tuple[str, str]:
    body = {"model": "micro", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    headers = {"x-radixmesh-target": target} if target else {"x-radixmesh-hop": "1"}
    async with http.post(f"http://{address}/v1/completions", json=body,
                         headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        return (await resp.json())["choices"][0]["text"], resp.headers["x-radixmesh-served-by"]


def test_concurrent_forwards_share_one_link(engine: Any) -> None:
    async def scenario() -> None:
        async with _serving(engine, "peer", pushback_threshold=64) as (peer, peer_address), \
                _serving(engine, "entry") as (entry, entry_address):
            _route_to(entry, peer_address)
            prompts = [f"link me {i} " * 3 for i in range(12)]
            async with aiohttp.ClientSession() as http:
                forwarded = await asyncio.gather(
                    *(_complete(http, entry_address, p) for p in prompts))
                local = [await _complete(http, peer_address, p, target=None) for p in prompts]
            assert [text for text, _ in forwarded] == [text for text, _ in local]
            assert {by for _, by in forwarded} == {"peer"}, entry.metrics.forward_failures
            assert entry.metrics.requests["forwarded"] == 12
            assert peer.metrics.served_for_peers == 12
            assert entry.peers.links_opened == 1 and peer.links.opened == 1
            assert entry.peers.connections_opened == 1  # the link's, nothing else
            assert "radixmesh_peer_links_opened_total 1.0" in entry.prometheus()
            scrape = peer.prometheus()
            assert "radixmesh_peer_links_served_total 1.0" in scrape
            assert "radixmesh_peer_links_open 1.0" in scrape

    asyncio.run(scenario())


def test_each_forward_on_a_link_is_authenticated(engine: Any) -> None:
    """The link's opening and every forward on it carry their own token: a wrong key is
    refused at the opening, a forward whose token does not sign its bytes on its own."""
    async def scenario() -> None:
        async with _serving(engine, "peer", cluster_key=KEY) as (_, peer_address), \
                _serving(engine, "entry", cluster_key=KEY) as (entry, entry_address), \
                _serving(engine, "rogue", cluster_key="r" * 32) as (rogue, rogue_address):
            _route_to(entry, peer_address)
            _route_to(rogue, peer_address)
            async with aiohttp.ClientSession() as http:
                _, by = await _complete(http, entry_address, "signed " * 4)
                assert by == "peer"
                _, by = await _complete(http, rogue_address, "forged " * 4)
                assert by == "rogue"  # refused, answered locally
            assert rogue.metrics.forward_failures == {"http_403": 1}

            request = encode_forward_request(ForwardRequest(tuple(b"tampered"), 2))
            link = await entry.peers._link_to(peer_address)
            assert link is not None
            signed_other = entry.auth.headers(forward_purpose(LINK_PATH), b"other bytes")
            token = next(iter(signed_other.values()))
            stream = link.start(token, request, entry.netem, 2.0)
            with pytest.raises(ForwardFailure) as refused:
                await stream.next_reply()
            await stream.aclose()
            assert refused.value.reason == "http_403"
            assert not link.closed  # one forward refused, the link goes on
            async with aiohttp.ClientSession() as http:
                _, by = await _complete(http, entry_address, "signed again " * 3)
            assert by == "peer" and entry.peers.links_opened == 1

    asyncio.run(scenario())


def test_a_stopping_node_ends_the_links_it_serves(engine: Any, poll: Poll) -> None:
    async def scenario() -> None:
        async with _serving(engine, "entry") as (entry, entry_address):
            async with _serving(engine, "peer") as (peer, peer_address):
                _route_to(entry, peer_address)
                async with aiohttp.ClientSession() as http:
                    assert (await _complete(http, entry_address, "before " * 4))[1] == "peer"
                assert len(peer.links) == 1
            # the stop ended the link it served (close_all) instead of waiting for it to end
            assert peer.links.closing and len(peer.links) == 0
            await poll.until_async(lambda: not entry.peers._links, "the entry to see its link end")
            async with aiohttp.ClientSession() as http:
                assert (await _complete(http, entry_address, "after " * 4))[1] == "entry"
            assert entry.metrics.forward_failures == {"connect": 1}

    asyncio.run(scenario())


def test_a_link_that_sends_garbage_is_closed_and_the_node_goes_on(engine: Any) -> None:
    async def scenario() -> None:
        async with _serving(engine, "peer") as (peer, peer_address):
            async def body() -> AsyncIterator[bytes]:
                yield encode_link_frame(0, LINK_HELLO)
                # the garbage in a chunk of its own (read with the HELLO or after it: either
                # way the node must close the link, having answered HELLO first)
                yield b"\x00\x00\x00\x00\x00\x00\x00\x07\x63"  # frame type 99
                await asyncio.Event().wait()  # and the body stays open: the node must close it

            async with aiohttp.ClientSession() as http:
                async with http.post(f"http://{peer_address}{LINK_PATH}", data=body()) as resp:
                    assert resp.status == 200
                    frames = LinkDecoder().feed(await asyncio.wait_for(resp.read(), 5))
                assert [f.type for f in frames] == [LINK_HELLO]  # then the end of the body
                assert peer.links.rejected == 1 and len(peer.links) == 0
                _, by = await _complete(http, peer_address, "still here " * 3, target=None)
                assert by == "peer"

    asyncio.run(scenario())


def test_a_forward_result_over_a_link_matches_the_post(engine: Any) -> None:
    """The same forward over a link and as its own POST: the same replies."""
    async def replies(transport: str) -> list[object]:
        async with _serving(engine, "peer") as (_, peer_address), \
                _serving(engine, "entry", peer_transport=transport) as (entry, _):
            data = encode_forward_request(ForwardRequest(tuple(b"same either way"), 3))
            stream = await entry.peers.open_forward(peer_address, "peer", data)
            out = [await stream.next_reply()]
            while not isinstance(out[-1], ForwardResult):
                out.append(await stream.next_reply())
            await stream.aclose()
            assert (entry.peers.links_opened == 1) == (transport == "link")
            return out

    over_link, over_post = asyncio.run(replies("link")), asyncio.run(replies("http"))
    assert isinstance(over_link[0], ForwardAdmitted) and isinstance(over_post[0], ForwardAdmitted)
    assert over_link[0].node_id == over_post[0].node_id == "peer"  # the cache is warm later
    link_result, post_result = over_link[-1], over_post[-1]
    assert isinstance(link_result, ForwardResult) and isinstance(post_result, ForwardResult)
    assert link_result.output_ids == post_result.output_ids


def _stream_on_a_bare_link() -> tuple[PeerLink, Any]:
    link = PeerLink("127.0.0.1:9", lambda _: None)  # never opened: frames stay queued
    stream = link.start("", b"request", Netem(NetemConfig(0.0, 0.0, 0.0, 0.0)), 5.0)
    return link, stream


def _queued(link: PeerLink) -> list[int]:
    out = link._out
    return [f.type for f in LinkDecoder().feed(
        b"".join(x for x in (out.get_nowait() for _ in range(out.qsize())) if x))]


def test_an_abandoned_forward_stops_waiting_and_is_cancelled() -> None:
    """A drain's abort (``close_now``) while the forward waits for its next reply: the wait
    ends at once (``disconnected``, as a closed connection did), and the peer is told."""
    async def scenario() -> None:
        link, stream = _stream_on_a_bare_link()
        waiter = asyncio.ensure_future(stream.next_reply())
        await asyncio.sleep(0)  # one loop turn: the waiter starts waiting (no time passes)
        assert not waiter.done()
        stream.close_now()
        with pytest.raises(ForwardFailure) as failed:
            await asyncio.wait_for(waiter, 1.0)
        assert failed.value.reason == "disconnected"
        assert _queued(link) == [LINK_OPEN, LINK_CANCEL]

    asyncio.run(scenario())


def test_a_peer_that_floods_a_forward_is_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peer_link, "MAX_STREAM_BUFFER_BYTES", 1000)

    async def scenario() -> None:
        link, stream = _stream_on_a_bare_link()
        for _ in range(3):
            stream.push(b"x" * 400)  # never read: the third passes the bound
        with pytest.raises(ForwardFailure) as failed:
            for _ in range(4):
                await stream.next_reply()
        assert failed.value.reason == "bad_response"
        assert _queued(link) == [LINK_OPEN, LINK_CANCEL]

    asyncio.run(scenario())


def test_an_idle_link_is_ended_by_the_peer_and_reopened(
    engine: Any, monkeypatch: pytest.MonkeyPatch, poll: Poll
) -> None:
    monkeypatch.setattr(peer_link, "IDLE_CLOSE_S", 0.3)

    async def scenario() -> None:
        async with _serving(engine, "peer") as (peer, peer_address), \
                _serving(engine, "entry") as (entry, entry_address):
            _route_to(entry, peer_address)
            async with aiohttp.ClientSession() as http:
                assert (await _complete(http, entry_address, "idle one " * 3))[1] == "peer"
                await poll.until_async(lambda: not entry.peers._links and len(peer.links) == 0,
                                       "both ends to close the idle link")
                assert (await _complete(http, entry_address, "idle two " * 3))[1] == "peer"
            assert entry.peers.links_opened == 2 and entry.metrics.forward_failures == {}

    asyncio.run(scenario())
