"""Inputs to and outputs from :class:`radixmesh.core.node.NodeCore`.

The shells (asyncio runtime, discrete-event simulator) turn what happens to them into
*events*, hand them to ``NodeCore.handle(event, now)``, and carry out the *actions* it
returns. Only the shells own a clock, sockets or threads; ``now`` is seconds on the shell's
clock (monotonic for the runtime, virtual for the simulator) and is never compared across
nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixmesh.core.messages import Gossip

# ----------------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Tick:
    """Timers may be due: gossip rounds, failure detection. Deliver at ``next_deadline()``."""


@dataclass(frozen=True, slots=True)
class MessageReceived:
    """Raw bytes of a peer message (gossip). Decoding and validation happen in the core.

    ``message`` is for in-process transports only (the simulator): the decoded message the
    sender's :class:`Send` carried, which the core then applies without decoding ``data``
    again. It is trusted, so a shell fed by a network never sets it.
    """

    data: bytes
    source: str | None = None  # transport-level sender address, informational only
    message: Gossip | None = None


@dataclass(frozen=True, slots=True)
class CacheChanged:
    """The local engine's cache gained / lost these block hashes (single writer: this node)."""

    added: tuple[int, ...]
    removed: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LoadChanged:
    """The local engine's current load, as this node measures it."""

    queue_depth: int  # requests waiting or running
    inflight: int  # requests being executed right now
    cache_tokens: int  # tokens currently cached
    cache_budget: int  # cache capacity in tokens


@dataclass(frozen=True, slots=True)
class RequestServed:
    """A request finished on the local engine: feeds this node's own speed estimates."""

    prompt_tokens: int
    cached_tokens: int
    prefill_s: float
    decode_tokens: int
    decode_s: float
    service_s: float  # prefill + decode + engine overhead, queue wait excluded


@dataclass(frozen=True, slots=True)
class ForwardSucceeded:
    """A forward to ``peer_id`` returned a response.

    ``rtt_s`` is the forwarding overhead: client-observed time minus the remote service and
    queue time the peer reported, i.e. what the network and HTTP added.
    """

    peer_id: str
    hashes: tuple[int, ...]  # the request's block hashes (optimistic insert into the view)
    rtt_s: float


@dataclass(frozen=True, slots=True)
class ForwardFailed:
    """A forward to ``peer_id`` failed or timed out: the peer becomes suspect."""

    peer_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class ForwardRefused:
    """``peer_id`` answered a forward with "busy" (``NodeCore.admits_forward`` said no): it is
    alive, so not suspect; it is skipped for ``retry_after_s`` (0: not at all) as if it had
    pushed back."""

    peer_id: str
    retry_after_s: float


Event = (
    Tick
    | MessageReceived
    | CacheChanged
    | LoadChanged
    | RequestServed
    | ForwardSucceeded
    | ForwardFailed
    | ForwardRefused
)

# ---------------------------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class Send:
    """Deliver ``payload`` (an encoded peer message) to the node listening at ``address``."""

    address: str
    payload: bytes
    peer_id: str | None = None  # None while the peer is known only as a seed address
    message: Gossip | None = None  # what ``payload`` encodes (immutable; for in-process shells)


@dataclass(frozen=True, slots=True)
class Log:
    level: str  # "debug" | "info" | "warning" | "error"
    message: str


@dataclass(frozen=True, slots=True)
class PeerStateChanged:
    peer_id: str
    old: str  # membership state names: "alive" | "suspect" | "dead"
    new: str


Action = Send | Log | PeerStateChanged
