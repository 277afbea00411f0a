"""Links: every forward between two nodes over one long-lived HTTP exchange.

Theory of operation
-------------------
A forward sent as its own ``POST /peer/forward`` pays a whole HTTP exchange on both nodes:
aiohttp's request on the entry node, then uvicorn's parsing, an ASGI scope and the
middlewares on the peer, and the response's way back (about 1.3 ms of the ~2 ms a forward
adds on loopback; docs/benchmarks.md, "Node: forwarding overhead"). A *link* is one
``POST /peer/link`` that stays open: its chunked request body carries the entry node's
frames to the peer and its chunked response body the peer's frames back (the link frames of
``core/forward_codec``), so a forward costs one frame each way on a connection that is
already open, and the replies of many forwards share it::

    entry node (PeerLink, LinkStream)            peer (serve_link)
      HELLO ------------------------------------>   (opens the link; headers go with it)
      OPEN  stream 7: token + ForwardRequest --->   checks token and request, runs it
      <---------------- REPLY stream 7: ForwardAdmitted, heartbeats, tokens, ForwardResult
      <---------------- END   stream 7
      CANCEL stream 9 -------------------------->   aborts the work (the client went away)
      <---------------- REFUSED stream 8: 400 / 401 / 403 / 503 and why (never started)

What stays as it was with one exchange per forward: the replies and their order, the
heartbeats and timeouts (``forward_timeout`` on the first reply of a forward and on every
silence after it), each forward's own authentication (the OPEN carries the token that the
``x-radixmesh-auth`` header would have, for ``forward_purpose(LINK_PATH)`` over the request's
bytes: forged, stale and replayed requests are refused one by one), the peer-TLS and API
checks (the link is a ``/peer/*`` request), the failure reasons the lifecycle and the metrics
see (``connect``, ``tls``, ``timeout``, ``disconnected``, ``bad_response``, ``http_<status>``,
``partitioned``) and the emulated network (``Netem``: drops and delays per forward).

What is new: a link that breaks (peer killed, connection reset, garbage) fails every forward
on it at once (``disconnected`` / ``bad_response``) and the next forward opens a new link; a
forward that times out on a link that has received nothing since that forward began closes
the link (the connection is presumed dead, as a half-open TCP connection would be); a peer
that answers ``POST /peer/link`` with 404 or 405 (a node from before links) gets one POST per
forward from then on (until this node restarts); a forward whose replies pile up unread past
``MAX_STREAM_BUFFER_BYTES`` is cut off as ``bad_response`` (a peer cannot fill our memory);
a served link with nothing running and nothing received for ``IDLE_CLOSE_S`` is ended by the
peer (an entry that vanished without closing its connection leaves nothing behind), and the
entry replaces a link idle for half that rather than race its end. A peer ends the links it
serves when its server stops
(:meth:`LinkRegistry.close_all`, before uvicorn waits for open requests: a link never ends
by itself), and a node ends its own links when it stops.

Why one file over 400 lines: both ends of one protocol (the entry's ``PeerLink`` /
``LinkStream``, the peer's ``serve_link`` / ``LinkRegistry``) share its frames, limits and
failure rules; together, each rule reads once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import aclosing, suppress
from typing import TYPE_CHECKING, Any

from radixmesh.core.codec import RemoteProtocolError
from radixmesh.core.forward_codec import (
    LINK_CANCEL,
    LINK_END,
    LINK_HELLO,
    LINK_OPEN,
    LINK_REFUSED,
    LINK_REPLY,
    MAX_LINK_STREAM,
    ForwardLimits,
    LinkDecoder,
    LinkFrame,
    ReplyDecoder,
    decode_link_refused,
    encode_link_frame,
    encode_link_open,
    encode_link_refused,
)
from radixmesh.core.headers import HEADER_AUTH
from radixmesh.core.messages import (
    ForwardBusy,
    ForwardError,
    ForwardReply,
    ForwardRequest,
    ForwardResult,
)

if TYPE_CHECKING:
    from radixmesh.runtime.netem import Netem

log = logging.getLogger(__name__)

LINK_PATH = "/peer/link"
CLOSE_WAIT_S = 0.5  # a closing link: wait this long for the peer's end of the body
IDLE_CLOSE_S = 120.0  # a served link with no forward running and nothing received: ended
MAX_STREAM_BUFFER_BYTES = 16 * 1024 * 1024  # replies received, not yet read, per forward
MAX_LINK_REQUEST_BYTES = ForwardLimits().max_frame_bytes - 4096  # larger: its own POST


class ForwardFailure(Exception):
    """A forward did not produce a usable response, over a link or a POST of its own
    (``peer_client`` re-exports it); ``reason`` is a short metric label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


_Item = bytes | ForwardFailure | None  # reply bytes, a failure, or the end of the stream


# ----------------------------------------------------------------------- the entry node
class LinkStream:
    """One forward on a link; the interface of ``peer_client.ForwardStream``: call
    :meth:`next_reply` until the final reply, always :meth:`aclose` it."""

    def __init__(self, link: PeerLink, stream_id: int, netem: Netem, timeout_s: float) -> None:
        self._link, self.id = link, stream_id
        self._timeout_s = timeout_s
        self._inbox: asyncio.Queue[_Item] = asyncio.Queue()
        # each reply crosses the emulated link from that peer
        self._items = netem.delayed(self._arrivals(), link.address)
        self._decoder = ReplyDecoder()
        self._ready: deque[ForwardReply] = deque()
        self.completed = False  # the caller saw the final reply
        self._done = False  # the stream ended (final reply, failure or END)
        self._buffered = 0  # reply bytes received and not yet read

    def push(self, item: _Item) -> None:
        if isinstance(item, bytes):
            self._buffered += len(item)
            if self._buffered > MAX_STREAM_BUFFER_BYTES:  # a peer that floods a forward
                self._link.finish(self.id, cancel=True)
                item = ForwardFailure("bad_response", "more unread replies than the limit")
        self._inbox.put_nowait(item)

    async def _arrivals(self) -> AsyncIterator[_Item]:
        while True:
            item = await self._inbox.get()
            yield item
            if not isinstance(item, bytes):
                return

    async def next_reply(self) -> ForwardReply:
        """The next reply; the caller's ``ForwardFailure`` on timeout, disconnect or garbage."""
        while not self._ready:
            seen = self._link.received
            try:
                async with asyncio.timeout(self._timeout_s):
                    item = await anext(self._items)
            except TimeoutError:  # the peer may still be at work: closing cancels it
                self._link.stalled(seen)
                raise ForwardFailure("timeout", "no reply within the forward timeout") from None
            except StopAsyncIteration:
                item = None
            except ForwardFailure as exc:  # Netem.delayed raises the exceptions it relays
                item = exc
            if isinstance(item, ForwardFailure):  # refused, or the link broke: nothing runs
                self._done = True  # (one failure may be pushed to every stream: a copy each)
                raise ForwardFailure(item.reason, item.detail)
            if item is None:
                self._done = True
                raise ForwardFailure("disconnected", "stream ended without a result")
            self._buffered -= len(item)
            try:
                self._ready.extend(self._decoder.feed(item))
            except RemoteProtocolError as exc:  # closing cancels whatever the peer runs
                raise ForwardFailure("bad_response", str(exc)[:200]) from None
        reply = self._ready.popleft()
        if isinstance(reply, ForwardResult | ForwardError):
            self.completed = self._done = True
        elif isinstance(reply, ForwardBusy):  # the peer ends the stream after it
            self._done = True
        return reply

    def close_now(self) -> None:
        """Abandon the forward at once (the request was aborted): the peer stops its work,
        and a wait for the next reply ends with ``disconnected``."""
        self._link.finish(self.id, cancel=not self._done)
        if not self._done:
            self._inbox.put_nowait(ForwardFailure("disconnected", "forward abandoned"))
        self._done = True

    async def aclose(self) -> None:
        await self._items.aclose()  # type: ignore[attr-defined]
        self.close_now()


class PeerLink:
    """The entry node's side of one link to one peer address."""

    def __init__(self, address: str, on_closed: Callable[[PeerLink], None]) -> None:
        self.address = address
        self._on_closed = on_closed
        self._out: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._streams: dict[int, LinkStream] = {}
        self._next_id = 1
        self._decoder = LinkDecoder()
        self._response: Any = None  # aiohttp.ClientResponse, once open
        self._reader: asyncio.Task[None] | None = None
        self.received = 0  # bytes of the peer's body so far (a stalled forward looks at it)
        self.closed = False
        self.last_active = time.monotonic()  # the last frame sent or received

    @property
    def idle_too_long(self) -> bool:
        """Idle for half the time after which the peer ends it: not worth a race with its
        end, open a new one (``IDLE_CLOSE_S``)."""
        return not self._streams and time.monotonic() - self.last_active > IDLE_CLOSE_S / 2

    async def open(self, post: Callable[[AsyncIterator[bytes]], Awaitable[Any]]) -> Any:
        """Send the link's request (``post`` is the HTTP client's call with this body); returns
        the response, whose status the caller checks, then calls :meth:`run`."""
        self._out.put_nowait(encode_link_frame(0, LINK_HELLO))  # aiohttp sends the headers
        return await post(self._body())                       # with the first chunk

    def run(self, response: Any) -> None:
        self._response = response
        self._reader = asyncio.ensure_future(self._read())

    def _body(self) -> AsyncIterator[bytes]:
        """The request body: the frames queued for the peer (:func:`_batches`)."""
        return _batches(self._out)

    async def _read(self) -> None:
        failure = ForwardFailure("disconnected", "link closed by the peer")
        try:
            async for chunk in self._response.content.iter_any():
                self.received += len(chunk)
                self.last_active = time.monotonic()
                for frame in self._decoder.feed(chunk):
                    self._dispatch(frame)
        except RemoteProtocolError as exc:
            failure = ForwardFailure("bad_response", f"link: {exc}"[:200])
        except asyncio.CancelledError:
            failure = ForwardFailure("disconnected", "link closed")
            raise
        except Exception as exc:  # transport errors of any kind end the link
            failure = ForwardFailure("disconnected", type(exc).__name__)
        finally:
            self._close(failure)

    def _dispatch(self, frame: LinkFrame) -> None:
        if frame.type == LINK_HELLO:
            return
        if frame.type not in (LINK_REPLY, LINK_END, LINK_REFUSED):
            raise RemoteProtocolError(f"link: a peer may not send frame type {frame.type}")
        stream = self._streams.get(frame.stream)
        if stream is None:
            return  # a forward we abandoned: its late replies are dropped
        if frame.type == LINK_REPLY:
            stream.push(frame.body)
            return
        del self._streams[frame.stream]
        if frame.type == LINK_END:
            stream.push(None)
            return
        try:
            status, detail = decode_link_refused(frame.body)
        except RemoteProtocolError as exc:
            stream.push(ForwardFailure("bad_response", str(exc)[:200]))
            return
        stream.push(ForwardFailure(f"http_{status}", detail))

    def start(self, token: str, request: bytes, netem: Netem, timeout_s: float) -> LinkStream:
        """Send one forward (its encoded request and authentication token)."""
        stream_id = self._next_id
        self._next_id = self._next_id % MAX_LINK_STREAM + 1  # 1..2**32-1, 0 is the link's
        stream = LinkStream(self, stream_id, netem, timeout_s)
        self._streams[stream_id] = stream
        self.last_active = time.monotonic()
        if self.closed:  # closed since the caller got it: the forward fails like the link
            stream.push(ForwardFailure("disconnected", "link closed"))
        else:
            self._out.put_nowait(encode_link_open(stream_id, token, request))
        return stream

    def finish(self, stream_id: int, cancel: bool) -> None:
        """The caller is done with a stream; ``cancel``: tell the peer to stop its work."""
        if self._streams.pop(stream_id, None) is not None and cancel and not self.closed:
            self._out.put_nowait(encode_link_frame(stream_id, LINK_CANCEL))

    def stalled(self, received_before: int) -> None:
        """A forward timed out; if nothing at all came since it began, the link is dead."""
        if self.received == received_before and not self.closed:
            log.info("link to %s silent for a whole forward timeout: closing it", self.address)
            self._close(ForwardFailure("timeout", "link silent"))
            if self._reader is not None:
                self._reader.cancel()

    def _close(self, failure: ForwardFailure) -> None:
        if self.closed:
            return
        self.closed = True
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.push(failure)
        self._out.put_nowait(None)
        if self._response is not None:
            self._response.close()
        self._on_closed(self)

    async def aclose(self) -> None:
        """End the link: our body ends, the peer ends its; then the connection is closed."""
        if not self.closed:
            self._out.put_nowait(None)
        if self._reader is not None:
            with suppress(TimeoutError, asyncio.CancelledError):
                async with asyncio.timeout(CLOSE_WAIT_S):
                    await asyncio.shield(self._reader)
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._close(ForwardFailure("disconnected", "link closed"))


# ---------------------------------------------------------------------------- the peer
class LinkRegistry:
    """The links a node serves, so that it can end them when its server stops."""

    def __init__(self) -> None:
        self._handlers: set[asyncio.Task[Any]] = set()
        self.closing = False
        self.opened = 0  # links served since start
        self.rejected = 0  # links closed for a malformed frame

    def __len__(self) -> int:
        return len(self._handlers)

    def add(self, task: asyncio.Task[Any]) -> None:
        self._handlers.add(task)
        self.opened += 1

    def discard(self, task: asyncio.Task[Any]) -> None:
        self._handlers.discard(task)

    def close_all(self) -> None:
        """End every link this node serves (its server is stopping); forwards still running
        on them are aborted (a drain finishes them first)."""
        self.closing = True
        for task in list(self._handlers):
            task.cancel()


class Refused(Exception):
    """A forward on a link refused before it started: REFUSED with ``status``."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


async def serve_link(
    receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
    send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    registry: LinkRegistry,
    admit: Callable[[bytes], ForwardRequest],
    serve: Callable[[ForwardRequest], Any],
) -> None:
    """Serve one link after its opening was accepted (status 200 not yet sent).

    ``admit(open_body)`` checks one OPEN (partition, authentication, request: see
    :func:`decode_link_open`) and returns the request or raises :class:`Refused`;
    ``serve(request)`` is the async generator of its framed replies
    (``NodeService.serve_forward``)."""
    task = asyncio.current_task()
    assert task is not None
    registry.add(task)
    link = _ServedLink(admit, serve)
    writer = asyncio.ensure_future(_write(link.out, send))
    link.out.put_nowait(encode_link_frame(0, LINK_HELLO))
    try:
        await link.read(receive)
    except RemoteProtocolError as exc:
        registry.rejected += 1
        log.warning("closing a link that sent a malformed frame: %s", exc)
    except TimeoutError:
        pass  # idle this long: the entry node opens a new link when it needs one
    except asyncio.CancelledError:
        if not registry.closing:
            raise
        task.uncancel()  # our server is stopping: end the link cleanly
    finally:
        try:
            await link.stop(writer)
        finally:
            writer.cancel()
            registry.discard(task)


class _ServedLink:
    """The state of one link that :func:`serve_link` serves: its outgoing frames, the
    forwards running on it and its idle timer."""

    def __init__(self, admit: Callable[[bytes], ForwardRequest],
                 serve: Callable[[ForwardRequest], Any]) -> None:
        self.admit, self.serve = admit, serve
        self.out: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.running: dict[int, asyncio.Task[None]] = {}
        self.loop = asyncio.get_running_loop()
        self.idle: asyncio.Timeout | None = None

    def rearm(self) -> None:
        """No forward running: the link ends after ``IDLE_CLOSE_S`` of silence."""
        if self.idle is not None:
            self.idle.reschedule(None if self.running else self.loop.time() + IDLE_CLOSE_S)

    async def read(self, receive: Callable[[], Awaitable[MutableMapping[str, Any]]]) -> None:
        """The entry node's frames until its body ends or it goes away (raises
        ``TimeoutError`` when idle too long, ``RemoteProtocolError`` on a malformed frame)."""
        decoder = LinkDecoder()
        async with asyncio.timeout(None) as self.idle:
            self.rearm()
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    break  # http.disconnect: the entry node went away
                body = message.get("body", b"")
                if body:
                    for frame in decoder.feed(body):
                        self.on_frame(frame)
                if not message.get("more_body", False):
                    break  # the entry node ended the link
                self.rearm()

    def on_frame(self, frame: LinkFrame) -> None:
        if frame.type == LINK_HELLO:
            return
        if frame.type == LINK_CANCEL:
            work = self.running.pop(frame.stream, None)
            if work is not None:
                work.cancel()
            return
        if frame.type != LINK_OPEN or frame.stream == 0 or frame.stream in self.running:
            raise RemoteProtocolError(f"link: unexpected frame type {frame.type} on stream "
                                      f"{frame.stream}")
        try:
            req = self.admit(frame.body)
        except Refused as no:
            self.out.put_nowait(encode_link_refused(frame.stream, no.status, no.detail))
            return
        self.running[frame.stream] = asyncio.ensure_future(self.forward(frame.stream, req))

    async def forward(self, stream_id: int, req: ForwardRequest) -> None:
        try:
            async with aclosing(self.serve(req)) as frames:
                async for frame in frames:
                    self.out.put_nowait(encode_link_frame(stream_id, LINK_REPLY, frame))
        except Exception:  # a bug here: the sender sees the stream end without a result
            log.exception("a forward on a link failed")
        finally:  # cancelled (CANCEL, or the link ends): nobody is waiting for the end
            self.running.pop(stream_id, None)
            self.rearm()
        self.out.put_nowait(encode_link_frame(stream_id, LINK_END))

    async def stop(self, writer: asyncio.Future[None]) -> None:
        """Abort the forwards still running, end the response body and give the writer
        ``CLOSE_WAIT_S`` to send what is queued."""
        self.idle = None  # the forwards cancelled below must not re-arm a finished timer
        work = list(self.running.values())
        for one in work:
            one.cancel()
        await asyncio.gather(*work, return_exceptions=True)
        self.out.put_nowait(None)
        with suppress(Exception, asyncio.CancelledError):
            async with asyncio.timeout(CLOSE_WAIT_S):
                await asyncio.shield(writer)


async def _write(out: asyncio.Queue[bytes | None],
                 send: Callable[[MutableMapping[str, Any]], Awaitable[None]]) -> None:
    """The link's response body: frames as they are queued, the waiting ones sent together."""
    await send({"type": "http.response.start", "status": 200, "headers": _LINK_HEADERS})
    async for batch in _batches(out):
        await send({"type": "http.response.body", "body": batch, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _batches(queue: asyncio.Queue[bytes | None]) -> AsyncIterator[bytes]:
    """Frames as they are queued, those already waiting joined into one write, until None
    (one side's body of a link)."""
    while True:
        item = await queue.get()
        parts: list[bytes] = []
        while item is not None:
            parts.append(item)
            if queue.empty():
                break
            item = queue.get_nowait()
        if parts:
            yield b"".join(parts)
        if item is None:
            return


LINK_MEDIA_TYPE = "application/x-radixmesh-link"
_LINK_HEADERS = [(b"content-type", LINK_MEDIA_TYPE.encode())]


def token_of(headers: dict[str, str]) -> str:
    """The authentication token in ``PeerAuth.headers(...)`` ("" in open mode)."""
    return headers.get(HEADER_AUTH, "")


def headers_of(token: str) -> dict[str, str]:
    """The inverse: the headers ``PeerAuth.verify`` reads for a token."""
    return {HEADER_AUTH: token} if token else {}

