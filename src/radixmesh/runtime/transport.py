"""The peer transport: the one narrow interface a node's shell sends peer messages through.

Theory of operation
-------------------
A node says two things to a peer, and nothing else crosses the network between nodes::

    send_gossip(address, payload, peer_id) -> bool      fire and forget (False: not sent)
    open_forward(address, peer_id, data)   -> ForwardReplies
        next_reply() ... until ForwardResult | ForwardError     (ForwardFailure on trouble)
        close_now() (abort) | aclose() (always, once done)

``data`` is an encoded ``ForwardRequest`` and the replies are the ``ForwardReply`` messages of
``core/forward_codec`` (first reply ``ForwardAdmitted`` or ``ForwardBusy``, heartbeats, tokens,
the result). Failures are :class:`ForwardFailure` with a reason (``connect``, ``timeout``,
``disconnected``, ``partitioned``, ``bad_response``, ``http_<status>``, ``tls``), which the shell
reports to the core as ``ForwardFailed`` — the core decides what happens next.

Implementations: :class:`radixmesh.runtime.peer_client.PeerClient` (HTTP, with the emulated
network of ``runtime/netem``) and :class:`radixmesh.testing.memtransport.MemoryTransport` (in
memory: the receiving node's handlers are called directly, for tests on a virtual clock). The
receiving side of both is the node's ``receive_gossip`` and ``serve_forward``.
"""

from __future__ import annotations

from typing import Protocol

from radixmesh.core.messages import ForwardReply
from radixmesh.runtime.peer_link import ForwardFailure as ForwardFailure  # one for both

__all__ = ["ForwardFailure", "ForwardReplies", "PeerTransport"]


class ForwardReplies(Protocol):
    """One open forward's replies, in order."""

    async def next_reply(self) -> ForwardReply:
        """The next reply; :class:`ForwardFailure` on timeout, disconnect or garbage."""
        ...

    def close_now(self) -> None:
        """Abort: the peer stops working on it."""
        ...

    async def aclose(self) -> None:
        """Finish with the stream (always called, after the last reply or a failure)."""
        ...


class PeerTransport(Protocol):
    """What a node sends its peers (see the module docstring)."""

    async def send_gossip(self, address: str, payload: bytes, peer_id: str | None) -> bool:
        """Push one gossip message; False if dropped or failed. Never raises."""
        ...

    async def open_forward(self, address: str, peer_id: str, data: bytes) -> ForwardReplies:
        """Send an encoded ``ForwardRequest``; :class:`ForwardFailure` if it cannot."""
        ...

    async def aclose(self) -> None:
        """Release connections (the node stops)."""
        ...
