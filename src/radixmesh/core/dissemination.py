"""Dissemination: rounds, targets, and what each message carries to whom.

Theory of operation
-------------------
Every node is the single writer of its own state: a versioned :class:`Payload` (the cache
summary, see :mod:`cache_payload`) and its load. Each round it sends one :class:`Gossip` to
each target; receivers keep the newest of each per peer and only ever move it forward::

    payload:  Snapshot v  applied iff v > held version
              Delta base..v applied iff base <= held version (entries above held are applied)
    load:     applied iff the sender's stamp is newer than the last applied one

so duplicates, reordering, delay and loss never regress a view (loss only delays it).

Modes (``GossipConfig.mode``)
    snapshot   every round carries the sender's full payload to every live member (the paper).
    delta      every round carries the entries after the version the receiver holds: its last
               ack (acks ride on the receiver's own messages) or, optimistically, what we last
               sent it, for at most ``exchange.resend_after_rounds`` rounds without ack progress
               (then from the ack again: lost messages are re-sent). A receiver that holds
               nothing, or is behind our change log, gets a snapshot. A gap (base above what
               it holds) is ignored and counted; the fallback to its ack repairs it.
    epidemic   delta to ``fanout`` random members per round, push-pull, plus digests, rumors
               and relays of others' states (:mod:`epidemic`).

Alongside the payload ride: our address and fingerprint (until the receiver acknowledges
this incarnation, then every ``identity_every`` messages: it knows them), load (with our speed
only when it moved by ``speed_change`` or every ``speed_every`` messages), push-back,
membership (peer lists, :mod:`failure`) and RTT
echoes: each message now and then echoes the last stamp received from its destination and how
long it was held, so the destination computes ``rtt = now - stamp - held`` on its own clock,
without clock sync. Dead members are probed every ``dead_probe_every`` rounds.
"""

from __future__ import annotations

from dataclasses import replace
from random import Random  # the type only: instances are passed in, never the global one

from radixmesh.core.adapters import PeerAdapters
from radixmesh.core.codec import Codec
from radixmesh.core.config import GossipMode, NodeConfig
from radixmesh.core.epidemic import Epidemic
from radixmesh.core.estimators import SpeedReport
from radixmesh.core.events import Action, Send
from radixmesh.core.failure import FailureDetector
from radixmesh.core.load_estimates import RttTable
from radixmesh.core.membership import Member
from radixmesh.core.messages import (
    Ack,
    Delta,
    Echo,
    Gossip,
    Load,
    NodeState,
    Snapshot,
    Summary,
)
from radixmesh.core.payload import Payload
from radixmesh.core.peer_estimate import PeerEstimate, bump
from radixmesh.core.sessions import SessionTable
from radixmesh.core.shadow_state import worth_sending

# a relayed state stamped further ahead of its node's clock than this is not its own
# (``Disseminator.apply_relay``), nor a held stamp that far ahead of its own next message
STAMP_AHEAD_S = 60.0


class Disseminator:
    """Builds each round's messages and applies the states that arrive."""

    def __init__(
        self,
        config: NodeConfig,
        payload: Payload,
        failure: FailureDetector,
        rtt: RttTable,
        codec: Codec,
        rng: Random,
        metrics: dict[str, float],
    ) -> None:
        self.config = config
        self.cfg = config.gossip
        self.xcfg = config.gossip.exchange
        self.payload = payload
        self.failure = failure
        self.members = failure.members
        self.rtt = rtt
        self.codec = codec
        self.rng = rng
        self.metrics = metrics
        self.fingerprint = config.fingerprint.digest
        self.epidemic = Epidemic(config.gossip, failure, payload, rng)
        self.sessions: SessionTable | None = None  # (tenants) core/sessions.py, set by parts
        self.adapters: PeerAdapters | None = None  # (tenants) core/adapters.py, set by parts

    # ================================================================= outgoing rounds
    def round(self, now: float, load: Load) -> list[Action]:
        """One round: a message to each target (and seeds while needed)."""
        self.epidemic.begin_round(len(self.failure.live))
        actions: list[Action] = []
        for member in self._targets():
            est = self.failure.estimates[member.node_id]
            actions.append(self.send(est, member, now, load, reply=self.epidemic.enabled))
        for address in self.failure.seeds_due():
            actions.append(self.hello(address, now, load, reply=True))
        return actions

    def _targets(self) -> list[Member]:
        """Direct modes: every live member. Epidemic: ``fanout`` random ones. Dead members
        are probed now and then (all of them, or one in epidemic mode)."""
        ids = self.failure.live
        dead = self.failure.dead_due()
        if self.epidemic.enabled and len(ids) > self.cfg.fanout:
            ids = self.rng.sample(ids, self.cfg.fanout)
            dead = self.rng.sample(dead, 1) if dead else []
        out = []
        for node_id in [*ids, *dead]:
            member = self.members.get(node_id)
            if member is not None:
                out.append(member)
        return out

    def hello(self, address: str, now: float, load: Load, reply: bool) -> Send:
        """A message to an address whose node we do not know (a seed, a refused peer)."""
        msg = self._message(None, now, load, reply=reply, full=True)
        return Send(address, self.codec.encode(msg), None, msg)

    def send(
        self, est: PeerEstimate, member: Member, now: float, load: Load, reply: bool,
        full: bool = False,
    ) -> Send:
        reply = reply or est.version is None
        msg = self._message(est, now, load, reply=reply, full=full)
        est.sent += 1
        data = self.codec.encode(msg)
        return Send(member.address, data, member.node_id, msg)

    def _message(
        self, est: PeerEstimate | None, now: float, load: Load, reply: bool, full: bool
    ) -> Gossip:
        summary = self._summary_for(est, now)
        first = est is None or est.acked is None or isinstance(summary, Snapshot)
        target = None if est is None else est.node_id
        every = self.xcfg.identity_every  # (else: the receiver knows who we are)
        known = not (first or full) and est is not None and bool(est.sent % every)
        return Gossip(
            sender=self.config.node_id,
            address=None if known else self.config.address,
            incarnation=self.config.incarnation,
            version=self.payload.version,
            heartbeat=self.failure.heartbeat,
            fingerprint=None if known else self.fingerprint,
            stamp=now,
            load=load if est is None else self._load_for(est, load, now),
            summary=summary,
            fingerprint_detail=self.config.fingerprint if first or full else None,
            ack=None if est is None else _ack(est),
            echo=None if est is None else self._echo(est, now),
            peers=self.failure.peer_list(target, first, full, 0 if est is None else est.sent),
            digest=self.epidemic.digest(target) if self.epidemic.enabled else (),
            relays=self._relays(est, now),  # evaluated last: rng draws stay in this order
            reply=reply,
            sessions=() if self.sessions is None else self.sessions.recent(now),
            adapters=tuple(a.key for a in self.config.adapters),
            adapter_names=() if known else self.config.adapters,
        )

    def _report_horizon(self) -> float:
        """How long a peer goes on using the batch we send it, at most: until our next
        round, which an announcement brings forward to ``announce_gap_s`` (delta mode)."""
        gap = self.cfg.announce_s
        return self.cfg.interval_s if gap is None else min(self.cfg.interval_s, gap)

    def _relays(self, est: PeerEstimate | None, now: float) -> tuple[NodeState, ...]:
        return self.epidemic.relays(est, now) if self.epidemic.enabled and est is not None else ()

    def _load_for(self, est: PeerEstimate, load: Load, now: float) -> Load:
        """Our load for ``est``, its speed left out when the peer has a close enough one,
        its batch when the peer's copy is still good (``shadow_state.worth_sending``)."""
        if load.batch is not None:
            if worth_sending(est.batch_sent, load.batch, now, self.cfg.interval_s,
                             self._report_horizon()):
                est.batch_sent = (load.batch, now)
            else:
                load = replace(load, batch=None)
        if load.speed is None:
            return load
        sent, x = est.speed_sent, self.xcfg
        if (
            sent is None
            or est.sent % x.speed_every == 0
            or _speed_moved(sent, load.speed, x.speed_change)
        ):
            est.speed_sent = load.speed
            return load
        return replace(load, speed=None)

    def _summary_for(self, est: PeerEstimate | None, now: float) -> Summary | None:
        if self.cfg.mode is GossipMode.SNAPSHOT or est is None:
            return self.payload.local_state()
        base = self._delta_base(est, now)
        if base is None:
            summary: Summary = self.payload.local_state()
        else:
            delta = self.payload.local_changes(base)
            if delta is None:
                bump(self.metrics, "gossip_snapshot_fallbacks")
                summary = self.payload.local_state()
            elif not delta.changes:
                return None
            else:
                summary = delta
        self._sent(est, summary, now)
        return summary

    def _delta_base(self, est: PeerEstimate, now: float) -> int | None:
        """The version to send changes after: what it acknowledged, or (optimistically, for
        a bounded window) what we already sent it, so each change normally travels once."""
        acked = None if est.acked is None else est.acked.version
        window = self.xcfg.resend_after_rounds * self.cfg.interval_s
        since = est.unacked_since
        if est.sent_version is None or (since is not None and now - since >= window):
            est.resend_from_ack()  # nothing sent, or not acknowledged in time: repair
            return acked
        return est.sent_version if acked is None else max(acked, est.sent_version)

    def _sent(self, est: PeerEstimate, summary: Summary, now: float) -> None:
        est.sent_version = summary.version
        acked = None if est.acked is None else est.acked.version
        if acked is not None and acked >= summary.version:
            est.unacked_since = None
        elif est.unacked_since is None:
            est.unacked_since = now

    def _echo(self, est: PeerEstimate, now: float) -> Echo | None:
        if est.echo_stamp is None or est.sent % self.xcfg.echo_every != 0:
            return None
        echo = Echo(est.echo_stamp, max(0.0, now - est.echo_at))
        est.echo_stamp = None
        return echo

    # ================================================================= incoming states
    def drop_future_stamp(self, est: PeerEstimate, stamp: float) -> None:
        """The peer's own message is stamped ``stamp``; a stamp held for it further ahead
        than ``STAMP_AHEAD_S`` came from a relay and is not its own (within an incarnation a
        node's clock only moves on): dropped, so that its real reports apply again."""
        if est.stamp is not None and est.stamp > stamp + STAMP_AHEAD_S:
            est.stamp = None
            bump(self.metrics, "gossip_future_stamps_dropped")

    def apply_direct(self, est: PeerEstimate, msg: Gossip, now: float, newest: bool) -> None:
        """The sender's own state, ack and echo (``newest``: no newer message applied yet)."""
        self.epidemic.heard_first_hand(msg.sender)
        self._apply_load(est, msg.stamp, msg.load, now)
        self._apply_summary(est, msg.summary)
        self._apply_echo(est, msg, now)
        if msg.sessions and self.sessions is not None:
            self.sessions.learn(msg.sender, msg.sessions, now)
        if self.adapters is not None:
            self.adapters.learn(msg.sender, msg.adapters)
            if msg.address is not None:  # (its identity: the names come with it)
                self.adapters.learn_names(msg.sender, msg.adapter_names)
        if newest:
            self._apply_ack(est, msg.ack, now)
            if msg.digest:
                self.epidemic.keep_knows(est, msg.digest)

    def apply_relay(self, s: NodeState, now: float, out: list[Action]) -> None:
        """Another node's state relayed by the sender (epidemic). A state stamped further
        ahead of its node's clock (as its own messages set it) than ``STAMP_AHEAD_S`` cannot
        be its own: counted and dropped (kept, it would hold back every real report after it,
        which must be newer)."""
        if s.node_id == self.config.node_id:
            return
        est = self.failure.resolve(s.node_id, s.incarnation, s.address, now, out)
        if est is None:
            return
        if est.clock_offset is not None and s.stamp > now + est.clock_offset + STAMP_AHEAD_S:
            bump(self.metrics, "gossip_relays_from_future")
            return
        self.failure.heard_relayed(est, s.heartbeat, now, out)
        self._apply_load(est, s.stamp, s.load, now)
        self._apply_summary(est, s.summary)
        self.failure.sync_routable(s.node_id)

    def _apply_load(self, est: PeerEstimate, stamp: float, load: Load | None, now: float) -> None:
        if load is None or (est.stamp is not None and stamp <= est.stamp):
            return
        est.stamp = stamp
        est.load = load
        if load.speed is not None:
            est.speed = load.speed
        # its clock to ours through the stamp (an age, whatever the two clocks read; a
        # relayed report's age counts from its stamp, so it reads younger by the relay's
        # delay, a fraction of a second against the stale-speed rule's 10 s window)
        est.speed_measured_at = (None if load.speed_measured_at is None
                                 else now - max(0.0, stamp - load.speed_measured_at))
        # a push-back longer than the longest back-off a node honours is held to it (it is
        # advertised again each round while it lasts; an absurd one must not bar a peer for good)
        est.pushback_until = (None if load.pushback_s is None
                              else now + min(load.pushback_s, self.xcfg.max_retry_after_s))

    def _apply_summary(self, est: PeerEstimate, summary: Summary | None) -> None:
        if summary is None:
            return
        if isinstance(summary, Snapshot):
            self._apply_snapshot(est, summary)
        else:
            self._apply_delta(est, summary)

    def _apply_snapshot(self, est: PeerEstimate, snap: Snapshot) -> None:
        if est.version is not None and snap.version <= est.version:
            bump(self.metrics, "gossip_stale_summaries")
            return
        self.payload.merge_remote_state(est.node_id, snap)
        est.version = snap.version
        self.epidemic.note_snapshot(est)
        bump(self.metrics, "gossip_snapshots_applied")

    def _apply_delta(self, est: PeerEstimate, delta: Delta) -> None:
        if est.version is None or delta.base > est.version:
            bump(self.metrics, "gossip_gaps")
            return
        held = est.version
        fresh = [c for c in delta.changes if c.version > held]
        if not fresh:
            if delta.changes:
                bump(self.metrics, "gossip_stale_summaries")
            return
        self.payload.merge_remote_changes(est.node_id, fresh)
        est.version = fresh[-1].version
        if self.payload.remote_size(est.node_id) > self.cfg.max_hashes:
            # more than its whole summary may hold (one snapshot's worth): what we hold of
            # it is wrong; dropped (bounded memory), it is sent whole again
            self.payload.forget_remote(est.node_id)
            est.version = None
            bump(self.metrics, "gossip_views_over_limit")
        self.epidemic.note_changes(est, fresh)
        bump(self.metrics, "gossip_deltas_applied")

    def _apply_ack(self, est: PeerEstimate, ack: Ack | None, now: float) -> None:
        if ack is not None and ack.incarnation != self.config.incarnation:
            ack = None
        old = est.acked
        est.acked = ack
        if ack is None and old is not None:  # it dropped our state: start again
            est.resend_from_ack()
        if ack is None or (old is not None and ack.version <= old.version):
            return
        caught_up = est.sent_version is None or ack.version >= est.sent_version
        est.unacked_since = None if caught_up else now  # progress: a fresh window

    def _apply_echo(self, est: PeerEstimate, msg: Gossip, now: float) -> None:
        est.clock_offset = msg.stamp - now
        if est.echo_stamp is None or msg.stamp > est.echo_stamp:
            est.echo_stamp, est.echo_at = msg.stamp, now
        echo = msg.echo
        if echo is None or (est.last_echo is not None and echo.stamp <= est.last_echo):
            return
        rtt = now - echo.stamp - echo.held_s
        if 0.0 <= rtt <= self.xcfg.max_rtt_s:
            est.last_echo = echo.stamp
            self.rtt.observe(est.node_id, rtt, probe=True)
            bump(self.metrics, "rtt_samples")

    # ========================================================================= push-back
    def refused_forward(self, peer_id: str, retry_after_s: float, now: float) -> None:
        """The peer answered a forward with "busy": back off as if it had pushed back."""
        est = self.failure.estimates.get(peer_id)
        if est is None or not 0.0 < retry_after_s <= self.xcfg.max_retry_after_s:
            return  # 0: refused this request only (it would not have paid there)
        until = now + retry_after_s
        if est.pushback_until is None or est.pushback_until < until:
            est.pushback_until = until


def _ack(est: PeerEstimate) -> Ack | None:
    return None if est.version is None else Ack(est.incarnation, est.version)


def _speed_moved(old: SpeedReport, new: SpeedReport, threshold: float) -> bool:
    pairs = (
        (old.prefill_overhead_s, new.prefill_overhead_s),
        (old.prefill_s_per_token, new.prefill_s_per_token),
        (old.decode_s_per_token, new.decode_s_per_token),
        (old.mean_service_s, new.mean_service_s),
    )
    return any(abs(b - a) > threshold * max(abs(a), 1e-12) for a, b in pairs)
