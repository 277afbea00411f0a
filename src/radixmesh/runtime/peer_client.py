"""HTTP client for peer messages: gossip pushes and forwarded requests (through netem).

Theory of operation
-------------------
One ``aiohttp`` session with keep-alive connections per peer. Gossip is fire-and-forget: a
failed push is only counted (silence is what the core's failure detector reads). A forward is
a streamed ``POST /peer/forward`` whose response is newline-delimited JSON events::

    {"t": "accepted", ...}          sent at once by the receiver: the *first byte*
    {"t": "hb"}                     heartbeats while the request queues or prefills
    {"t": "tok", "ids": [...]}      generated tokens (only when the client streams)
    {"t": "done", "result": {...}}  the engine's result and the receiver's handling time
    {"t": "error", "message": ...}  the receiver could not execute it

Timeouts: ``connect_timeout`` on the TCP connect, ``forward_timeout`` on the first byte *and*
on every silence after it (heartbeats keep a long queue from looking like a dead peer), so a
killed, hung or partitioned peer is detected within about one ``forward_timeout``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from radixmesh.runtime.netem import Netem
from radixmesh.runtime.peer_auth import GOSSIP_PURPOSE, PeerAuth, forward_purpose

FORWARD_PATH = "/peer/forward"
GOSSIP_PATH = "/peer/gossip"
HEADER_FROM = "x-radixmesh-from"  # sender's node id
HEADER_FROM_ADDRESS = "x-radixmesh-from-address"  # sender's host:port
MAX_EVENT_BYTES = 16 * 1024 * 1024  # one NDJSON event (a long output's token list), at most
EOF_WAIT_S = 0.5  # after the final event, wait this long for the end of the body


class ForwardError(Exception):
    """A forward did not produce a usable response; ``reason`` is a short metric label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _classify(exc: BaseException) -> ForwardError:
    if isinstance(exc, ForwardError):
        return exc
    if isinstance(exc, aiohttp.ClientConnectorError):
        return ForwardError("connect", type(exc).__name__)
    if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return ForwardError("timeout", type(exc).__name__)
    return ForwardError("disconnected", type(exc).__name__)


_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError)


class ForwardStream:
    """An open forward: call :meth:`next_event` until ``done``; always :meth:`aclose` it."""

    def __init__(self, response: aiohttp.ClientResponse, netem: Netem) -> None:
        self._response = response
        self.completed = False  # the caller saw the final event: the connection is reusable
        self._relayed = netem.delayed(self._lines())
        self._events = self._decode(self._relayed)

    async def _lines(self) -> AsyncIterator[bytes]:
        while True:
            line = await self._response.content.readline()
            if not line:
                return
            if line.strip():
                yield line

    @staticmethod
    async def _decode(lines: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
        async for raw in lines:
            try:
                event = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ForwardError("bad_response", str(exc)) from None
            if not isinstance(event, dict) or not isinstance(event.get("t"), str):
                raise ForwardError("bad_response", "event without a type")
            yield event

    async def next_event(self) -> dict[str, Any]:
        """The next event; :class:`ForwardError` on timeout, disconnect or garbage."""
        try:
            return await anext(self._events)
        except StopAsyncIteration:
            raise ForwardError("disconnected", "stream ended without a result") from None
        except _TRANSPORT_ERRORS as exc:
            raise _classify(exc) from None

    async def aclose(self) -> None:
        """Finish with the stream. After a ``done`` event the (empty) rest of the body is read,
        so the keep-alive connection goes back to the pool; otherwise it is closed."""
        await self._events.aclose()  # type: ignore[attr-defined]
        await self._relayed.aclose()  # type: ignore[attr-defined]  # (closing one won't)
        if self.completed:
            try:
                await asyncio.wait_for(self._response.read(), EOF_WAIT_S)
            except (*_TRANSPORT_ERRORS, RuntimeError):
                self._response.close()
                return
            self._response.release()
        else:
            self._response.close()


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
    ) -> None:
        self.node_id = node_id
        self.auth = auth or PeerAuth("", node_id)  # signs every peer message (if keyed)
        self.address = address
        self.netem = netem
        self.connect_timeout = connect_timeout
        self.forward_timeout = forward_timeout
        self._headers = {HEADER_FROM: node_id, HEADER_FROM_ADDRESS: address}
        self._session: aiohttp.ClientSession | None = None
        self.gossip_sent = 0
        self.gossip_failed = 0

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # created lazily: a session needs a running event loop
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=512, limit_per_host=0),
                timeout=aiohttp.ClientTimeout(total=None, connect=self.connect_timeout,
                                              sock_read=self.forward_timeout),
                read_bufsize=MAX_EVENT_BYTES,
                trust_env=False,  # never pick up a proxy from the environment
                auto_decompress=False,
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def send_gossip(self, address: str, payload: bytes, peer_id: str | None) -> bool:
        """Push one gossip message; False if dropped (netem) or failed. Never raises."""
        if self.netem.drop_outgoing(peer_id, address, gossip=True):
            return False
        await self.netem.delay()
        headers = {**self._headers, "content-type": "application/octet-stream",
                   **self.auth.headers(GOSSIP_PURPOSE, payload)}
        ok = await self._post_gossip(address, payload, headers)
        if self.netem.duplicate_now():  # the same bytes again, later (a replay, if keyed)
            await self.netem.delay()
            await self._post_gossip(address, payload, headers)
        return ok

    async def _post_gossip(self, address: str, payload: bytes, headers: dict[str, str]) -> bool:
        try:
            async with self._client().post(f"http://{address}{GOSSIP_PATH}", data=payload,
                                           headers=headers) as resp:
                await resp.read()
                ok = resp.status < 300
        except _TRANSPORT_ERRORS:
            ok = False
        self.gossip_sent += ok
        self.gossip_failed += not ok
        return ok

    async def open_forward(
        self, address: str, peer_id: str, body: dict[str, object]
    ) -> ForwardStream:
        """Send a forward; returns once the response headers arrived (first byte)."""
        if self.netem.drop_outgoing(peer_id, address, gossip=False):
            raise ForwardError("partitioned")
        await self.netem.delay()
        data = json.dumps(body, separators=(",", ":")).encode()
        headers = {**self._headers, "content-type": "application/json",
                   **self.auth.headers(forward_purpose(FORWARD_PATH), data)}
        try:
            response = await self._client().post(f"http://{address}{FORWARD_PATH}", data=data,
                                                 headers=headers)
        except _TRANSPORT_ERRORS as exc:
            raise _classify(exc) from None
        if response.status != 200:
            try:
                detail = (await response.content.read(200)).decode("utf-8", "replace")
            except _TRANSPORT_ERRORS:
                detail = ""
            response.release()
            raise ForwardError(f"http_{response.status}", detail)
        return ForwardStream(response, self.netem)
