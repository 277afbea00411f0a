"""Configuration of a node's core, one frozen dataclass per subsystem, validated on creation.

Presets follow memberlist's habit: ``GossipConfig.lan()`` and ``GossipConfig.wan()``. Every tuning
constant of the gossip layer is a field here (nested: ``membership``, ``exchange``, ``epidemic``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from radixmesh.core.adapters import Adapter
from radixmesh.core.blocks import Fingerprint
from radixmesh.core.estimators import CostPriors
from radixmesh.core.messages import HEARTBEAT_MAX_S, HEARTBEAT_MIN_S
from radixmesh.core.router_config import RouterConfig
from radixmesh.core.sessions import SessionConfig
from radixmesh.core.units import parse_choice


class GossipMode(StrEnum):
    SNAPSHOT = "snapshot"  # every round carries the full set of block hashes (the paper's)
    DELTA = "delta"  # changes since the receiver's last acknowledged version (default)
    EPIDEMIC = "epidemic"  # delta to `fanout` random peers, relaying what we know of others

    @classmethod
    def parse(cls, text: str) -> GossipMode:
        return parse_choice(cls, text, "gossip mode")


@dataclass(frozen=True, slots=True)
class MembershipConfig:
    """Failure detection's bounds and cadences (core/failure.py); counts are rounds or messages."""

    max_members: int = 8192  # known nodes, at most: ids beyond this are ignored (a member flood)
    max_refused: int = 4096  # peers refused for a foreign fingerprint remembered (one log each)
    peer_sample: int = 4  # peers named in a periodic membership sample
    sample_every: int = 8  # messages to one peer between membership samples
    dead_probe_every: int = 8  # rounds between messages to dead peers (finds healed partitions)
    seed_every: int = 10  # rounds between seed contacts once an alive peer is known

    def __post_init__(self) -> None:
        counts = (self.max_members, self.max_refused, self.peer_sample, self.sample_every,
                  self.dead_probe_every, self.seed_every)  # fmt: skip
        if min(counts) < 1:
            raise ValueError("membership bounds and cadences must be >= 1")


@dataclass(frozen=True, slots=True)
class ExchangeConfig:
    """What rides on every message between two peers (core/dissemination.py)."""

    resend_after_rounds: float = 2.5  # delta: unacknowledged changes are re-sent after this
    echo_every: int = 8  # messages to one peer between RTT echoes
    max_rtt_s: float = 60.0  # echoes implying a longer round trip are ignored
    speed_every: int = 16  # messages to one peer between unconditional speed reports
    speed_change: float = 0.05  # relative change of a speed figure worth reporting at once
    # messages to one peer between repeats of our address and fingerprint (sent until it
    # acknowledges us; a repeat lets a peer that forgot us without saying so take us back)
    identity_every: int = 16
    max_retry_after_s: float = 60.0  # a "busy" answer asking for a longer back-off is ignored

    def __post_init__(self) -> None:
        if self.resend_after_rounds <= 0 or self.max_rtt_s <= 0 or self.max_retry_after_s <= 0:
            raise ValueError("resend_after_rounds, max_rtt_s and max_retry_after_s must be > 0")
        if self.echo_every < 1 or self.speed_every < 1 or self.identity_every < 1:
            raise ValueError("echo_every, speed_every and identity_every must be >= 1")
        if self.speed_change < 0:
            raise ValueError("speed_change must be >= 0")


@dataclass(frozen=True, slots=True)
class EpidemicConfig:
    """Epidemic mode's digests, rumors and relays (core/epidemic.py); all bound work or memory."""

    digest_full: int = 64  # up to this many known nodes, every digest lists them all
    digest_sample: int = 48  # ... beyond that, a random sample of this many (plus recent changes)
    max_rumors: int = 16  # recent changes (and first-hand beats) named in one digest, at most
    rumor_sends: int = 3  # messages that push a node's changed state unasked (at least; ln N)
    max_recent: int = 64  # changed nodes with rumor sends left (oldest dropped: digests repair)
    max_knows: int = 64  # peers whose latest digest is kept (most recent senders; bounds memory)
    rumor_changes: int = 4  # change entries pushed with a rumor
    rumor_snapshot_hashes: int = 1024  # a rumor carries a snapshot only if it is this small
    relay_log_hashes: int = 4096  # per origin: hashes of change entries kept for relaying deltas
    max_relays: int = 16  # other nodes' states relayed in one message, at most
    max_relay_hashes: int = 100_000  # hashes relayed in one message, at most

    def __post_init__(self) -> None:
        counts = (self.digest_full, self.digest_sample, self.max_rumors, self.rumor_sends,
                  self.max_recent, self.max_knows, self.rumor_changes, self.max_relays)  # fmt: skip
        if min(counts) < 1:
            raise ValueError("epidemic digest, rumor and relay counts must be >= 1")
        if self.digest_sample > self.digest_full:
            raise ValueError("digest_sample must be <= digest_full")
        budgets = (self.rumor_snapshot_hashes, self.relay_log_hashes, self.max_relay_hashes)
        if min(budgets) < 0:
            raise ValueError("epidemic hash budgets must be >= 0")


@dataclass(frozen=True, slots=True)
class GossipConfig:
    interval_s: float = 0.5  # Δpoll: period of anti-entropy rounds
    jitter_frac: float = 0.1  # each round is delayed by up to this fraction of interval_s
    # delta mode: a change to this node's own cache, or a request joining or leaving its
    # engine's queue, brings the next round forward to this long after the last one, so peers
    # hear of a new copy (or load) before the next request that needs it arrives, not up to an
    # interval later (None: rounds only every interval_s, as the paper polls). At most
    # 1 / announce_gap_s rounds a second, and only while the cache or the queue changes.
    announce_gap_s: float | None = 0.05
    mode: GossipMode = GossipMode.DELTA  # what a round carries: snapshot, delta or epidemic
    fanout: int = 3  # epidemic mode: peers contacted per round
    suspect_after_s: float = 2.0  # silent this long -> suspect (not routed to)
    dead_after_s: float = 10.0  # silent this long -> dead (estimate dropped)
    change_log_limit: int = 65_536  # delta mode: changes kept; older receivers get a snapshot
    max_message_bytes: int = 8 * 1024 * 1024  # larger peer messages are rejected
    max_hashes: int = 1_000_000  # hashes in one message, at most
    membership: MembershipConfig = field(default_factory=MembershipConfig)  # failure detection
    exchange: ExchangeConfig = field(default_factory=ExchangeConfig)  # per-peer piggybacking
    epidemic: EpidemicConfig = field(default_factory=EpidemicConfig)  # digests, rumors, relays

    @property
    def announce_s(self) -> float | None:
        """The gap announcements keep after the last round, where this mode announces (delta:
        a round carries only the changes, to every member); else None."""
        return self.announce_gap_s if self.mode is GossipMode.DELTA else None

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError("gossip interval_s must be > 0")
        if self.announce_gap_s is not None and self.announce_gap_s < 0:
            raise ValueError("announce_gap_s must be >= 0 (or None to disable)")
        if not 0 <= self.jitter_frac < 1:
            raise ValueError("jitter_frac must be in [0, 1)")
        if self.fanout < 1:
            raise ValueError("fanout must be >= 1")
        if not 0 < self.suspect_after_s <= self.dead_after_s:
            raise ValueError("need 0 < suspect_after_s <= dead_after_s")
        if self.change_log_limit < 1 or self.max_message_bytes < 1024 or self.max_hashes < 1:
            raise ValueError("change_log_limit, max_message_bytes and max_hashes too small")

    @classmethod
    def lan(cls) -> GossipConfig:
        """The defaults: sub-millisecond links, rounds every 0.5 s."""
        return cls(
            interval_s=0.5,
            suspect_after_s=2.0,
            dead_after_s=10.0,
            membership=MembershipConfig(dead_probe_every=8, seed_every=10),
            exchange=ExchangeConfig(echo_every=8, speed_every=16),
        )

    @classmethod
    def wan(cls) -> GossipConfig:
        """Rounds 4x slower and timeouts 5-6x longer (lossy, slower links); cadences counted
        in rounds or messages are halved, so dead-peer probes, seed contacts, RTT echoes and
        speed reports come every 2x as long as on a LAN in seconds, not 4x."""
        return cls(
            interval_s=2.0,
            suspect_after_s=10.0,
            dead_after_s=60.0,
            membership=MembershipConfig(dead_probe_every=4, seed_every=5),
            exchange=ExchangeConfig(echo_every=4, speed_every=8),
        )

    @classmethod
    def for_interval(cls, interval_s: float, **overrides: Any) -> GossipConfig:
        """Timeouts scaled to the interval: suspect after 4 rounds, dead after 20."""
        base: dict[str, Any] = {
            "interval_s": interval_s,
            "suspect_after_s": max(4 * interval_s, 0.5),
            "dead_after_s": max(20 * interval_s, 2.5),
        }
        base.update(overrides)
        return cls(**base)


@dataclass(frozen=True, slots=True)
class PushbackConfig:
    queue_threshold: int = 8  # queue depth above which this node asks peers to back off
    duration_s: float = 1.0  # how long peers should back off (relative: no clock sync)
    # ... and only while its queue is also over ``relative`` x the mean queue its peers last
    # reported: a node no busier than its peers protects nobody by pushing back (its work
    # moves to nodes as busy, and the prefixes it holds are computed again elsewhere).
    # None: the threshold alone (the paper's rule).
    relative: float | None = 2.0

    def __post_init__(self) -> None:
        if self.queue_threshold < 1 or self.duration_s <= 0:
            raise ValueError("queue_threshold must be >= 1 and duration_s > 0")
        if self.relative is not None and not self.relative >= 1.0:
            raise ValueError("relative must be >= 1 (or None)")


@dataclass(frozen=True, slots=True)
class ForwardConfig:
    """How an entry node tries peers for one request (the request lifecycle, core/lifecycle)."""

    max_peer_attempts: int = 2  # peers tried (refused, failed or unknown) before running locally
    connect_timeout_s: float = 0.5  # a peer that does not take the connection fails after this
    silence_timeout_s: float = 2.0  # no first byte, or no byte for this long: the forward failed

    def __post_init__(self) -> None:
        if self.max_peer_attempts < 0:
            raise ValueError("max_peer_attempts must be >= 0")
        if self.connect_timeout_s <= 0 or self.silence_timeout_s <= 0:
            raise ValueError("forward timeouts must be > 0")

    @property
    def heartbeat_s(self) -> float:
        """How often a serving peer sends a heartbeat: four per silence timeout, within the
        range a ``ForwardRequest`` carries ([0.01, 60] s; a silence timeout over 240 s, as a
        benchmark's ``--time-scale`` stretches it, still beats every minute)."""
        return min(max(self.silence_timeout_s / 4, HEARTBEAT_MIN_S), HEARTBEAT_MAX_S)


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Bounded admission: how much work one node queues before it turns requests away.

    A node that is full still answers: a client request goes to a peer with room, or is
    rejected with a retry-after (HTTP 429); a peer's forward is refused as busy. Nothing is
    queued without bound and no client waits without an answer."""

    max_queue_requests: int | None = None  # requests waiting or running at most (None: no cap)
    max_queue_wait_s: float = 30.0  # full when the queue holds this much work (measured speed)
    min_retry_after_s: float = 1.0  # the shortest back-off a rejected client is asked for
    # prompt + max_tokens of the requests waiting or running, at most; 0 (the default): the
    # tokens the engine gets through within max_queue_wait_s at its measured rate; None: no cap
    max_queue_tokens: int | None = 0

    def __post_init__(self) -> None:
        if self.max_queue_requests is not None and self.max_queue_requests < 1:
            raise ValueError("max_queue_requests must be >= 1 (or None)")
        if self.max_queue_tokens is not None and self.max_queue_tokens < 0:
            raise ValueError("max_queue_tokens must be >= 0 (0: from the measured speed; or None)")
        if self.max_queue_wait_s <= 0 or self.min_retry_after_s < 0:
            raise ValueError("max_queue_wait_s must be > 0 and min_retry_after_s >= 0")


@dataclass(frozen=True, slots=True)
class JoinConfig:
    """How a node joins through seed addresses (core/failure.py): flags, DNS, backoff.

    A seed is an address without a known node id (``--join``, or what ``--join-dns``
    resolved). While the node knows no alive peer it contacts each seed with exponential
    backoff, counted in gossip rounds: after the k-th unanswered contact it waits
    min(2**(k-1), ``seed_backoff_max_rounds``) rounds; once it knows an alive peer, unknown
    seeds get the fixed ``MembershipConfig.seed_every`` cadence instead."""

    seed_backoff_max_rounds: int = 8  # longest wait between contacts of a silent seed
    max_seeds: int = 256  # seed addresses kept, at most (DNS answers beyond it are ignored)

    def __post_init__(self) -> None:
        if self.seed_backoff_max_rounds < 1 or self.max_seeds < 1:
            raise ValueError("seed_backoff_max_rounds and max_seeds must be >= 1")


@dataclass(frozen=True, slots=True)
class NodeConfig:
    node_id: str  # unique name of this node in the mesh
    address: str  # where peers reach this node ("host:port"; opaque to the core)
    fingerprint: Fingerprint  # model + tokenizer + block size; peers must match exactly
    incarnation: int  # grows across restarts of the same node_id (the shell picks it)
    seeds: tuple[str, ...] = ()  # addresses to join through
    router: RouterConfig = field(default_factory=RouterConfig)
    gossip: GossipConfig = field(default_factory=GossipConfig)
    pushback: PushbackConfig = field(default_factory=PushbackConfig)
    priors: CostPriors = field(default_factory=CostPriors)
    forward: ForwardConfig = field(default_factory=ForwardConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    join: JoinConfig = field(default_factory=JoinConfig)  # seeds: backoff, bound
    decision_log: int = 0  # routing decisions kept to explain them (core/decisions.py); 0: none
    sessions: SessionConfig = field(default_factory=SessionConfig)  # core/sessions.py
    adapters: tuple[Adapter, ...] = ()  # the LoRA adapters this node serves (advertised)

    def __post_init__(self) -> None:
        if not self.node_id or len(self.node_id) > 128:
            raise ValueError("node_id must be 1..128 characters")
        if not self.address or len(self.address) > 256:
            raise ValueError("address must be 1..256 characters")
        if self.incarnation < 0:
            raise ValueError("incarnation must be >= 0")
        if self.decision_log < 0:
            raise ValueError("decision_log must be >= 0")
