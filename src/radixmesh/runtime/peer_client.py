"""HTTP client for peer messages: gossip pushes and forwarded requests (through netem).

Theory of operation
-------------------
One ``httpx.AsyncClient`` with keep-alive connections per peer. Gossip is fire-and-forget: a
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

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from radixmesh.runtime.netem import Netem
from radixmesh.runtime.peer_auth import GOSSIP_PURPOSE, PeerAuth, forward_purpose

FORWARD_PATH = "/peer/forward"
GOSSIP_PATH = "/peer/gossip"
HEADER_FROM = "x-radixmesh-from"  # sender's node id
HEADER_FROM_ADDRESS = "x-radixmesh-from-address"  # sender's host:port
MAX_EVENT_BYTES = 16 * 1024 * 1024


class ForwardError(Exception):
    """A forward did not produce a usable response; ``reason`` is a short metric label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class ForwardStream:
    """An open forward: iterate :meth:`events`; always :meth:`aclose` it."""

    def __init__(self, response: httpx.Response, netem: Netem) -> None:
        self._response = response
        self._events = self._decode(netem.delayed(self._chunks()))

    async def _chunks(self) -> AsyncIterator[bytes]:
        async for line in self._response.aiter_lines():
            if line:
                yield line.encode()

    @staticmethod
    async def _decode(lines: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
        async for raw in lines:
            if len(raw) > MAX_EVENT_BYTES:
                raise ForwardError("bad_response", "event too large")
            try:
                event = json.loads(raw)
            except json.JSONDecodeError as exc:
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
        except httpx.TimeoutException as exc:
            raise ForwardError("timeout", type(exc).__name__) from None
        except httpx.HTTPError as exc:
            raise ForwardError("disconnected", type(exc).__name__) from None

    async def aclose(self) -> None:
        await self._events.aclose()  # type: ignore[attr-defined]
        await self._response.aclose()


class PeerClient:
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
        self._client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=64),
            timeout=self._timeout(),
            trust_env=False,  # never pick up a proxy from the environment: peers are direct
        )
        self.gossip_sent = 0
        self.gossip_failed = 0

    def _timeout(self) -> httpx.Timeout:
        t = self.forward_timeout
        return httpx.Timeout(connect=self.connect_timeout, read=t, write=t, pool=t)

    async def aclose(self) -> None:
        await self._client.aclose()

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
            resp = await self._client.post(
                f"http://{address}{GOSSIP_PATH}", content=payload, headers=headers
            )
        except httpx.HTTPError:
            self.gossip_failed += 1
            return False
        ok = resp.status_code < 300
        self.gossip_sent += ok
        self.gossip_failed += not ok
        return ok

    async def open_forward(
        self, address: str, peer_id: str, body: dict[str, object]
    ) -> ForwardStream:
        """Send a forward and wait for its first byte (the ``accepted`` event is read later)."""
        if self.netem.drop_outgoing(peer_id, address, gossip=False):
            raise ForwardError("partitioned")
        await self.netem.delay()
        content = json.dumps(body, separators=(",", ":")).encode()
        request = self._client.build_request(
            "POST",
            f"http://{address}{FORWARD_PATH}",
            content=content,
            headers={**self._headers, "content-type": "application/json",
                     **self.auth.headers(forward_purpose(FORWARD_PATH), content)},
        )
        try:
            response = await self._client.send(request, stream=True)
        except httpx.ConnectError as exc:
            raise ForwardError("connect", type(exc).__name__) from None
        except httpx.TimeoutException as exc:
            raise ForwardError("timeout", type(exc).__name__) from None
        except httpx.HTTPError as exc:
            raise ForwardError("disconnected", type(exc).__name__) from None
        if response.status_code != 200:
            detail = (await response.aread())[:200].decode("utf-8", "replace")
            await response.aclose()
            raise ForwardError(f"http_{response.status_code}", detail)
        return ForwardStream(response, self.netem)
