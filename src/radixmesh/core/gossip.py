"""Anti-entropy of cache summaries, load and membership between peers (pure: no IO, no clock).

Theory of operation
-------------------
Every node is the single writer of its own state (``incarnation``, summary ``version``, load).
Each round (every Δpoll plus jitter) it sends one :class:`Gossip` to each target; receivers keep
an *estimate* per peer that only moves forward::

    new incarnation  -> drop the old estimate at once, start again (restart)
    older incarnation -> whole message rejected as stale
    summary:  Snapshot v  applied iff v > held version
              Delta base..v applied iff base <= held version (entries above held are applied)
    load:     applied iff the sender's stamp is newer than the last applied one

so duplicates, reordering, delay and loss can never regress a view (loss only delays it).

Modes
    snapshot   every round carries the sender's full hash set (the paper).
    delta      every round carries the change entries after the version the receiver holds:
               its last ack (acks ride on the receiver's own messages) or, optimistically, what
               we last sent it, for at most RESEND_AFTER_ROUNDS rounds without ack progress
               (then we fall back to the ack: lost messages are re-sent). A receiver that holds
               nothing, or is behind our change log, gets a snapshot. A gap (base above what the
               receiver holds) is ignored and counted; the fallback to its ack repairs it.
    epidemic   delta to ``fanout`` random peers per round, push-pull: each message carries a
               digest ``(id, incarnation, version, heartbeat)`` of the nodes the sender knows
               (all of them up to DIGEST_FULL, else a random DIGEST_SAMPLE plus recent changes,
               so the work per message stays bounded) and asks for a reply; the receiver sends
               back the state of others that the digest shows to be older (deltas from a
               per-origin relay log when it reaches back far enough, else snapshots), plus
               *rumors*: nodes whose state changed recently (the newest MAX_RECENT), pushed
               unasked in max(RUMOR_SENDS, ln N) messages that actually carry them (rumor
               mongering with k pushes leaves ~e^-(k+1) of the nodes to anti-entropy). A newer
               heartbeat in a digest or a relay counts as hearing from that node, so failure
               detection works without talking to everyone.

Membership rides along: peer lists on first contact and as small periodic samples; seeds are
contacted until someone answers. RTT is measured without clock sync: each message echoes the
last stamp received from its destination and how long it was held, so the destination computes
``rtt = now - stamp - held`` on its own clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from random import Random  # the type only: instances are passed in, never the global one

from radixmesh.core.blocks import Fingerprint
from radixmesh.core.codec import Codec
from radixmesh.core.config import GossipMode, NodeConfig
from radixmesh.core.estimators import RttTable, SpeedReport
from radixmesh.core.events import Action, Log, PeerStateChanged, Send
from radixmesh.core.membership import (
    Member,
    MemberEvent,
    Membership,
    MemberState,
    Transition,
)
from radixmesh.core.messages import (
    Ack,
    Change,
    Delta,
    DigestEntry,
    Echo,
    Gossip,
    Load,
    NodeState,
    PeerAddress,
    Snapshot,
    Summary,
)
from radixmesh.core.peerview import PeerView
from radixmesh.core.summary import LocalSummary

MAX_RELAYS = 16  # other nodes' states relayed in one message, at most
MAX_RELAY_HASHES = 100_000  # hashes relayed in one message, at most
DIGEST_FULL = 64  # epidemic: up to this many known nodes, every digest lists them all
DIGEST_SAMPLE = 48  # ... beyond that, a random sample of this many (plus recent changes)
RUMOR_SENDS = 3  # epidemic: messages that push a node's changed state unasked (at least; ln N)
MAX_RUMORS = 16  # recent changes named in one digest, at most
MAX_RECENT = 64  # changed nodes with rumor sends left, at most (oldest dropped: digests repair)
MAX_KNOWS = 64  # epidemic: peers whose latest digest is kept (most recent senders; bounds memory)
RUMOR_CHANGES = 4  # change entries pushed with a rumor
RUMOR_SNAPSHOT_HASHES = 1024  # a rumor carries a snapshot only if it is this small
RELAY_LOG_HASHES = 4096  # per origin: hashes of change entries kept for relaying deltas
PEER_SAMPLE = 4  # peers named in a periodic membership sample
SAMPLE_EVERY = 8  # messages to one peer between membership samples
DEAD_PROBE_EVERY = 8  # rounds between messages to dead peers (finds healed partitions)
SEED_EVERY = 10  # rounds between seed contacts once we know an alive peer
MAX_RTT_S = 60.0  # echoes implying a longer round trip are ignored
MAX_REFUSED = 4096  # refused peer ids remembered (one log line each)
MAX_MEMBERS = 8192  # known nodes, at most: ids beyond this are ignored (bounds a member flood)
ECHO_EVERY = 8  # messages to one peer between RTT echoes
RESEND_AFTER_ROUNDS = 2.5  # unacknowledged changes are sent again after this many rounds
SPEED_EVERY = 16  # messages to one peer between unconditional speed reports
MAX_RETRY_AFTER_S = 60.0  # a "busy" answer asking for a longer back-off is ignored
SPEED_CHANGE = 0.05  # relative change of a speed figure that is worth reporting at once


@dataclass(slots=True)
class Estimate:
    """What this node believes about one peer (mutable; single writer: the Gossiper)."""

    node_id: str
    incarnation: int
    version: int | None = None  # version of its summary held in the PeerView (None: nothing)
    heartbeat: int = 0  # its highest round counter seen, 0: none (directly or relayed)
    stamp: float | None = None  # its clock at the newest load applied
    load: Load | None = None  # its newest load report (speed may be None: see ``speed``)
    speed: SpeedReport | None = None  # its newest speed report
    speed_sent: SpeedReport | None = None  # OUR speed as last sent to it
    pushback_until: float | None = None  # our clock
    acked: Ack | None = None  # which of OUR states it holds (from its latest message)
    sent_version: int | None = None  # our newest version sent to it (maybe not received)
    unacked_since: float | None = None  # when we started sending beyond its ack
    echo_stamp: float | None = None  # its latest stamp, to echo back once
    echo_at: float = 0.0  # our clock when that stamp arrived
    last_echo: float | None = None  # newest of our stamps it echoed (counted once)
    knows: dict[str, DigestEntry] | None = None  # epidemic: its latest digest
    relay_log: list[Change] = field(default_factory=list)  # consecutive, ending at version
    relay_log_hashes: int = 0
    sent: int = 0  # messages sent to it
    snapshot_cache: Snapshot | None = None  # for relaying it as a snapshot
    hearsay: bool = False  # named by others only: its incarnation is not known yet

    def reset_state(self) -> None:
        """Forget its cache state and what it holds of ours (dead, or restarted)."""
        self.version = None
        self.acked = None
        self.sent_version = None
        self.unacked_since = None
        self.knows = None
        self.relay_log = []
        self.relay_log_hashes = 0
        self.snapshot_cache = None
        self.load = None
        self.speed = None
        self.speed_sent = None
        self.pushback_until = None


class Gossiper:
    """Builds outgoing rounds and applies incoming messages to the view and membership."""

    def __init__(
        self,
        config: NodeConfig,
        summary: LocalSummary,
        view: PeerView,
        members: Membership,
        rtt: RttTable,
        codec: Codec,
        rng: Random,
        metrics: dict[str, float],
    ) -> None:
        self.config = config
        self.cfg = config.gossip
        self.summary = summary
        self.view = view
        self.members = members
        self.rtt = rtt
        self.codec = codec
        self.rng = rng
        self.metrics = metrics
        self.fingerprint = config.fingerprint.digest
        self.heartbeat = 0
        self.estimates: dict[str, Estimate] = {}
        self.routable: dict[str, None] = {}  # alive peers with a load report (ordered set)
        self._refused: set[str] = set()
        self._self_clash_logged = False
        self._recent: dict[str, int] = {}  # epidemic: node -> rumor sends left
        self._live: list[str] = []  # non-dead members, rebuilt once per round
        self._full_digest: tuple[DigestEntry, ...] | None = None  # cached for one round
        self._heard_now: dict[str, None] = {}  # heard first-hand this round (freshest beats)
        self._heard_last: list[str] = []  # ... and in the previous round
        self._knowing: dict[str, None] = {}  # peers whose ``knows`` is kept, oldest first
        self._rumor_sends = RUMOR_SENDS  # per changed node; grows as ln N (see round)

    # ================================================================= incoming messages
    def receive(self, msg: Gossip, now: float, load: Load) -> list[Action]:
        """Apply one decoded message; returns replies, logs and state changes."""
        if msg.sender == self.config.node_id:
            return self._reject_self(msg)
        if msg.fingerprint != self.fingerprint:
            return self._refuse(msg, now, load)
        actions: list[Action] = []
        est = self._resolve(msg.sender, msg.incarnation, msg.address, now, actions)
        if est is None:  # an older incarnation, or a new id while the member table is full
            full = msg.sender not in self.members
            self._count("messages_rejected_members_full" if full else "messages_rejected_stale")
            self._count("messages_rejected")
            return actions
        newest = est.stamp is None or msg.stamp >= est.stamp
        est.heartbeat = max(est.heartbeat, msg.heartbeat)
        self._heard(msg.sender, now, actions)
        self._heard_now[msg.sender] = None
        self._apply_load(est, msg.stamp, msg.load, now)
        self._apply_summary(est, msg.summary)
        self._apply_echo(est, msg, now)
        if newest:
            self._apply_ack(est, msg.ack, now)
            if msg.digest:
                self._keep_knows(est, msg.digest)
        self._learn_peers(msg.peers, now, actions)
        self._apply_digest(msg.digest, now, actions)
        for state in msg.relays:
            self._apply_relay(state, now, actions)
        self._sync_routable(msg.sender)
        if msg.reply:
            member = self.members.get(msg.sender)
            # A joining (or restarted) node knows nobody: it gets our whole member list.
            joining = msg.ack is None and not msg.peers
            if member is not None:
                actions.append(self._send(est, member, now, load, reply=False, full=joining))
        return actions

    def _keep_knows(self, est: Estimate, digest: tuple[DigestEntry, ...]) -> None:
        """Keep the sender's digest; only the MAX_KNOWS most recent senders' digests are kept
        (each node holding every peer's digest grew as N² x digest size: GBs at 1024 nodes).
        A peer whose digest was dropped is relayed to as one never heard: rumors only."""
        est.knows = {d.node_id: d for d in digest}
        self._knowing.pop(est.node_id, None)
        self._knowing[est.node_id] = None
        while len(self._knowing) > MAX_KNOWS:
            oldest = next(iter(self._knowing))
            del self._knowing[oldest]
            old = self.estimates.get(oldest)
            if old is not None:
                old.knows = None

    def _resolve(
        self, node_id: str, incarnation: int, address: str, now: float, out: list[Action]
    ) -> Estimate | None:
        """The estimate to update for this sender (new, restarted), or None if stale."""
        member = self.members.get(node_id)
        if member is None:
            if len(self.members) >= MAX_MEMBERS:
                self._count("members_full_ignored")
                return None
            self.members.add(node_id, address, incarnation, now)
            self.members.resolve_seed(address)
            out.append(PeerStateChanged(node_id, "unknown", MemberState.ALIVE.value))
            out.append(Log("info", f"peer {node_id} joined at {address}"))
            est = self.estimates[node_id] = Estimate(node_id, incarnation)
            return est
        est = self.estimates[node_id]
        if est.hearsay:
            self._adopt(est, incarnation)
        if incarnation < member.incarnation:
            return None
        if incarnation > member.incarnation:
            self._restart(member, est, incarnation, now, out)
        if member.address != address:
            member.address = address
        return est

    def _adopt(self, est: Estimate, incarnation: int) -> None:
        """A node known by hearsay is now known first-hand: take its incarnation as is."""
        est.hearsay = False
        est.incarnation = incarnation
        member = self.members.get(est.node_id)
        if member is not None:
            member.incarnation = incarnation

    def _restart(
        self, member: Member, est: Estimate, incarnation: int, now: float, out: list[Action]
    ) -> None:
        old = member.incarnation
        self.view.drop(member.node_id)
        est.reset_state()
        est.incarnation = incarnation
        est.heartbeat = 0
        est.stamp = None
        est.last_echo = None
        est.echo_stamp = None
        member.incarnation = incarnation
        member.last_heard = max(member.last_heard, now)
        self.routable.pop(member.node_id, None)
        self._count("peer_restarts")
        out.append(Log("info", f"peer {member.node_id} restarted ({old} -> {incarnation})"))

    def _heard(self, node_id: str, now: float, out: list[Action]) -> None:
        t = self.members.heard(node_id, now)
        if t is not None:
            out.append(_changed(t))
            est = self.estimates.get(node_id)
            if est is not None and t.old is not MemberState.ALIVE:
                # Back after a silence (partition, pause): what we "sent" it meanwhile was
                # most likely lost; repair from its ack now instead of after the resend window.
                est.sent_version = est.unacked_since = None

    def _apply_load(self, est: Estimate, stamp: float, load: Load | None, now: float) -> None:
        if load is None or (est.stamp is not None and stamp <= est.stamp):
            return
        est.stamp = stamp
        est.load = load
        if load.speed is not None:
            est.speed = load.speed
        est.pushback_until = None if load.pushback_s is None else now + load.pushback_s

    def _apply_summary(self, est: Estimate, summary: Summary | None) -> None:
        if summary is None:
            return
        if isinstance(summary, Snapshot):
            self._apply_snapshot(est, summary)
        else:
            self._apply_delta(est, summary)

    def _apply_snapshot(self, est: Estimate, snap: Snapshot) -> None:
        if est.version is not None and snap.version <= est.version:
            self._count("gossip_stale_summaries")
            return
        self.view.replace(est.node_id, snap.hashes)
        est.version = snap.version
        est.relay_log = []
        est.relay_log_hashes = 0
        est.snapshot_cache = snap
        self._rumor(est.node_id)
        self._count("gossip_snapshots_applied")

    def _apply_delta(self, est: Estimate, delta: Delta) -> None:
        if est.version is None or delta.base > est.version:
            self._count("gossip_gaps")
            return
        held = est.version
        fresh = [c for c in delta.changes if c.version > held]
        if not fresh:
            if delta.changes:
                self._count("gossip_stale_summaries")
            return
        for change in fresh:
            self.view.apply_delta(est.node_id, change.added, change.removed)
        est.version = fresh[-1].version
        est.snapshot_cache = None
        self._extend_relay_log(est, fresh)
        self._rumor(est.node_id)
        self._count("gossip_deltas_applied")

    def _extend_relay_log(self, est: Estimate, fresh: list[Change]) -> None:
        est.relay_log.extend(fresh)
        est.relay_log_hashes += sum(len(c.added) + len(c.removed) for c in fresh)
        drop = 0
        while est.relay_log_hashes > RELAY_LOG_HASHES and drop < len(est.relay_log):
            old = est.relay_log[drop]
            est.relay_log_hashes -= len(old.added) + len(old.removed)
            drop += 1
        if drop:
            del est.relay_log[:drop]

    def _apply_ack(self, est: Estimate, ack: Ack | None, now: float) -> None:
        if ack is not None and ack.incarnation != self.config.incarnation:
            ack = None
        old = est.acked
        est.acked = ack
        if ack is None and old is not None:  # it dropped our state: start again
            est.sent_version = est.unacked_since = None
        if ack is None or (old is not None and ack.version <= old.version):
            return
        caught_up = est.sent_version is None or ack.version >= est.sent_version
        est.unacked_since = None if caught_up else now  # progress: a fresh window

    def _apply_echo(self, est: Estimate, msg: Gossip, now: float) -> None:
        if est.echo_stamp is None or msg.stamp > est.echo_stamp:
            est.echo_stamp, est.echo_at = msg.stamp, now
        echo = msg.echo
        if echo is None or (est.last_echo is not None and echo.stamp <= est.last_echo):
            return
        rtt = now - echo.stamp - echo.held_s
        if 0.0 <= rtt <= MAX_RTT_S:
            est.last_echo = echo.stamp
            self.rtt.observe(est.node_id, rtt, probe=True)
            self._count("rtt_samples")

    def _learn_peers(self, peers: tuple[PeerAddress, ...], now: float, out: list[Action]) -> None:
        for p in peers:
            if p.node_id == self.config.node_id or p.node_id in self.members:
                continue
            if len(self.members) >= MAX_MEMBERS:
                self._count("members_full_ignored")
                return
            # Known only by hearsay: it must speak (or be relayed) before we route to it.
            self.members.add(p.node_id, p.address, 0, now)
            self.members.resolve_seed(p.address)
            self.estimates[p.node_id] = Estimate(p.node_id, 0, hearsay=True)
            out.append(PeerStateChanged(p.node_id, "unknown", MemberState.ALIVE.value))

    def _apply_digest(self, digest: tuple[DigestEntry, ...], now: float, out: list[Action]) -> None:
        for d in digest:
            est = self.estimates.get(d.node_id)
            if est is not None and est.hearsay:
                self._adopt(est, d.incarnation)
            if est is None or d.incarnation != est.incarnation or d.heartbeat <= est.heartbeat:
                continue
            est.heartbeat = d.heartbeat
            self._heard(d.node_id, now, out)
            self._sync_routable(d.node_id)

    def _apply_relay(self, s: NodeState, now: float, out: list[Action]) -> None:
        if s.node_id == self.config.node_id:
            return
        est = self._resolve(s.node_id, s.incarnation, s.address, now, out)
        if est is None:
            return
        if s.heartbeat > est.heartbeat:
            est.heartbeat = s.heartbeat
            self._heard(s.node_id, now, out)
        self._apply_load(est, s.stamp, s.load, now)
        self._apply_summary(est, s.summary)
        self._sync_routable(s.node_id)

    def _refuse(self, msg: Gossip, now: float, load: Load) -> list[Action]:
        self._count("messages_rejected_fingerprint")
        self._count("messages_rejected")
        if msg.sender in self._refused or len(self._refused) >= MAX_REFUSED:
            return []
        self._refused.add(msg.sender)
        if msg.sender in self.members:
            self.forget(msg.sender)
        mine = self.config.fingerprint
        theirs = msg.fingerprint_detail
        desc = f"digest {msg.fingerprint:016x}" if theirs is None else _describe(theirs)
        text = (
            f"refusing peer {msg.sender} at {msg.address}: it serves {desc}, "
            f"but this node serves {_describe(mine)}; its cache can never match ours"
        )
        hello = self._message(None, now, load, reply=False, full=True)
        return [Log("warning", text), Send(msg.address, self.codec.encode(hello), None, hello)]

    def _reject_self(self, msg: Gossip) -> list[Action]:
        self._count("messages_rejected_self")
        self._count("messages_rejected")
        if msg.incarnation == self.config.incarnation or self._self_clash_logged:
            return []
        self._self_clash_logged = True
        text = f"another node at {msg.address} uses this node's id {msg.sender!r}"
        return [Log("error", text)]

    # ================================================================ timers and events
    def expire(self, now: float) -> list[Action]:
        """Silence timeouts: suspect, then dead (estimate dropped)."""
        actions: list[Action] = []
        for t in self.members.expire(now, self.cfg.suspect_after_s, self.cfg.dead_after_s):
            actions.append(_changed(t))
            if t.new is MemberState.DEAD:
                est = self.estimates.get(t.node_id)
                if est is not None and est.hearsay:  # only ever a rumour: no tombstone
                    self.forget(t.node_id)
                    actions.append(Log("info", f"peer {t.node_id} (hearsay) never spoke; "
                                               "forgotten"))
                    continue
                self._drop_estimate(t.node_id)
                actions.append(Log("info", f"peer {t.node_id} is dead (silent); estimate dropped"))
            self._sync_routable(t.node_id)
        return actions

    def forward_failed(self, peer_id: str, now: float) -> list[Action]:
        if peer_id not in self.members:
            return []
        t = self.members.apply(peer_id, MemberEvent.FORWARD_FAILED, now)
        self._sync_routable(peer_id)
        return [] if t is None else [_changed(t)]

    def refused_forward(self, peer_id: str, retry_after_s: float, now: float) -> None:
        """The peer answered a forward with "busy": back off as if it had pushed back."""
        est = self.estimates.get(peer_id)
        if est is None or not 0.0 < retry_after_s <= MAX_RETRY_AFTER_S:
            return  # 0: refused this request only (it would not have paid there)
        until = now + retry_after_s
        if est.pushback_until is None or est.pushback_until < until:
            est.pushback_until = until

    def forget(self, node_id: str) -> None:
        self._drop_estimate(node_id)
        self.members.remove(node_id)
        self.estimates.pop(node_id, None)
        self.routable.pop(node_id, None)

    def _drop_estimate(self, node_id: str) -> None:
        self.view.drop(node_id)
        est = self.estimates.get(node_id)
        if est is not None:
            est.reset_state()

    def _sync_routable(self, node_id: str) -> None:
        member = self.members.get(node_id)
        est = self.estimates.get(node_id)
        ok = member is not None and member.state is MemberState.ALIVE
        if ok and est is not None and est.load is not None:
            self.routable[node_id] = None
        else:
            self.routable.pop(node_id, None)

    # ================================================================== outgoing rounds
    def round(self, now: float, load: Load) -> list[Action]:
        """One anti-entropy round: a message to each target (and seeds while needed)."""
        self.heartbeat += 1
        self._live = [m.node_id for m in self.members if m.state is not MemberState.DEAD]
        # Rumor mongering leaves about e^-(k+1) of the nodes unreached after k pushes per
        # informed node; those wait for anti-entropy (a sampled digest naming the changed node,
        # ~48/N per message). k = ln N keeps that residue below one node.
        self._rumor_sends = max(RUMOR_SENDS, math.ceil(math.log(len(self._live) + 1)))
        self._full_digest = None
        self._heard_last = list(self._heard_now)[-MAX_RUMORS:]
        self._heard_now.clear()
        actions: list[Action] = []
        for member in self._targets():
            est = self.estimates[member.node_id]
            epidemic = self.cfg.mode is GossipMode.EPIDEMIC
            actions.append(self._send(est, member, now, load, reply=epidemic))
        actions.extend(self._seed_sends(now, load))
        return actions

    def _targets(self) -> list[Member]:
        """Direct modes: every live member. Epidemic: ``fanout`` random ones. Dead members
        are probed every DEAD_PROBE_EVERY rounds (all of them, or one in epidemic mode)."""
        ids = self._live
        probe = self.heartbeat % DEAD_PROBE_EVERY == 0
        dead = [m.node_id for m in self.members if m.state is MemberState.DEAD] if probe else []
        if self.cfg.mode is GossipMode.EPIDEMIC and len(ids) > self.cfg.fanout:
            ids = self.rng.sample(ids, self.cfg.fanout)
            dead = self.rng.sample(dead, 1) if dead else []
        out = []
        for node_id in [*ids, *dead]:
            member = self.members.get(node_id)
            if member is not None:
                out.append(member)
        return out

    def _seed_sends(self, now: float, load: Load) -> list[Action]:
        if not self.members.seeds:
            return []
        lonely = self.members.count(MemberState.ALIVE) == 0
        if not lonely and self.heartbeat % SEED_EVERY != 0:
            return []
        out: list[Action] = []
        for address in self.members.seeds:
            if lonely or not self.members.address_known(address):
                msg = self._message(None, now, load, reply=True, full=True)
                out.append(Send(address, self.codec.encode(msg), None, msg))
        return out

    def _send(
        self, est: Estimate, member: Member, now: float, load: Load, reply: bool, full: bool = False
    ) -> Send:
        reply = reply or est.version is None
        msg = self._message(est, now, load, reply=reply, full=full)
        est.sent += 1
        data = self.codec.encode(msg)
        return Send(member.address, data, member.node_id, msg)

    def _message(
        self, est: Estimate | None, now: float, load: Load, reply: bool, full: bool
    ) -> Gossip:
        summary = self._summary_for(est, now)
        first = est is None or est.acked is None or isinstance(summary, Snapshot)
        epidemic = self.cfg.mode is GossipMode.EPIDEMIC
        return Gossip(
            sender=self.config.node_id,
            address=self.config.address,
            incarnation=self.config.incarnation,
            version=self.summary.version,
            heartbeat=self.heartbeat,
            fingerprint=self.fingerprint,
            stamp=now,
            load=load if est is None else self._load_for(est, load),
            summary=summary,
            fingerprint_detail=self.config.fingerprint if first or full else None,
            ack=None if est is None else _ack(est),
            echo=None if est is None else self._echo(est, now),
            peers=self._peer_list(est, first, full),
            digest=self._digest(est) if epidemic else (),
            relays=self._relays(est, now) if epidemic and est is not None else (),
            reply=reply,
        )

    def _load_for(self, est: Estimate, load: Load) -> Load:
        """Our load for ``est``, its speed left out when the peer has a close enough one."""
        if load.speed is None:
            return load
        sent = est.speed_sent
        if sent is None or est.sent % SPEED_EVERY == 0 or _speed_moved(sent, load.speed):
            est.speed_sent = load.speed
            return load
        return replace(load, speed=None)

    def _summary_for(self, est: Estimate | None, now: float) -> Summary | None:
        if self.cfg.mode is GossipMode.SNAPSHOT or est is None:
            return self.summary.snapshot()
        base = self._delta_base(est, now)
        if base is None:
            summary: Summary = self.summary.snapshot()
        else:
            delta = self.summary.delta_since(base)
            if delta is None:
                self._count("gossip_snapshot_fallbacks")
                summary = self.summary.snapshot()
            elif not delta.changes:
                return None
            else:
                summary = delta
        self._sent(est, summary, now)
        return summary

    def _delta_base(self, est: Estimate, now: float) -> int | None:
        """The version to send changes after: what it acknowledged, or (optimistically, for
        a bounded window) what we already sent it, so each change normally travels once."""
        acked = None if est.acked is None else est.acked.version
        window = RESEND_AFTER_ROUNDS * self.cfg.interval_s
        since = est.unacked_since
        if est.sent_version is None or (since is not None and now - since >= window):
            est.sent_version = None  # nothing sent, or not acknowledged in time: repair
            est.unacked_since = None
            return acked
        return est.sent_version if acked is None else max(acked, est.sent_version)

    def _sent(self, est: Estimate, summary: Summary, now: float) -> None:
        est.sent_version = summary.version
        acked = None if est.acked is None else est.acked.version
        if acked is not None and acked >= summary.version:
            est.unacked_since = None
        elif est.unacked_since is None:
            est.unacked_since = now

    def _echo(self, est: Estimate, now: float) -> Echo | None:
        if est.echo_stamp is None or est.sent % ECHO_EVERY != 0:
            return None
        echo = Echo(est.echo_stamp, max(0.0, now - est.echo_at))
        est.echo_stamp = None
        return echo

    def _peer_list(self, est: Estimate | None, first: bool, full: bool) -> tuple[PeerAddress, ...]:
        """Everyone for joiners; a small random sample on first contact and now and then."""
        target = None if est is None else est.node_id
        if full:
            ids = [m.node_id for m in self.members if m.state is not MemberState.DEAD]
        elif first or (est is not None and est.sent % SAMPLE_EVERY == 0):
            ids = self._live if len(self._live) <= PEER_SAMPLE else self._sample_live()
        else:
            return ()
        out = []
        for node_id in ids:
            member = self.members.get(node_id)
            if node_id != target and member is not None and member.state is not MemberState.DEAD:
                out.append(PeerAddress(node_id, member.address))
        return tuple(out[: self.codec.limits.max_peers])

    def _sample_live(self) -> list[str]:
        return self.rng.sample(self._live, PEER_SAMPLE + 1)

    def _digest(self, target: Estimate | None) -> tuple[DigestEntry, ...]:
        """What we know of others: all of it in small meshes, else a random sample plus the
        nodes whose state changed recently (so per-message work stays bounded at large N)."""
        if len(self._live) <= DIGEST_FULL:
            if self._full_digest is None:
                self._full_digest = tuple(self._entries(self._live))
            return self._full_digest
        ids = self.rng.sample(self._live, DIGEST_SAMPLE)
        ids.extend(list(self._recent)[-MAX_RUMORS:])
        ids.extend(self._heard_last)  # first-hand heartbeats spread fastest from here
        skip = None if target is None else target.node_id
        return tuple(self._entries(dict.fromkeys(i for i in ids if i != skip)))

    def _entries(self, ids: Iterable[str]) -> Iterator[DigestEntry]:
        for node_id in ids:
            est = self.estimates.get(node_id)
            if est is not None and not est.hearsay:
                yield DigestEntry(node_id, est.incarnation, est.version, est.heartbeat)

    def _relays(self, target: Estimate, now: float) -> tuple[NodeState, ...]:
        """States the target lacks, judged by its latest digest, plus recent changes."""
        knows = target.knows or {}
        wanted: dict[str, Estimate] = {}
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
        if len(chosen) > MAX_RELAYS:
            chosen = self.rng.sample(chosen, MAX_RELAYS)
        sent = {e.node_id for e in chosen}
        for node_id in rumors:  # a rumor counts as pushed only if it made the sample
            if node_id in sent:
                self._spend_rumor(node_id)
        out: list[NodeState] = []
        budget = MAX_RELAY_HASHES
        for e in chosen:
            state = self._relay_state(e, knows.get(e.node_id), now, budget)
            budget -= _hash_count(state.summary)
            out.append(state)
        return tuple(out)

    def _rumor(self, node_id: str) -> None:
        if self.cfg.mode is GossipMode.EPIDEMIC:
            self._recent.pop(node_id, None)
            self._recent[node_id] = self._rumor_sends  # newest last
            if len(self._recent) > MAX_RECENT:  # under churn: the newest changes go first
                del self._recent[next(iter(self._recent))]

    def _spend_rumor(self, node_id: str) -> None:
        left = self._recent[node_id] - 1
        if left > 0:
            self._recent[node_id] = left
        else:
            del self._recent[node_id]

    def _relayable(self, node_id: str, target: Estimate) -> Estimate | None:
        member = self.members.get(node_id)
        if member is None or member.state is MemberState.DEAD or node_id == target.node_id:
            return None
        est = self.estimates.get(node_id)
        return None if est is None or est.hearsay else est

    def _relay_state(
        self, e: Estimate, known: DigestEntry | None, now: float, budget: int
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
            )
        stamp = 0.0 if e.stamp is None else e.stamp
        return NodeState(e.node_id, address, e.incarnation, e.heartbeat, stamp, load, summary)

    def _relay_summary(self, e: Estimate, known: DigestEntry | None, budget: int) -> Summary | None:
        if e.version is None:
            return None
        if known is None:  # a rumor: the target's version is unknown
            return self._rumor_summary(e, budget)
        base = known.version if known.incarnation == e.incarnation else None
        if base is not None and base >= e.version:
            return None
        if base is not None and e.relay_log and e.relay_log[0].version <= base + 1:
            return Delta(base, tuple(c for c in e.relay_log if c.version > base))
        return self._relay_snapshot(e, budget)

    def _rumor_summary(self, e: Estimate, budget: int) -> Summary | None:
        """The last few changes (applies if the target is not too far behind), else a small
        snapshot; a target further behind shows it in its digest and is repaired then."""
        if e.relay_log:
            tail = tuple(e.relay_log[-RUMOR_CHANGES:])
            return Delta(tail[0].version - 1, tail)
        return self._relay_snapshot(e, min(budget, RUMOR_SNAPSHOT_HASHES))

    def _relay_snapshot(self, e: Estimate, budget: int) -> Snapshot | None:
        assert e.version is not None
        if self.view.size(e.node_id) > budget:
            return None
        if e.snapshot_cache is None or e.snapshot_cache.version != e.version:
            e.snapshot_cache = Snapshot(e.version, tuple(sorted(self.view.held(e.node_id))))
        return e.snapshot_cache

    # ------------------------------------------------------------------------------ misc
    def _count(self, name: str, by: float = 1.0) -> None:
        self.metrics[name] = self.metrics.get(name, 0.0) + by


def _ack(est: Estimate) -> Ack | None:
    return None if est.version is None else Ack(est.incarnation, est.version)


def _newer(e: Estimate, known: DigestEntry) -> bool:
    """Whether our state of a node is newer than the target's (heartbeats travel in digests)."""
    if e.incarnation != known.incarnation:
        return e.incarnation > known.incarnation
    mine = -1 if e.version is None else e.version
    theirs = -1 if known.version is None else known.version
    return mine > theirs


def _speed_moved(old: SpeedReport, new: SpeedReport) -> bool:
    pairs = (
        (old.prefill_overhead_s, new.prefill_overhead_s),
        (old.prefill_s_per_token, new.prefill_s_per_token),
        (old.decode_s_per_token, new.decode_s_per_token),
        (old.mean_service_s, new.mean_service_s),
    )
    return any(abs(b - a) > SPEED_CHANGE * max(abs(a), 1e-12) for a, b in pairs)


def _hash_count(summary: Summary | None) -> int:
    if summary is None:
        return 0
    if isinstance(summary, Snapshot):
        return len(summary.hashes)
    return sum(len(c.added) + len(c.removed) for c in summary.changes)


def _changed(t: Transition) -> PeerStateChanged:
    return PeerStateChanged(t.node_id, t.old.value, t.new.value)


def _describe(fp: Fingerprint) -> str:
    return f"model {fp.model!r}, tokenizer {fp.tokenizer!r}, block size {fp.block_size}"
