"""Epidemic dissemination: digests, rumors and relays of other nodes' states.

Theory of operation
-------------------
In epidemic mode a node talks to ``fanout`` random members per round, so most states reach a
node second-hand. Each message is push-pull:

* the **digest** ``(id, incarnation, version, heartbeat)`` of the nodes the sender knows: all
  of them up to ``digest_full``, else a random ``digest_sample`` plus the nodes that changed
  recently and those heard first-hand last round (so the work per message stays bounded);
* the receiver keeps the latest digest of its ``max_knows`` most recent senders, and its next
  message to one of them **relays** the states that digest shows to be older: the change
  entries after the version it holds, from a per-origin relay log of ``relay_log_hashes``
  when that reaches back far enough, else a snapshot of what we hold (within the message's
  ``max_relay_hashes``);
* **rumors**: a node whose state changed recently (the newest ``max_recent``) is pushed
  unasked, with its last ``rumor_changes`` entries or a small snapshot, in
  max(``rumor_sends``, ln N) messages that actually carry it. Rumor mongering with k pushes
  leaves ~e^-(k+1) of the nodes unreached; those are repaired by digests.

A newer heartbeat in a digest or a relay counts as hearing from that node (:mod:`failure`),
so failure detection works without talking to everyone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from random import Random  # the type only: instances are passed in, never the global one

from radixmesh.core.config import GossipConfig, GossipMode
from radixmesh.core.failure import FailureDetector
from radixmesh.core.membership import MemberState
from radixmesh.core.messages import Change, Delta, DigestEntry, Load, NodeState, Snapshot, Summary
from radixmesh.core.payload import Payload
from radixmesh.core.peer_estimate import PeerEstimate


class Epidemic:
    """Digests out, digests kept, rumors and relays; inert (but harmless) in direct modes."""

    def __init__(
        self, config: GossipConfig, failure: FailureDetector, payload: Payload, rng: Random
    ) -> None:
        self.cfg = config.epidemic
        self.enabled = config.mode is GossipMode.EPIDEMIC
        self.failure = failure
        self.members = failure.members
        self.estimates = failure.estimates
        self.payload = payload
        self.rng = rng
        self._recent: dict[str, int] = {}  # node -> rumor sends left, newest last
        self._full_digest: tuple[DigestEntry, ...] | None = None  # cached for one round
        self._heard_now: dict[str, None] = {}  # heard first-hand this round (freshest beats)
        self._heard_last: list[str] = []  # ... and in the previous round
        self._knowing: dict[str, None] = {}  # peers whose ``knows`` is kept, oldest first
        self._rumor_sends = self.cfg.rumor_sends  # per changed node; grows as ln N

    def begin_round(self, live: int) -> None:
        # Rumor mongering leaves about e^-(k+1) of the nodes unreached after k pushes per
        # informed node; those wait for anti-entropy (a sampled digest naming the changed node,
        # ~digest_sample/N per message). k = ln N keeps that residue below one node.
        self._rumor_sends = max(self.cfg.rumor_sends, math.ceil(math.log(live + 1)))
        self._full_digest = None
        self._heard_last = list(self._heard_now)[-self.cfg.max_rumors :]
        self._heard_now.clear()

    def heard_first_hand(self, node_id: str) -> None:
        self._heard_now[node_id] = None

    # ======================================================================== incoming
    def keep_knows(self, est: PeerEstimate, digest: tuple[DigestEntry, ...]) -> None:
        """Keep the sender's digest; only the ``max_knows`` most recent senders' digests are
        kept (each node holding every peer's digest grew as N² x digest size: GBs at 1024
        nodes). A peer whose digest was dropped is relayed to as one never heard: rumors only."""
        est.knows = {d.node_id: d for d in digest}
        self._knowing.pop(est.node_id, None)
        self._knowing[est.node_id] = None
        while len(self._knowing) > self.cfg.max_knows:
            oldest = next(iter(self._knowing))
            del self._knowing[oldest]
            old = self.estimates.get(oldest)
            if old is not None:
                old.knows = None

    def note_snapshot(self, est: PeerEstimate) -> None:
        """``est`` now holds a whole new state: its relay log starts again; rumor it."""
        est.relay_log = []
        est.relay_log_hashes = 0
        self._rumor(est.node_id)

    def note_changes(self, est: PeerEstimate, fresh: list[Change]) -> None:
        """``est`` moved on by ``fresh``: keep them for relaying (bounded); rumor it."""
        est.relay_log.extend(fresh)
        est.relay_log_hashes += sum(_items(c) for c in fresh)
        drop = 0
        while est.relay_log_hashes > self.cfg.relay_log_hashes and drop < len(est.relay_log):
            est.relay_log_hashes -= _items(est.relay_log[drop])
            drop += 1
        if drop:
            del est.relay_log[:drop]
        self._rumor(est.node_id)

    def _rumor(self, node_id: str) -> None:
        if self.enabled:
            self._recent.pop(node_id, None)
            self._recent[node_id] = self._rumor_sends  # newest last
            if len(self._recent) > self.cfg.max_recent:  # under churn: the newest go first
                del self._recent[next(iter(self._recent))]

    # ========================================================================= digests
    def digest(self, target: str | None) -> tuple[DigestEntry, ...]:
        """What we know of others: all of it in small meshes, else a random sample plus the
        nodes whose state changed recently (so per-message work stays bounded at large N)."""
        live = self.failure.live
        if len(live) <= self.cfg.digest_full:
            if self._full_digest is None:
                self._full_digest = tuple(self._entries(live))
            return self._full_digest
        ids = self.rng.sample(live, self.cfg.digest_sample)
        ids.extend(list(self._recent)[-self.cfg.max_rumors :])
        ids.extend(self._heard_last)  # first-hand heartbeats spread fastest from here
        return tuple(self._entries(dict.fromkeys(i for i in ids if i != target)))

    def _entries(self, ids: Iterable[str]) -> list[DigestEntry]:
        out = []
        for node_id in ids:
            est = self.estimates.get(node_id)
            if est is not None and not est.hearsay:
                out.append(DigestEntry(node_id, est.incarnation, est.version, est.heartbeat))
        return out

    # ========================================================================== relays
    def relays(self, target: PeerEstimate, now: float) -> tuple[NodeState, ...]:
        """States the target lacks, judged by its latest digest, plus recent changes."""
        knows = target.knows or {}
        wanted: dict[str, PeerEstimate] = {}
        for known in knows.values():
            e = self._relayable(known.node_id, target)
            if e is not None and _newer(e, known):
                wanted[e.node_id] = e
        rumors = []
        for node_id in self._recent:
            e = self._relayable(node_id, target)
            if e is not None and node_id not in knows:
                wanted[node_id] = e
                rumors.append(node_id)
        chosen = list(wanted.values())
        if len(chosen) > self.cfg.max_relays:
            chosen = self.rng.sample(chosen, self.cfg.max_relays)
        sent = {e.node_id for e in chosen}
        for node_id in rumors:  # a rumor counts as pushed only if it made the sample
            if node_id in sent:
                self._spend_rumor(node_id)
        out: list[NodeState] = []
        budget = self.cfg.max_relay_hashes
        for e in chosen:
            state = self._relay_state(e, knows.get(e.node_id), now, budget)
            budget -= _hash_count(state.summary)
            out.append(state)
        return tuple(out)

    def _spend_rumor(self, node_id: str) -> None:
        left = self._recent[node_id] - 1
        if left > 0:
            self._recent[node_id] = left
        else:
            del self._recent[node_id]

    def _relayable(self, node_id: str, target: PeerEstimate) -> PeerEstimate | None:
        member = self.members.get(node_id)
        if member is None or member.state is MemberState.DEAD or node_id == target.node_id:
            return None
        est = self.estimates.get(node_id)
        return None if est is None or est.hearsay else est

    def _relay_state(
        self, e: PeerEstimate, known: DigestEntry | None, now: float, budget: int
    ) -> NodeState:
        member = self.members.get(e.node_id)
        address = member.address if member is not None else ""
        summary = self._relay_summary(e, known, budget)
        load = e.load
        if load is not None:
            remaining = None if e.pushback_until is None else e.pushback_until - now
            pushback = remaining if remaining is not None and remaining > 0 else None
            load = Load(
                load.queue_depth,
                load.inflight,
                load.cache_tokens,
                load.cache_budget,
                e.speed,
                pushback,
                load.utilization,
                load.speed_measured_at,
                load.batch,
            )
        stamp = 0.0 if e.stamp is None else e.stamp
        return NodeState(e.node_id, address, e.incarnation, e.heartbeat, stamp, load, summary)

    def _relay_summary(
        self, e: PeerEstimate, known: DigestEntry | None, budget: int
    ) -> Summary | None:
        if e.version is None:
            return None
        if known is None:  # a rumor: the target's version is unknown
            return self._rumor_summary(e, budget)
        base = known.version if known.incarnation == e.incarnation else None
        if base is not None and base >= e.version:
            return None
        if base is not None and e.relay_log and e.relay_log[0].version <= base + 1:
            return Delta(base, tuple(c for c in e.relay_log if c.version > base))
        return self.payload.remote_state(e.node_id, e.version, budget)

    def _rumor_summary(self, e: PeerEstimate, budget: int) -> Summary | None:
        """The last few changes (applies if the target is not too far behind), else a small
        snapshot; a target further behind shows it in its digest and is repaired then."""
        if e.relay_log:
            tail = tuple(e.relay_log[-self.cfg.rumor_changes :])
            return Delta(tail[0].version - 1, tail)
        assert e.version is not None
        return self.payload.remote_state(
            e.node_id, e.version, min(budget, self.cfg.rumor_snapshot_hashes)
        )


def _newer(e: PeerEstimate, known: DigestEntry) -> bool:
    """Whether our state of a node is newer than the target's (heartbeats travel in digests)."""
    if e.incarnation != known.incarnation:
        return e.incarnation > known.incarnation
    mine = -1 if e.version is None else e.version
    theirs = -1 if known.version is None else known.version
    return mine > theirs


def _hash_count(summary: Summary | None) -> int:
    if summary is None:
        return 0
    if isinstance(summary, Snapshot):
        return len(summary.hashes)
    return sum(_items(c) for c in summary.changes)


def _items(change: Change) -> int:
    return len(change.added) + len(change.removed)
