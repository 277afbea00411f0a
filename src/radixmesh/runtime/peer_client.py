"""HTTP client for peer messages: gossip pushes and forwarded requests (through netem).

Theory of operation
-------------------
One ``aiohttp`` session with keep-alive connections per peer. Gossip is fire-and-forget: a
failed push is only counted (silence is what the core's failure detector reads). A forward is
a streamed ``POST /peer/forward`` of an encoded ``ForwardRequest`` whose response body is a
stream of framed ``ForwardReply`` messages (``core/forward_codec``)::

    ForwardBusy | ForwardAdmitted     sent at once by the receiver: the *first byte*
    ForwardHeartbeat                  while the request queues or prefills
    ForwardTokens                     generated tokens (only when the client streams)
    ForwardResult | ForwardFailure      the end

Timeouts: ``connect_timeout`` on the TCP connect, ``forward_timeout`` on the first byte *and*
on every silence after it (heartbeats keep a long queue from looking like a dead peer), so a
killed, hung or partitioned peer is detected within about one ``forward_timeout``.

Links (runtime/peer_link.py, the default ``--peer-transport link``): every forward to one
peer travels over one long-lived ``POST /peer/link`` instead of a POST of its own; the
replies, timeouts and failure reasons are the same, and a peer without links (404/405) gets
one POST per forward. ``--peer-transport http`` sends every forward as its own POST.

TLS (``--peer-tls-*``, runtime/peer_tls.py): :meth:`PeerClient.use_tls` switches every peer
message to ``https://`` with the node's client context (its certificate, the mesh CA, hostname
checked); a failed handshake is the forward failure reason ``tls`` and counted.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import deque
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import aiohttp

from radixmesh.core.codec import RemoteProtocolError
from radixmesh.core.forward_codec import ReplyDecoder
from radixmesh.core.headers import HEADER_FROM, HEADER_FROM_ADDRESS
from radixmesh.core.messages import ForwardError, ForwardReply, ForwardResult
from radixmesh.runtime.netem import Netem
from radixmesh.runtime.peer_auth import GOSSIP_PURPOSE, PeerAuth, forward_purpose
from radixmesh.runtime.peer_link import (
    LINK_MEDIA_TYPE,
    LINK_PATH,
    MAX_LINK_REQUEST_BYTES,
    LinkStream,
    PeerLink,
    token_of,
)
from radixmesh.runtime.peer_link import ForwardFailure as ForwardFailure  # one for both

log = logging.getLogger(__name__)

FORWARD_PATH = "/peer/forward"
FORWARD_MEDIA_TYPE = "application/x-radixmesh-forward"  # msgpack request; framed replies
GOSSIP_PATH = "/peer/gossip"
READ_BUFFER_BYTES = 1024 * 1024  # aiohttp's read buffer for forward streams
EOF_WAIT_S = 0.5  # after the final reply, wait this long for the end of the body


def _classify(exc: BaseException) -> ForwardFailure:
    if isinstance(exc, ForwardFailure):
        return exc
    if isinstance(exc, aiohttp.ClientSSLError):  # before its base class, ClientConnectorError
        return ForwardFailure("tls", str(exc)[:200])
    if isinstance(exc, aiohttp.ClientConnectorError):
        return ForwardFailure("connect", type(exc).__name__)
    if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return ForwardFailure("timeout", type(exc).__name__)
    return ForwardFailure("disconnected", type(exc).__name__)


_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError)


class ForwardStream:
    """An open forward: call :meth:`next_reply` until the last one; always :meth:`aclose` it."""

    def __init__(self, response: aiohttp.ClientResponse, netem: Netem,
                 releasing: set[asyncio.Task[None]], address: str | None = None) -> None:
        self._response = response
        self._releasing = releasing  # the client's background reads of finished bodies
        self.completed = False  # the caller saw the final reply: the connection is reusable
        self._chunks = netem.delayed(self._read(), address)  # crossing the link from it
        self._decoder = ReplyDecoder()
        self._ready: deque[ForwardReply] = deque()

    async def _read(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.content.iter_any():
            yield chunk

    async def next_reply(self) -> ForwardReply:
        """The next reply; :class:`ForwardFailure` on timeout, disconnect or garbage."""
        while not self._ready:
            try:
                chunk = await anext(self._chunks)
                self._ready.extend(self._decoder.feed(chunk))
            except StopAsyncIteration:
                raise ForwardFailure("disconnected", "stream ended without a result") from None
            except RemoteProtocolError as exc:
                raise ForwardFailure("bad_response", str(exc)[:200]) from None
            except _TRANSPORT_ERRORS as exc:
                raise _classify(exc) from None
        reply = self._ready.popleft()
        if isinstance(reply, ForwardResult | ForwardError):
            self.completed = True
        return reply

    def close_now(self) -> None:
        """Drop the connection at once (the request was aborted)."""
        self._response.close()

    async def aclose(self) -> None:
        """Finish with the stream. After the final reply the (empty) rest of the body is read
        in the background, so the keep-alive connection goes back to the pool without
        delaying the answer; otherwise the connection is closed."""
        await self._chunks.aclose()  # type: ignore[attr-defined]
        if self.completed and not self._ready:
            _in_background(self._release(), self._releasing)
        else:
            self._response.close()

    async def _release(self) -> None:
        try:
            async with asyncio.timeout(EOF_WAIT_S):
                await self._response.read()
        except (*_TRANSPORT_ERRORS, RuntimeError, asyncio.CancelledError):
            self._response.close()
            return
        self._response.release()


AnyForwardStream = ForwardStream | LinkStream  # one forward's replies, either transport


class PeerClient:
    """Keep-alive HTTP client (aiohttp: ~10x less per-request overhead than httpx here)."""

    def __init__(
        self,
        node_id: str,
        address: str,
        netem: Netem,
        connect_timeout: float,
        forward_timeout: float,
        auth: PeerAuth | None = None,
        use_links: bool = True,
    ) -> None:
        self.node_id = node_id
        self.auth = auth or PeerAuth("", node_id)  # signs every peer message (if keyed)
        self.address = address
        self.netem = netem
        self.connect_timeout = connect_timeout
        self.forward_timeout = forward_timeout
        self._headers = {HEADER_FROM: node_id, HEADER_FROM_ADDRESS: address}
        self._session: aiohttp.ClientSession | None = None
        self._ssl: ssl.SSLContext | None = None
        self.scheme = "http"
        self.gossip_sent = 0
        self.gossip_failed = 0
        self.tls_failed = 0  # gossip and forwards whose TLS handshake failed
        self.connections_opened = 0  # TCP connections to peers (keep-alive reuses them)
        self._releasing: set[asyncio.Task[None]] = set()  # bodies and links being closed
        self.use_links = use_links  # forwards over links (else one POST each)
        self._links: dict[str, PeerLink] = {}  # open links, by peer address
        self._opening: dict[str, asyncio.Future[PeerLink | None]] = {}
        self._without_links: set[str] = set()  # peers that answered 404/405 to a link
        self.links_opened = 0

    def use_tls(self, context: ssl.SSLContext) -> None:
        """Send every peer message over HTTPS with ``context`` (before the first message)."""
        if self._session is not None:
            raise RuntimeError("use_tls() after the first peer message")
        self._ssl = context
        self.scheme = "https"

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # created lazily: a session needs a running event loop
            trace = aiohttp.TraceConfig()
            trace.on_connection_create_end.append(self._opened)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=512, limit_per_host=0,
                                               ssl=self._ssl if self._ssl is not None else True),
                timeout=aiohttp.ClientTimeout(total=None, connect=self.connect_timeout,
                                              sock_read=self.forward_timeout),
                read_bufsize=READ_BUFFER_BYTES,
                trust_env=False,  # never pick up a proxy from the environment
                auto_decompress=False,
                trace_configs=[trace],
            )
        return self._session

    async def _opened(self, *_: object) -> None:
        self.connections_opened += 1

    async def aclose(self) -> None:
        for opening in self._opening.values():
            opening.cancel()
        await asyncio.gather(*(link.aclose() for link in list(self._links.values())),
                             return_exceptions=True)
        for task in self._releasing:  # their connections are closed with the session
            task.cancel()
        if self._session is not None:
            await self._session.close()

    async def send_gossip(self, address: str, payload: bytes, peer_id: str | None) -> bool:
        """Push one gossip message; False if dropped (netem) or failed. Never raises."""
        if self.netem.drop_outgoing(peer_id, address, gossip=True):
            return False
        await self.netem.delay(address)
        headers = {**self._headers, "content-type": "application/octet-stream",
                   **self.auth.headers(GOSSIP_PURPOSE, payload)}
        ok = await self._post_gossip(address, payload, headers)
        if self.netem.duplicate_now():  # the same bytes again, later (a replay, if keyed)
            await self.netem.delay(address)
            await self._post_gossip(address, payload, headers)
        return ok

    async def _post_gossip(self, address: str, payload: bytes, headers: dict[str, str]) -> bool:
        try:
            async with self._client().post(f"{self.scheme}://{address}{GOSSIP_PATH}",
                                           data=payload, headers=headers) as resp:
                await resp.read()
                ok = resp.status < 300
        except _TRANSPORT_ERRORS as exc:
            ok = False
            self.tls_failed += isinstance(exc, aiohttp.ClientSSLError)
        self.gossip_sent += ok
        self.gossip_failed += not ok
        return ok

    async def open_forward(self, address: str, peer_id: str, data: bytes) -> AnyForwardStream:
        """Send an encoded ``ForwardRequest``: on the peer's link (opened if need be), or
        as its own POST, which returns once the response headers arrived."""
        if self.netem.drop_outgoing(peer_id, address, gossip=False):
            raise ForwardFailure("partitioned")
        await self.netem.delay(address)
        if (self.use_links and address not in self._without_links
                and len(data) <= MAX_LINK_REQUEST_BYTES):  # larger: a POST of its own
            link = await self._link_to(address)
            if link is not None:
                token = token_of(self.auth.headers(forward_purpose(LINK_PATH), data))
                return link.start(token, data, self.netem, self.forward_timeout)
        headers = {**self._headers, "content-type": FORWARD_MEDIA_TYPE,
                   **self.auth.headers(forward_purpose(FORWARD_PATH), data)}
        try:
            response = await self._client().post(f"{self.scheme}://{address}{FORWARD_PATH}",
                                                 data=data, headers=headers)
        except _TRANSPORT_ERRORS as exc:
            self.tls_failed += isinstance(exc, aiohttp.ClientSSLError)
            raise _classify(exc) from None
        if response.status != 200:
            raise await _refused(response)
        return ForwardStream(response, self.netem, self._releasing, address)

    async def _link_to(self, address: str) -> PeerLink | None:
        """The open link to ``address``, opened if need be (concurrent forwards share one
        opening); None if the peer has no links. :class:`ForwardFailure` if it cannot open."""
        link = self._links.get(address)
        if link is not None and not link.closed:
            if not link.idle_too_long:
                return link
            del self._links[address]  # its peer may be ending it: a new one instead
            _in_background(link.aclose(), self._releasing)
        opening = self._opening.get(address)
        if opening is None:
            opening = self._opening[address] = asyncio.ensure_future(self._open_link(address))
            opening.add_done_callback(lambda _: self._opening.pop(address, None))
        return await asyncio.shield(opening)

    async def _open_link(self, address: str) -> PeerLink | None:
        link = PeerLink(address, self._link_closed)
        headers = {**self._headers, "content-type": LINK_MEDIA_TYPE,
                   **self.auth.headers(forward_purpose(LINK_PATH), b"")}
        timeout = aiohttp.ClientTimeout(total=None, connect=self.connect_timeout,
                                        sock_read=None)  # a link is silent between forwards

        def post(body: AsyncIterator[bytes]) -> Any:
            return self._client().post(f"{self.scheme}://{address}{LINK_PATH}", data=body,
                                       headers=headers, timeout=timeout)
        try:  # the answer's headers, and the body of a refusal, within the time limit
            async with asyncio.timeout(self.connect_timeout + self.forward_timeout):
                response = await link.open(post)
                if response.status in (404, 405):  # a node from before links
                    response.close()
                    log.info("peer %s has no links: one POST per forward", address)
                    self._without_links.add(address)
                    return None
                if response.status != 200:
                    raise await _refused(response)
        except _TRANSPORT_ERRORS as exc:
            self.tls_failed += isinstance(exc, aiohttp.ClientSSLError)
            raise _classify(exc) from None
        link.run(response)
        self._links[address] = link
        self.links_opened += 1
        return link

    def _link_closed(self, link: PeerLink) -> None:
        if self._links.get(link.address) is link:
            del self._links[link.address]


def _in_background(work: Coroutine[Any, Any, None], tasks: set[asyncio.Task[None]]) -> None:
    """Run ``work`` as a task held in ``tasks`` (a strong reference) until it ends; the
    client cancels what is left there when it closes."""
    task = asyncio.ensure_future(work)
    tasks.add(task)
    task.add_done_callback(tasks.discard)


async def _refused(response: aiohttp.ClientResponse) -> ForwardFailure:
    """A forward's (or a link's) POST answered with a status other than 200: the failure
    ``http_<status>`` with the start of the body; the connection is closed."""
    try:
        detail = (await response.content.read(200)).decode("utf-8", "replace")
    except _TRANSPORT_ERRORS:
        detail = ""
    response.close()
    return ForwardFailure(f"http_{response.status}", detail)
