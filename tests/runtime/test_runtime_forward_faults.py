"""Forward failure modes against a scripted fake peer, in process (micro preset, no sockets
for the node itself): every broken peer still yields the correct answer, via fallback, with
the same failure reason over either transport (one POST per forward, or a link)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import msgpack
import pytest

from radixmesh.core.events import LoadChanged
from radixmesh.core.forward_codec import (
    LINK_CANCEL,
    LINK_END,
    LINK_OPEN,
    LINK_REPLY,
    LinkDecoder,
    LinkFrame,
    ReplyDecoder,
    decode_forward_request,
    decode_link_open,
    encode_forward_request,
    encode_link_frame,
    encode_link_refused,
    encode_reply,
)
from radixmesh.core.messages import (
    ForwardAdmitted,
    ForwardBusy,
    ForwardRequest,
    ForwardResult,
    ForwardTokens,
)
from radixmesh.engine.base import SamplingParams
from radixmesh.runtime.config import ServeConfig
from radixmesh.runtime.node import NodeService

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
PROMPT = list(b"The following are multiple choice questions about faults. " * 3)
SAMPLING = SamplingParams(max_tokens=8)


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    return await reader.readexactly(length)


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _stream_head() -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/x-radixmesh-forward\r\n"
            b"transfer-encoding: chunked\r\n\r\n")


async def _http_500(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _read_request(reader)
    writer.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 4\r\n\r\noops")


async def _hang() -> None:
    """A fake peer that goes silent: wait until the test's server cancels us (no timer)."""
    await asyncio.Event().wait()


async def _garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _read_request(reader)
    writer.write(_stream_head() + _chunk(b"\x00\x00\x00\x05\xffnot a frame"))


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _read_request(reader)
    await _hang()  # never answers: the first-byte timeout must fire


async def _dies_midstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    assert decode_forward_request(await _read_request(reader)).stream is True
    writer.write(_stream_head() + _chunk(encode_reply(ForwardAdmitted("fake", 0))))
    writer.write(_chunk(encode_reply(ForwardTokens(tuple(TRUTH[:3])))))
    await writer.drain()
    writer.transport.abort()  # like kill -9 after three tokens


async def _bad_tokens(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _read_request(reader)
    done = ForwardResult((10**9,), "length", len(PROMPT), 0, 0.0, 0.0, 0.0)  # >= vocab
    writer.write(_stream_head() + _chunk(encode_reply(ForwardAdmitted("fake", 0))))
    writer.write(_chunk(encode_reply(done)) + _chunk(b""))


async def _busy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _read_request(reader)
    writer.write(_stream_head() + _chunk(encode_reply(ForwardBusy("fake", 0.7))) + _chunk(b""))


# ------------------------------------------------------------------ the same, over a link
async def _link_open(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> LinkFrame:
    """Accept the link (its request head), then read its frames up to the first forward."""
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"POST /peer/link "), head[:40]
    writer.write(_link_head())
    return await _next_frame(reader, LINK_OPEN)


async def _next_frame(reader: asyncio.StreamReader, kind: int) -> LinkFrame:
    """Read the link's chunked body up to the next frame of type ``kind`` (the entry writes
    whole frames in each chunk)."""
    decoder = LinkDecoder()
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        data = (await reader.readexactly(size + 2))[:-2]
        for frame in decoder.feed(data):
            if frame.type == kind:
                return frame


def _reply(frame: LinkFrame, *replies: object) -> bytes:
    return _chunk(b"".join(encode_link_frame(frame.stream, LINK_REPLY, encode_reply(r))  # type: ignore[arg-type]
                           for r in replies))


def _link_head() -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/x-radixmesh-link\r\n"
            b"transfer-encoding: chunked\r\n\r\n")


async def _link_http_500(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 4\r\n\r\noops")


async def _link_refused(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    frame = await _link_open(reader, writer)
    writer.write(_chunk(encode_link_refused(frame.stream, 500, "oops")))
    await _hang()  # the link stays open: only the forward was refused


async def _link_garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _link_open(reader, writer)
    writer.write(_chunk(b"\x00\x00\x00\x01\x00\x00\x00\x01\x09x"))  # type 9


async def _link_bad_reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    frame = await _link_open(reader, writer)
    body = b"\x00\x00\x00\x05\xffnot a frame"
    writer.write(_chunk(encode_link_frame(frame.stream, LINK_REPLY, body)))


async def _link_silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _link_open(reader, writer)
    await _hang()  # the fake peer holds its link open: what the node must handle


async def _link_dies_midstream(reader: asyncio.StreamReader,
                               writer: asyncio.StreamWriter) -> None:
    frame = await _link_open(reader, writer)
    assert decode_forward_request(decode_link_open(frame.body)[1]).stream is True
    writer.write(_reply(frame, ForwardAdmitted("fake", 0),
                                       ForwardTokens(tuple(TRUTH[:3]))))
    await writer.drain()
    writer.transport.abort()


async def _link_ends_early(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    frame = await _link_open(reader, writer)
    writer.write(_reply(frame, ForwardAdmitted("fake", 0))
                 + _chunk(encode_link_frame(frame.stream, LINK_END)))
    await _hang()  # the fake peer holds its link open: what the node must handle


async def _link_bad_tokens(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    frame = await _link_open(reader, writer)
    done = ForwardResult((10**9,), "length", len(PROMPT), 0, 0.0, 0.0, 0.0)
    writer.write(_reply(frame, ForwardAdmitted("fake", 0), done))
    await _hang()  # the fake peer holds its link open: what the node must handle


async def _link_too_many_tokens(reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter) -> None:
    """Right tokens, then more than the request's max_tokens: a peer streaming without end."""
    frame = await _link_open(reader, writer)
    writer.write(_reply(frame, ForwardAdmitted("fake", 0), ForwardTokens(tuple(TRUTH[:2])),
                        ForwardTokens(tuple(TRUTH))))
    await _hang()  # the fake peer holds its link open: what the node must handle


async def _link_busy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    frame = await _link_open(reader, writer)
    writer.write(_reply(frame, ForwardBusy("fake", 0.7))
                 + _chunk(encode_link_frame(frame.stream, LINK_END)))
    await _hang()  # the fake peer holds its link open: what the node must handle


TRUTH: list[int] = []


async def _run(engine, script: Script | None, stream: bool,  # type: ignore[no-untyped-def]
               transport: str = "http") -> tuple[list[int], str, dict]:
    server = None
    address = "127.0.0.1:9"  # nothing listens there: connection refused
    if script is not None:
        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                await script(r, w)
                await w.drain()
            finally:
                w.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    cfg = ServeConfig(node_id="entry", port=18999, forward_timeout=0.5, connect_timeout=0.5,
                      gossip_interval=5.0, peer_transport=transport)
    service = NodeService(cfg, engine)
    service.core.peer_address = lambda peer: address if peer == "fake" else None  # type: ignore[method-assign]
    await service.start()
    try:
        ex = await service.execute(PROMPT, SAMPLING, stream, target="fake")
        tokens = [t async for t in ex.tokens()] if stream else []
        out = await ex.result() if not stream else ex.outcome
        assert out is not None
        if stream:
            assert tokens == out.output_ids
        return out.output_ids, out.route, dict(service.metrics.forward_failures)
    finally:
        await service.stop()
        if server is not None:
            server.close()


@pytest.fixture(scope="module")
def truth(engine) -> list[int]:  # type: ignore[no-untyped-def]
    """The answer with no peer at all (the peer address refuses connections): local."""
    TRUTH[:] = asyncio.run(_run(engine, None, stream=False))[0]
    assert len(TRUTH) >= 4  # the faults below need a few tokens to cut
    return TRUTH


def test_reference_answer(truth: list[int]) -> None:
    assert len(truth) == SAMPLING.max_tokens


@pytest.mark.parametrize(
    ("transport", "script", "stream", "reason"),
    [
        ("http", None, False, "connect"),
        ("http", _http_500, False, "http_500"),
        ("http", _garbage, True, "bad_response"),
        ("http", _silent, False, "timeout"),
        ("http", _dies_midstream, True, "disconnected"),
        ("http", _bad_tokens, False, "bad_response"),
        ("http", _busy, False, "busy"),
        ("link", None, False, "connect"),
        ("link", _link_http_500, False, "http_500"),
        ("link", _link_refused, False, "http_500"),
        ("link", _link_garbage, True, "bad_response"),
        ("link", _link_bad_reply, True, "bad_response"),
        ("link", _link_silent, False, "timeout"),
        ("link", _link_dies_midstream, True, "disconnected"),
        ("link", _link_ends_early, False, "disconnected"),
        ("link", _link_bad_tokens, False, "bad_response"),
        ("link", _link_too_many_tokens, True, "bad_response"),
        ("link", _link_busy, False, "busy"),
    ],
)
def test_broken_peer_still_gives_the_right_answer(  # type: ignore[no-untyped-def]
        engine, truth, transport, script, stream, reason) -> None:
    output, route, failures = asyncio.run(_run(engine, script, stream, transport))
    assert output == truth
    assert route == "fallback"
    assert failures == {reason: 1}


CANCELLED: list[int] = []


async def _link_bad_reply_then_listen(reader: asyncio.StreamReader,
                                      writer: asyncio.StreamWriter) -> None:
    """Garbage for the forward, then keep reading the link: the entry must cancel it."""
    frame = await _link_open(reader, writer)
    body = b"\x00\x00\x00\x05\xffnot a frame"
    writer.write(_chunk(encode_link_frame(frame.stream, LINK_REPLY, body)))
    CANCELLED.append((await _next_frame(reader, LINK_CANCEL)).stream)


def test_a_forward_given_up_on_a_link_is_cancelled_at_the_peer(engine, truth) -> None:  # type: ignore[no-untyped-def]
    """A reply the entry cannot read: it falls back, and tells the peer to stop (CANCEL)
    on a link that is still fine, as closing the connection did with one POST each."""
    CANCELLED.clear()
    output, route, failures = asyncio.run(
        _run(engine, _link_bad_reply_then_listen, False, transport="link"))
    assert output == truth and route == "fallback"
    assert failures == {"bad_response": 1}
    assert CANCELLED == [1]


async def _no_links(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A node from before links: 404 to the link, then the forward as its own POST."""
    head = await reader.readuntil(b"\r\n\r\n")
    if head.startswith(b"POST /peer/link "):
        writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
        return
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    await reader.readexactly(length)
    writer.write(_stream_head() + _chunk(encode_reply(ForwardBusy("fake", 0.7))) + _chunk(b""))


def test_a_peer_without_links_gets_one_post_per_forward(engine, truth) -> None:  # type: ignore[no-untyped-def]
    output, route, failures = asyncio.run(_run(engine, _no_links, False, transport="link"))
    assert output == truth and route == "fallback"
    assert failures == {"busy": 1}  # the POST got through: the peer's own answer


def test_a_node_at_its_pushback_threshold_answers_busy(engine) -> None:  # type: ignore[no-untyped-def]
    async def first_reply() -> object:
        cfg = ServeConfig(node_id="hot", port=18998, gossip_interval=5.0, pushback_threshold=1)
        service = NodeService(cfg, engine)
        await service.start()
        try:
            service.dispatch(LoadChanged(1, 1, 0, 4096))  # as if one request were running
            req = ForwardRequest(tuple(PROMPT), 8, heartbeat_s=0.1)
            frames = [x async for x in service.serve_forward(req)]
            assert len(frames) == 1
            assert service.metrics.refused_for_peers == 1
            assert service.metrics.served_for_peers == 0
            [reply] = ReplyDecoder().feed(frames[0])
            return reply
        finally:
            await service.stop()

    busy = asyncio.run(first_reply())
    assert isinstance(busy, ForwardBusy)
    assert busy.node_id == "hot"
    assert 0 < busy.retry_after_s <= 1.0
    assert busy.queue_s is None  # refused by its state: no queue wait given


def test_a_forward_that_would_not_pay_is_refused_with_the_queue_wait(engine) -> None:  # type: ignore[no-untyped-def]
    """A forward whose ``beat_s`` this node cannot beat is answered busy with retry-after 0
    (the node is not busy as such) and its queue wait, which the sender takes as a report
    of its queue."""
    async def first_reply() -> object:
        cfg = ServeConfig(node_id="slow", port=18997, gossip_interval=5.0)
        service = NodeService(cfg, engine)
        await service.start()
        try:
            service.dispatch(LoadChanged(2, 1, 0, 4096))  # two requests here already
            req = ForwardRequest(tuple(PROMPT), 8, heartbeat_s=0.1, beat_s=1e-6)
            frames = [x async for x in service.serve_forward(req)]
            assert len(frames) == 1 and service.metrics.refused_for_peers == 1
            [reply] = ReplyDecoder().feed(frames[0])
            return reply
        finally:
            await service.stop()

    slower = asyncio.run(first_reply())
    assert isinstance(slower, ForwardBusy) and slower.node_id == "slow"
    assert slower.retry_after_s == 0.0
    assert slower.queue_s is not None and slower.queue_s > 0


@pytest.mark.parametrize("beat", [True, "0.5", float("nan"), 1e9, -1e9, [1]])
def test_a_malformed_beat_s_is_a_400(engine, beat) -> None:  # type: ignore[no-untyped-def]
    from radixmesh.runtime.app import _parse_forward
    from radixmesh.runtime.openai_api import ApiError

    service = NodeService(ServeConfig(node_id="p", port=18997), engine)
    good = encode_forward_request(ForwardRequest(tuple(PROMPT[:8]), 2, beat_s=0.25))
    fields = msgpack.unpackb(good)
    fields[10] = beat  # beat_s: [version, kind, prompt, ..., heartbeat_s, beat_s, ...]
    with pytest.raises(ApiError) as err:
        _parse_forward(service, msgpack.packb(fields))
    assert err.value.status == 400
    assert _parse_forward(service, good).beat_s == 0.25
    no_beat = encode_forward_request(ForwardRequest(tuple(PROMPT[:8]), 2))
    assert _parse_forward(service, no_beat).beat_s is None
