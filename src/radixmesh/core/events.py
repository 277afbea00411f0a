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
from radixmesh.core.shadow_state import BatchState

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
class QueueChanged:
    """A request joined (``joined``) or left this node's engine queue (waiting or running),
    with its prompt's block hashes. Until it leaves, the node advertises those blocks as held:
    the queue is first come, first served, so a request queued behind one that computes a
    prefix finds it cached; peers that see it send the next request of that prefix here
    instead of computing it a second time while the first is still queued."""

    hashes: tuple[int, ...]
    joined: bool


@dataclass(frozen=True, slots=True)
class LoadChanged:
    """The local engine's current load, as this node measures it."""

    queue_depth: int  # requests waiting or running
    inflight: int  # requests being executed right now
    cache_tokens: int  # tokens currently cached
    cache_budget: int  # cache capacity in tokens
    queue_prompt_tokens: int = 0  # prompt tokens of the requests waiting or running
    queue_output_tokens: int = 0  # their max_tokens (output budgets), summed
    # their prompt tokens not cached when each was queued (what their prefills will compute)
    queue_uncached_tokens: int = 0
    # a batching engine's state from the node's shadow of it (core/shadow.py); None: none
    batch: BatchState | None = None


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
class LeaveRequested:
    """The node is leaving (SIGTERM): from now on it takes no new work — its own client
    requests go to peers (or are rejected), peers' forwards are refused as busy — and it
    tells its peers at once (a gossip round advertising push-back for ``grace_s``). The
    shell lets what is in flight finish within ``grace_s``, then stops."""

    grace_s: float


@dataclass(frozen=True, slots=True)
class EngineStateChanged:
    """The node's engine went down (its process exited, its health probe failed, a request
    found it unreachable) or came back. While down the node takes no new work, as if leaving,
    but reversibly: its own clients' requests go to peers (or are rejected), peers' forwards
    are refused, push-back is advertised; the shell has already dropped its cache index."""

    up: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class SeedsDiscovered:
    """Addresses (``host:port``) to join through, found after start (a DNS name resolved
    again). New ones are seeds, contacted at once and then with backoff until they answer;
    known ones change nothing."""

    addresses: tuple[str, ...]


# ----------------------------------------------------- events of one request's lifecycle
# ``rid`` is the shell's id of a request that entered this node (unique among the requests
# in flight on this node). Events naming a request or peer the lifecycle is not waiting for
# (a timeout that raced a reply, a reply after a cancellation) are stale: counted, ignored.


@dataclass(frozen=True, slots=True)
class RequestArrived:
    """A client request entered this node: the core routes it (``Forward`` or
    ``ExecuteLocally`` comes back)."""

    rid: int
    hashes: tuple[int, ...]  # the prompt's block hashes
    prompt_tokens: int
    local_cached: int  # tokens of the prompt this node's engine holds (exact)
    max_tokens: int
    local_only: bool = False  # hop-limited: a forward from a peer, executed here, never routed
    target: str | None = None  # experiments: try this peer first (fallbacks still apply)
    # False: its sampling is more than the forward protocol carries (penalties,
    # log-probabilities): the core keeps it here
    plain: bool = True
    # samples 2..n of one prompt (``n > 1``): the node that serves its first sample; the core
    # sends them there (they reuse its cached prompt), or keeps them here if that is this node
    sample_of: str | None = None
    # the request's session id (core/sessions.py: a keyed hash of its prompt_cache_key, scoped
    # to its tenant): the node that served it last is preferred
    session: int | None = None
    # the key of the LoRA adapter it names (core/adapters.py): only peers advertising it serve
    adapter: int | None = None
    # its tenant is over its share of this node's queue (core/quotas.py): full here for it
    over_quota: bool = False


@dataclass(frozen=True, slots=True)
class ForwardAccepted:
    """``peer_id`` admitted our forward of ``rid`` (its first reply): it is executing it."""

    rid: int
    peer_id: str
    cached_tokens: int  # the peer's exact match when it admitted the request


@dataclass(frozen=True, slots=True)
class ForwardRefused:
    """``peer_id`` answered our forward of ``rid`` with "busy": it is alive, so not suspect;
    it is skipped for ``retry_after_s`` (0: not at all) as if it had pushed back. ``queue_s``:
    its queue wait, when it refused as slower than our alternative (a fresh report of its
    queue; see ``RefuseForward``)."""

    rid: int
    peer_id: str
    retry_after_s: float
    queue_s: float | None = None


@dataclass(frozen=True, slots=True)
class ForwardFailed:
    """The forward of ``rid`` to ``peer_id`` failed (connect error, silence, disconnect,
    garbage): the peer becomes suspect. ``tokens_so_far`` is how many generated tokens the
    client already received from that peer (the answer continues after them)."""

    rid: int
    peer_id: str
    reason: str
    tokens_so_far: int = 0


@dataclass(frozen=True, slots=True)
class RequestDone:
    """``rid`` finished (its answer is complete, or it failed with ``error``).

    ``forward_overhead_s``: for a request a peer answered, the forwarding overhead —
    client-observed time minus the queue and service time the peer reported (what the network
    and HTTP added).
    ``forward_queue_s``: the queue wait that peer reported (the router learns how far its
    predictions of peers' queues are off: ``WaitError``).
    ``forward_ttft_s``: the time from offering it to that peer until its first token reached
    this node, as the peer's timings place it (the router learns how late a peer's first
    tokens come against its prediction: ``Lateness``).
    """

    rid: int
    forward_overhead_s: float | None = None
    error: str | None = None
    forward_queue_s: float | None = None
    forward_ttft_s: float | None = None


@dataclass(frozen=True, slots=True)
class RequestCancelled:
    """The client of ``rid`` went away: whatever runs for it must stop (an ``Abort`` comes
    back naming what)."""

    rid: int


@dataclass(frozen=True, slots=True)
class ForwardArrived:
    """A peer forwarded a request here (hop limit 1: never routed again). The core admits it
    (``AcceptForward``) or refuses it as busy (``RefuseForward``)."""

    rid: int
    prompt_tokens: int
    cached_tokens: int  # this node's exact match of the prompt
    max_tokens: int
    beat_s: float | None  # the latency we must beat for the forward to pay (None: admit)
    session: int | None = None  # its session id (core/sessions.py): served here if admitted
    over_quota: bool = False  # its tenant is over its share here (core/quotas.py): refused


RequestEvent = (
    RequestArrived
    | ForwardAccepted
    | ForwardRefused
    | ForwardFailed
    | RequestDone
    | RequestCancelled
    | ForwardArrived
)

Event = (
    Tick
    | MessageReceived
    | CacheChanged
    | QueueChanged
    | LoadChanged
    | RequestServed
    | LeaveRequested
    | EngineStateChanged
    | SeedsDiscovered
    | RequestEvent
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


@dataclass(frozen=True, slots=True)
class CoreFailed:
    """The core raised on an event of that type (a bug): count it and log ``error`` (the
    traceback). Only ``NodeCore.serve`` answers this way; ``handle`` raises."""

    event: str
    error: str


# ---------------------------------------------------- actions of one request's lifecycle


@dataclass(frozen=True, slots=True)
class Forward:
    """Send request ``rid`` to ``peer_id`` at ``address`` and report how it went
    (``ForwardAccepted`` / ``ForwardRefused`` / ``ForwardFailed``, then ``RequestDone``)."""

    rid: int
    peer_id: str
    address: str
    beat_s: float | None  # travels with the forward: what the peer must beat (cost routing)
    expected_cached: int  # the router's estimate of the peer's cached prefix
    route: str  # "forwarded" (first choice) | "fallback" (an earlier try failed)
    # what serving it there does to its prefix's copies (the router's ``Tag`` value: hit,
    # first, replica, second_copy, unplaced, local_copy); None: the policy places nothing
    placement: str | None = None
    predicted_ttft_s: float | None = None  # the router's TTFT for it there (None: not priced)


@dataclass(frozen=True, slots=True)
class ExecuteLocally:
    """Run request ``rid`` on this node's engine, continuing after the first ``resume_after``
    generated tokens (already sent to the client by a peer that then failed)."""

    rid: int
    route: str  # "local" (first choice) | "fallback" (a peer was tried first)
    expected_cached: int  # the router's estimate of this node's cached prefix
    resume_after: int = 0
    placement: str | None = None  # as ``Forward.placement``, for this node
    predicted_ttft_s: float | None = None  # as ``Forward.predicted_ttft_s``, for this node


@dataclass(frozen=True, slots=True)
class Abort:
    """Stop what runs for ``rid``: the forward to ``peer_id``, or local work (None)."""

    rid: int
    peer_id: str | None


@dataclass(frozen=True, slots=True)
class AcceptForward:
    """Execute the forwarded request ``rid`` here; tell the sender at once (first byte)."""

    rid: int


@dataclass(frozen=True, slots=True)
class RefuseForward:
    """Answer the forwarded request ``rid`` with "busy, retry after ``retry_after_s``";
    ``queue_s``: this node's queue wait, set when it refuses only because the forward would
    not beat the sender's alternative (then ``retry_after_s`` is 0: it is not busy as such)."""

    rid: int
    retry_after_s: float
    queue_s: float | None = None


@dataclass(frozen=True, slots=True)
class RejectRequest:
    """This node is full (or lacks the adapter ``rid`` names) and no peer took ``rid``:
    answer "overloaded, retry after"."""

    rid: int
    retry_after_s: float
    quota: bool = False  # full for its tenant only (core/quotas.py): the 429 says so


RequestAction = Forward | ExecuteLocally | Abort | AcceptForward | RefuseForward | RejectRequest

Action = Send | Log | PeerStateChanged | CoreFailed | RequestAction
