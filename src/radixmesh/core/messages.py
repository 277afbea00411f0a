"""Every message peers exchange, as frozen slotted dataclasses (encoded by :mod:`codec`).

There is one message on the wire, :class:`Gossip`: a node's own state plus what it knows of
others. A node is the single writer of its own state ``(incarnation, version)``; everything a
receiver holds about it is a read-only estimate, ordered by::

    incarnation (grows across restarts)  >  version (grows with each cache change)
                                          >  stamp   (sender's own clock; orders load reports)

so an older, duplicated or reordered message can never regress an estimate.

Summaries of a cache travel as either a :class:`Snapshot` (the whole set of block hashes) or a
:class:`Delta` (the per-version change entries after ``base``; the receiver applies the entries
whose version is above the one it holds, so a delta overlapping what it already has is fine).
"""

from __future__ import annotations

from dataclasses import dataclass

from radixmesh.core.blocks import Fingerprint
from radixmesh.core.estimators import SpeedReport

PROTOCOL_VERSION = 1


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
    address: str
    incarnation: int
    version: int  # the sender's current state version
    heartbeat: int  # the sender's round counter (this incarnation)
    fingerprint: int  # Fingerprint.digest: model + tokenizer + block size
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


Message = Gossip
