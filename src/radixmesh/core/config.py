"""Configuration of a node's core, one frozen dataclass per subsystem, validated on creation.

Presets follow memberlist's habit: ``GossipConfig.lan()`` and ``GossipConfig.wan()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from radixmesh.core.blocks import Fingerprint
from radixmesh.core.estimators import CostPriors
from radixmesh.core.router import RouterConfig


class GossipMode(StrEnum):
    SNAPSHOT = "snapshot"  # every round carries the full set of block hashes (the paper's)
    DELTA = "delta"  # changes since the receiver's last acknowledged version (default)
    EPIDEMIC = "epidemic"  # delta to `fanout` random peers, relaying what we know of others

    @classmethod
    def parse(cls, text: str) -> GossipMode:
        try:
            return cls(text.strip().lower())
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown gossip mode {text!r} (choose from {names})") from None


@dataclass(frozen=True, slots=True)
class GossipConfig:
    interval_s: float = 0.5  # Δpoll: period of anti-entropy rounds
    jitter_frac: float = 0.1  # each round is delayed by up to this fraction of interval_s
    mode: GossipMode = GossipMode.DELTA
    fanout: int = 3  # epidemic mode: peers contacted per round
    suspect_after_s: float = 2.0  # silent this long -> suspect (not routed to)
    dead_after_s: float = 10.0  # silent this long -> dead (estimate dropped)
    change_log_limit: int = 65_536  # delta mode: changes kept; older receivers get a snapshot
    max_message_bytes: int = 8 * 1024 * 1024  # larger peer messages are rejected
    max_hashes: int = 1_000_000  # hashes in one message, at most

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError("gossip interval_s must be > 0")
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
        return cls(interval_s=0.5, suspect_after_s=2.0, dead_after_s=10.0)

    @classmethod
    def wan(cls) -> GossipConfig:
        return cls(interval_s=2.0, suspect_after_s=10.0, dead_after_s=60.0)

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

    def __post_init__(self) -> None:
        if self.queue_threshold < 1 or self.duration_s <= 0:
            raise ValueError("queue_threshold must be >= 1 and duration_s > 0")


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
        """How often a serving peer sends a heartbeat: four per silence timeout."""
        return max(self.silence_timeout_s / 4, 0.01)


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

    def __post_init__(self) -> None:
        if not self.node_id or len(self.node_id) > 128:
            raise ValueError("node_id must be 1..128 characters")
        if not self.address or len(self.address) > 256:
            raise ValueError("address must be 1..256 characters")
        if self.incarnation < 0:
            raise ValueError("incarnation must be >= 0")
