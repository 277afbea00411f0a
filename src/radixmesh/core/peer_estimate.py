"""What one node believes about one peer: the record the gossip layer's parts share.

Each field has one writer: failure detection (``core/failure.py``) owns identity and liveness,
dissemination (``core/dissemination.py``, ``core/epidemic.py``) owns the rest. What the peer's
payload *is* (its cache summary) lives in the payload (``core/cache_payload.py``); the estimate
holds only the payload's version.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixmesh.core.estimators import SpeedReport
from radixmesh.core.messages import Ack, Change, DigestEntry, Load
from radixmesh.core.shadow_state import BatchState


@dataclass(slots=True)
class PeerEstimate:
    """What this node believes about one peer (mutable; single writer: the gossip layer)."""

    # identity and liveness (failure detection)
    node_id: str
    incarnation: int
    heartbeat: int = 0  # its highest round counter seen, 0: none (directly or relayed)
    hearsay: bool = False  # named by others only: its incarnation is not known yet
    # its state (dissemination)
    version: int | None = None  # version of its payload held (None: nothing)
    stamp: float | None = None  # its clock at the newest load applied
    load: Load | None = None  # its newest load report (speed may be None: see ``speed``)
    speed: SpeedReport | None = None  # its newest speed report
    speed_measured_at: float | None = None  # our clock when it last measured its speed itself
    pushback_until: float | None = None  # our clock
    # what it holds of ours and what we owe it (dissemination)
    speed_sent: SpeedReport | None = None  # OUR speed as last sent to it
    batch_sent: tuple[BatchState, float] | None = None  # OUR batch as last sent to it, when
    acked: Ack | None = None  # which of OUR states it holds (from its latest message)
    sent_version: int | None = None  # our newest version sent to it (maybe not received)
    unacked_since: float | None = None  # when we started sending beyond its ack
    echo_stamp: float | None = None  # its latest stamp, to echo back once
    echo_at: float = 0.0  # our clock when that stamp arrived
    # its clock minus ours, from its latest own message (None: never heard directly): a
    # relayed stamp far ahead of its clock is a lie (``Dissemination.apply_relay``)
    clock_offset: float | None = None
    last_echo: float | None = None  # newest of our stamps it echoed (counted once)
    sent: int = 0  # messages sent to it
    # epidemic relaying
    knows: dict[str, DigestEntry] | None = None  # its latest digest
    relay_log: list[Change] = field(default_factory=list)  # consecutive, ending at version
    relay_log_hashes: int = 0

    def reset_state(self) -> None:
        """Forget its state and what it holds of ours (dead, or restarted)."""
        self.version = None
        self.acked = None
        self.sent_version = None
        self.unacked_since = None
        self.knows = None
        self.relay_log = []
        self.relay_log_hashes = 0
        self.load = None
        self.speed = None
        self.speed_measured_at = None
        self.speed_sent = None
        self.batch_sent = None
        self.pushback_until = None

    def restart(self, incarnation: int) -> None:
        """A new incarnation of the peer: nothing of the old one holds."""
        self.reset_state()
        self.incarnation = incarnation
        self.heartbeat = 0
        self.stamp = None
        self.last_echo = None
        self.echo_stamp = None
        self.clock_offset = None

    def resend_from_ack(self) -> None:
        """What we sent beyond its ack was probably lost: next time, start from the ack."""
        self.sent_version = self.unacked_since = None


def bump(metrics: dict[str, float], name: str, by: float = 1.0) -> None:
    """Add to one of the node's counters (the gossip layer's parts share the node's dict)."""
    metrics[name] = metrics.get(name, 0.0) + by
