"""Every message peers exchange, as frozen slotted dataclasses (encoded by :mod:`codec`).

The one gossip message, :class:`Gossip`, holds a node's own state plus what it knows of
others. A node is the single writer of its own state ``(incarnation, version)``; everything a
receiver holds about it is a read-only estimate, ordered by::

    incarnation (grows across restarts)  >  version (grows with each cache change)
                                          >  stamp   (sender's own clock; orders load reports)

so an older, duplicated or reordered message can never regress an estimate.

Summaries of a cache travel as either a :class:`Snapshot` (the whole set of block hashes) or a
:class:`Delta` (the per-version change entries after ``base``; the receiver applies the entries
whose version is above the one it holds, so a delta overlapping what it already has is fine).

Forwarding: the entry node sends one :class:`ForwardRequest`; the serving peer answers with a
stream of :data:`ForwardReply` messages, in this grammar::

    replies := ForwardBusy
             | ForwardAdmitted (ForwardTokens | ForwardHeartbeat)* (ForwardResult | ForwardError)

Busy: the peer refuses (queue at its push-back threshold, or it would not beat ``beat_s``) and
the sender falls back at once. Accepted is the first byte of an accepted forward; heartbeats
keep a long queue from looking like a dead peer; tokens come only when ``stream`` is set. The
codec frames and checks each reply; enforcing this order is the caller's job. Forward messages
validate their values on construction (``ValueError``), so a decoded message is a valid one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from radixmesh.core.adapters import Adapter
from radixmesh.core.blocks import Fingerprint
from radixmesh.core.estimators import SpeedReport
from radixmesh.core.shadow_state import BatchState

MAX_NAMESPACE_CHARS = 256
# 2: Load.speed_measured_at; 3: address and fingerprint on first contact only, utilization in
# whole percent (gossip under 1 KB/s per node: docs/benchmarks.md); ForwardRequest namespace,
# session, adapter and tenant (a keyed hash: core/quotas.py); Gossip.sessions, adapters and
# adapter_names; Load.batch (a batching engine's state)
PROTOCOL_VERSION = 3


@dataclass(frozen=True, slots=True)
class Load:
    """A node's own load and speed, as it measures them (never a router-side counter)."""

    queue_depth: int  # requests waiting or running
    inflight: int  # requests executing right now
    cache_tokens: int  # tokens cached
    cache_budget: int  # cache capacity in tokens
    speed: SpeedReport | None  # measured speed; None: unchanged since the last one sent
    pushback_s: float | None = None  # "back off for this long from when you receive this"
    utilization: float = 0.0  # recent busy fraction in [0, 1] (router's bounded-load rule)
    # its clock (as ``stamp``) when it last measured its speed itself, serving a request; None:
    # never (its speed is the configured prior or one adopted from its peers, which a peer
    # must not take for a measurement: an adopted stale speed then spread as fresh)
    speed_measured_at: float | None = None
    # a batching engine's step-time coefficients and current batch, from the node's shadow
    # of it (core/shadow_state.py: what a peer needs to predict its TTFT); None: not known
    batch: BatchState | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The complete set of a node's block hashes at ``version`` (sorted ascending)."""

    version: int
    hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Change:
    """What one version changed: ``removed`` is applied before ``added``."""

    version: int
    added: tuple[int, ...]
    removed: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Delta:
    """The change entries ``base+1 .. version`` (consecutive versions, ascending)."""

    base: int
    changes: tuple[Change, ...]

    @property
    def version(self) -> int:
        return self.changes[-1].version if self.changes else self.base


Summary = Snapshot | Delta


@dataclass(frozen=True, slots=True)
class Ack:
    """The receiver's state that the sender holds: lets the receiver send only what is new."""

    incarnation: int
    version: int


@dataclass(frozen=True, slots=True)
class Echo:
    """RTT without clock sync: the receiver's last ``stamp`` and how long the sender held it."""

    stamp: float  # the destination's own clock, as it sent it
    held_s: float  # time between receiving that stamp and sending this message


@dataclass(frozen=True, slots=True)
class PeerAddress:
    node_id: str
    address: str


@dataclass(frozen=True, slots=True)
class DigestEntry:
    """What the sender knows of one node (epidemic mode): only newer state needs to travel."""

    node_id: str
    incarnation: int
    version: int | None  # None: the sender holds no summary of that node
    heartbeat: int  # that node's round counter: liveness that travels through relays


@dataclass(frozen=True, slots=True)
class NodeState:
    """Another node's state relayed by the sender (epidemic mode)."""

    node_id: str
    address: str
    incarnation: int
    heartbeat: int
    stamp: float  # the origin's clock when its load was reported (orders load only)
    load: Load | None
    summary: Summary | None


@dataclass(frozen=True, slots=True)
class Gossip:
    """One anti-entropy message: the sender's own state, plus membership and relays."""

    sender: str
    # the sender's identity, address and Fingerprint.digest (model + tokenizer + block size):
    # sent until the receiver acknowledges this incarnation, and every
    # ``ExchangeConfig.identity_every`` messages; None otherwise (the receiver knows them)
    address: str | None
    incarnation: int
    version: int  # the sender's current state version
    heartbeat: int  # the sender's round counter (this incarnation)
    fingerprint: int | None  # (see ``address``)
    stamp: float  # the sender's own clock when sending (never compared with ours)
    load: Load
    summary: Summary | None = None  # the sender's cache: snapshot, delta or nothing new
    fingerprint_detail: Fingerprint | None = None  # full fingerprint (first contact, snapshots)
    ack: Ack | None = None  # which of the receiver's states the sender holds
    echo: Echo | None = None
    peers: tuple[PeerAddress, ...] = ()  # membership: other nodes the sender knows
    digest: tuple[DigestEntry, ...] = ()  # epidemic: what the sender knows of others
    relays: tuple[NodeState, ...] = ()  # epidemic: others' state the receiver lacks
    reply: bool = False  # the sender asks for an immediate answer (join, push-pull)
    sessions: tuple[int, ...] = ()  # session ids the sender served lately (core/sessions.py)
    adapters: tuple[int, ...] = ()  # keys of the LoRA adapters it serves (core/adapters.py)
    # their served names and digests: sent with the identity (see ``address``)
    adapter_names: tuple[Adapter, ...] = ()


# --------------------------------------------------------------------------- forwarding

TOKEN_ID_LIMIT = 2**32  # token ids are in [0, TOKEN_ID_LIMIT)
MAX_ERROR_CHARS = 512  # ForwardError.message, at most
FINISH_REASONS = frozenset({"stop", "length"})
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch's generator and msgpack both hold


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def _in_range(x: float, lo: float, hi: float) -> bool:
    return math.isfinite(x) and lo <= x <= hi


def _check_ids(ids: tuple[int, ...], what: str) -> None:
    _require(not ids or (min(ids) >= 0 and max(ids) < TOKEN_ID_LIMIT),
             f"{what}: token ids must be in [0, 2**32)")


HEARTBEAT_MIN_S, HEARTBEAT_MAX_S = 0.01, 60.0  # a forward's heartbeat period, seconds


@dataclass(frozen=True, slots=True)
class ForwardRequest:
    """A request forwarded for execution on the receiver (never routed again)."""

    prompt: tuple[int, ...]  # token ids, non-empty
    max_tokens: int  # >= 1
    temperature: float = 0.0  # >= 0; 0 = greedy
    top_p: float = 1.0  # in (0, 1]
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # besides the tokenizer's EOS
    stream: bool = False  # send ForwardTokens as they are generated
    heartbeat_s: float = 0.5  # in [0.01, 60]: the longest silence before a ForwardHeartbeat
    beat_s: float | None = None  # in [-3600, 3600]: predicted latency to beat; None: no condition
    namespace: str | None = None  # the cache namespace (core/tenants.py), 1..256 characters
    session: int | None = None  # the session id (core/sessions.py), a u64
    adapter: str | None = None  # the content digest of its LoRA adapter (core/adapters.py)
    tenant: str | None = None  # its tenant's quota key (a keyed hash, core/quotas.py)

    def __post_init__(self) -> None:
        _require(len(self.prompt) >= 1, "prompt must not be empty")
        _check_ids(self.prompt, "prompt")
        _check_ids(self.stop_token_ids, "stop_token_ids")
        _require(self.max_tokens >= 1, "max_tokens must be >= 1")
        _require(_in_range(self.temperature, 0.0, math.inf), "temperature must be finite, >= 0")
        _require(_in_range(self.top_p, 0.0, 1.0) and self.top_p > 0, "top_p must be in (0, 1]")
        _require(self.seed is None or SEED_MIN <= self.seed <= SEED_MAX, "seed out of range")
        _require(_in_range(self.heartbeat_s, HEARTBEAT_MIN_S, HEARTBEAT_MAX_S),
                 "heartbeat_s must be in [0.01, 60]")
        _require(self.beat_s is None or _in_range(self.beat_s, -3600.0, 3600.0),
                 "beat_s must be in [-3600, 3600]")
        _require(self.session is None or 0 <= self.session < 2**64, "session must be a u64")
        _require(self.adapter is None or 16 <= len(self.adapter) <= 64, "adapter: a digest")
        _require(self.namespace is None or 1 <= len(self.namespace) <= MAX_NAMESPACE_CHARS,
                 f"namespace must have 1..{MAX_NAMESPACE_CHARS} characters")
        _require(self.tenant is None or 1 <= len(self.tenant) <= MAX_NAMESPACE_CHARS,
                 f"tenant must have 1..{MAX_NAMESPACE_CHARS} characters")


@dataclass(frozen=True, slots=True)
class ForwardBusy:
    """The receiver refuses the forward; the sender should not retry it for ``retry_after_s``.
    ``queue_s``: the receiver's queue wait, when it refused because serving the request would
    not beat the sender's alternative (``beat_s``) rather than because of its state (None)."""

    node_id: str
    retry_after_s: float
    queue_s: float | None = None

    def __post_init__(self) -> None:
        _require(bool(self.node_id), "node_id must not be empty")
        _require(_in_range(self.retry_after_s, 0.0, math.inf), "retry_after_s must be >= 0")
        _require(self.queue_s is None or _in_range(self.queue_s, 0.0, math.inf),
                 "queue_s must be >= 0 (or None)")


@dataclass(frozen=True, slots=True)
class ForwardAdmitted:
    """The receiver will execute the forward; ``cached_tokens`` of the prompt are cached there."""

    node_id: str
    cached_tokens: int

    def __post_init__(self) -> None:
        _require(bool(self.node_id), "node_id must not be empty")
        _require(self.cached_tokens >= 0, "cached_tokens must be >= 0")


@dataclass(frozen=True, slots=True)
class ForwardHeartbeat:
    """Still working (queued or prefilling): resets the sender's silence timeout."""


@dataclass(frozen=True, slots=True)
class ForwardTokens:
    """Newly generated token ids (streamed forwards only)."""

    ids: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_ids(self.ids, "ids")


@dataclass(frozen=True, slots=True)
class ForwardResult:
    """The forward's outcome, with the serving node's own timings (final reply)."""

    output_ids: tuple[int, ...]  # every generated id (also those already streamed)
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    cached_tokens: int  # what the serving engine actually reused
    queue_s: float  # time queued on the serving node
    service_s: float  # its service time, queue excluded
    handler_s: float  # its total handling time, from receipt to this reply
    # from receipt to its first token (None: a peer that does not say): the sender's measure
    # of the TTFT it met there, streamed or not (``Lateness``)
    first_token_s: float | None = None

    def __post_init__(self) -> None:
        _check_ids(self.output_ids, "output_ids")
        _require(self.finish_reason in FINISH_REASONS, "finish_reason must be stop or length")
        _require(min(self.prompt_tokens, self.cached_tokens) >= 0, "token counts must be >= 0")
        for x in (self.queue_s, self.service_s, self.handler_s,
                  0.0 if self.first_token_s is None else self.first_token_s):
            _require(_in_range(x, 0.0, math.inf), "timings must be finite and >= 0")


def busy_reply(node_id: str, retry_after_s: float, queue_s: float | None) -> ForwardBusy:
    """A refusal as the wire carries it: the retry-after to the millisecond, the queue wait
    to 0.1 ms. The simulator passes its refusals through this too, so that a sender's core
    learns the same numbers in both shells (``Lateness`` adds them up)."""
    return ForwardBusy(node_id, round(retry_after_s, 3),
                       None if queue_s is None else round(queue_s, 4))


@dataclass(frozen=True, slots=True)
class ForwardError:
    """The receiver accepted but could not execute the forward (final reply)."""

    message: str  # at most MAX_ERROR_CHARS characters

    def __post_init__(self) -> None:
        _require(len(self.message) <= MAX_ERROR_CHARS, "error message too long")

    @classmethod
    def truncated(cls, message: str) -> ForwardError:
        """An error carrying ``message`` cut to ``MAX_ERROR_CHARS`` characters."""
        return cls(message[:MAX_ERROR_CHARS])


ForwardReply = (
    ForwardBusy | ForwardAdmitted | ForwardHeartbeat | ForwardTokens | ForwardResult | ForwardError
)
"""Any reply to a :class:`ForwardRequest`; see the module docstring for their order."""
