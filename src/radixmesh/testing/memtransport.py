"""The in-memory peer transport: ``runtime.transport.PeerTransport`` without sockets.

Theory of operation
-------------------
A :class:`MemoryNet` maps addresses to the nodes listening there (anything with the
receiving side of a node: ``receive_gossip(data, from_id, from_address) -> bool`` and
``serve_forward(ForwardRequest) -> AsyncIterator[bytes]``, as ``runtime.node.NodeService``).
Each node sends through its own :class:`MemoryTransport`::

    send_gossip   -> the receiver's receive_gossip, called at once (False: nobody there,
                     or a partition between the two)
    open_forward  -> (after one pass of the event loop: the other work of this instant first)
                     the request decoded as the receiver's HTTP handler decodes it, then the
                     receiver's serve_forward generator; its bytes go through the same
                     ``ReplyDecoder`` as on the wire, so replies, failures and their reasons
                     (``connect``, ``partitioned``, ``disconnected``, ``bad_response``) are the
                     ones the shell sees from HTTP

Which messages arrive is the core's in-memory network's to say (:class:`~radixmesh.core.link.
Wire`, as for the simulator and :class:`~radixmesh.testing.fakenet.FakeNetwork`): partitions
cut gossip and forwards, a lossy link loses gossip (forwards ride on a stream that retransmits).
Nothing here sleeps or reads a clock: what arrives arrives at once, in order, so a test that
drives the nodes on a virtual clock owns all of time (the link's delays are not waited).
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import AsyncIterator, Iterable
from typing import Any, Protocol

from radixmesh.core.codec import RemoteProtocolError
from radixmesh.core.forward_codec import ReplyDecoder, decode_forward_request
from radixmesh.core.link import LinkConfig, Wire
from radixmesh.core.messages import ForwardError, ForwardReply, ForwardRequest, ForwardResult

__all__ = ["MemoryNet", "MemoryReplies", "MemoryTransport", "TransportFailure"]


class TransportFailure(Exception):
    """Raised as the runtime's ``ForwardFailure`` (``reason``, ``detail``): ``MemoryNet``
    is given that class, so that this module imports nothing above the core."""


class Receiver(Protocol):
    def receive_gossip(self, data: bytes, from_id: str | None,
                       from_address: str | None) -> bool: ...
    def serve_forward(self, req: ForwardRequest) -> AsyncIterator[bytes]: ...


class MemoryNet:
    """Who listens where, and who is cut off from whom."""

    def __init__(self, failure: type[Exception] = TransportFailure,
                 link: LinkConfig | None = None, seed: int = 0) -> None:
        self.failure = failure  # the exception open_forward raises (reason, detail)
        self.receivers: dict[str, Receiver] = {}
        every = link or LinkConfig()  # the link between every two addresses
        self.wire: Wire[str] = Wire(random.Random(seed), lambda a, b: every)
        self.gossip_delivered = 0
        self.forwards_opened = 0

    def listen(self, address: str, receiver: Receiver) -> None:
        self.receivers[address] = receiver

    def stop_listening(self, address: str) -> None:
        self.receivers.pop(address, None)

    def partition(self, *groups: Iterable[str]) -> None:
        """Addresses in different groups cannot reach each other (unnamed: one more group)."""
        self.wire.partition(*groups)

    def heal(self) -> None:
        self.wire.heal()

    def transport(self, node_id: str, address: str) -> MemoryTransport:
        return MemoryTransport(self, node_id, address)


class MemoryTransport:
    """One node's sending side (``runtime.transport.PeerTransport``)."""

    def __init__(self, net: MemoryNet, node_id: str, address: str) -> None:
        self.net, self.node_id, self.address = net, node_id, address
        self._open: set[MemoryReplies] = set()

    async def send_gossip(self, address: str, payload: bytes, peer_id: str | None) -> bool:
        net = self.net
        receiver = net.receivers.get(address)
        if receiver is None or not net.wire.copies(self.address, address):
            return False  # nobody there, partitioned or lost
        ok = receiver.receive_gossip(payload, self.node_id, self.address)
        net.gossip_delivered += ok
        return ok

    async def open_forward(self, address: str, peer_id: str, data: bytes) -> MemoryReplies:
        await asyncio.sleep(0)  # on the wire: what else happens now happens first
        net = self.net
        if net.wire.separated(self.address, address):
            raise net.failure("partitioned", "")
        receiver = net.receivers.get(address)
        if receiver is None:
            raise net.failure("connect", f"nothing listens at {address}")
        try:
            req = decode_forward_request(data)
        except RemoteProtocolError as exc:  # the HTTP handler answers 400
            raise net.failure("http_400", str(exc)[:200]) from None
        net.forwards_opened += 1
        replies = MemoryReplies(receiver.serve_forward(req), net.failure)
        self._open.add(replies)
        return replies

    async def aclose(self) -> None:
        await asyncio.gather(*(r.aclose() for r in list(self._open)), return_exceptions=True)
        self._open.clear()


class MemoryReplies:
    """The replies of one forward (``runtime.transport.ForwardReplies``)."""

    def __init__(self, frames: AsyncIterator[bytes], failure: type[Exception]) -> None:
        self._frames: Any = frames  # an async generator: aclose() ends the receiver's work
        self._failure = failure
        self._decoder = ReplyDecoder()
        self._ready: deque[ForwardReply] = deque()
        self._closing: asyncio.Task[None] | None = None

    async def next_reply(self) -> ForwardReply:
        while not self._ready:
            if self._closing is not None:
                raise self._failure("disconnected", "closed")
            try:
                chunk = await anext(self._frames)
            except StopAsyncIteration:
                raise self._failure("disconnected", "stream ended without a result") from None
            try:
                self._ready.extend(self._decoder.feed(chunk))
            except RemoteProtocolError as exc:
                raise self._failure("bad_response", str(exc)[:200]) from None
        reply = self._ready.popleft()
        if isinstance(reply, ForwardResult | ForwardError):
            await self.aclose()
        return reply

    def close_now(self) -> None:
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._frames.aclose())

    async def aclose(self) -> None:
        self.close_now()
        assert self._closing is not None
        await self._closing
