"""Failure detection: who exists, their incarnations and heartbeats, alive / suspect / dead.

Theory of operation
-------------------
The member table (:mod:`membership`) holds each peer's state; this module decides what moves
it, and keeps one :class:`PeerEstimate` per member (its identity and liveness part)::

    message from X, incarnation i:  unknown X   -> join (ALIVE), unless the table is full
                                    i < held    -> stale: the whole message is rejected
                                    i > held    -> restart: its state is dropped, start again
    heartbeat = a message from X, or a newer round counter of X in a digest or a relay
                (epidemic: liveness travels without everyone talking to everyone)
    silence   = suspect after ``suspect_after_s``, dead after ``dead_after_s`` (state dropped;
                a member known only by hearsay that never spoke is forgotten, no tombstone)

Peers named in others' peer lists join as *hearsay* (incarnation unknown, not routable) until
they speak or a digest names their incarnation. Seeds are addresses contacted until someone
answers: while no alive peer is known, each with exponential backoff in rounds (1, 2, 4, ...
up to ``JoinConfig.seed_backoff_max_rounds``: a seed that is down is not hit every round),
then every ``seed_every`` rounds while unknown. Seeds come from the config and, later, from
``SeedsDiscovered`` (DNS): a new address is contacted at once. Dead members are probed every
``dead_probe_every`` rounds, so healed partitions and restarts are found again. A peer that
serves another model (fingerprint) is refused once, with one log line, and forgotten.
"""

from __future__ import annotations

from collections.abc import Callable
from random import Random  # the type only: instances are passed in, never the global one

from radixmesh.core.blocks import Fingerprint
from radixmesh.core.config import NodeConfig
from radixmesh.core.events import Action, Log, PeerStateChanged
from radixmesh.core.membership import Member, MemberEvent, Membership, MemberState, Transition
from radixmesh.core.messages import DigestEntry, Gossip, PeerAddress
from radixmesh.core.peer_estimate import PeerEstimate, bump


class FailureDetector:
    """The members and their estimates: joins, restarts, heartbeats, silence, refusals."""

    def __init__(
        self,
        config: NodeConfig,
        members: Membership,
        rng: Random,
        metrics: dict[str, float],
        drop_payload: Callable[[str], None],  # forget what a peer's payload held
        max_peers: int,  # peers named in one message, at most (the codec's limit)
    ) -> None:
        self.config = config
        self.cfg = config.gossip
        self.mcfg = config.gossip.membership
        self.members = members
        self.rng = rng
        self.metrics = metrics
        self._drop_payload = drop_payload
        self._max_peers = max_peers
        self.heartbeat = 0  # our own round counter
        self.estimates: dict[str, PeerEstimate] = {}
        self.routable: dict[str, None] = {}  # alive peers with a load report (ordered set)
        self.live: list[str] = []  # non-dead members, rebuilt once per round
        self._refused: set[str] = set()
        self._self_clash_logged = False

    def begin_round(self) -> None:
        self.heartbeat += 1
        self.live = [m.node_id for m in self.members if m.state is not MemberState.DEAD]

    # ======================================================================== who exists
    def resolve(
        self, node_id: str, incarnation: int, address: str, now: float, out: list[Action]
    ) -> PeerEstimate | None:
        """The estimate to update for this sender (new, restarted), or None if stale."""
        member = self.members.get(node_id)
        if member is None:
            if len(self.members) >= self.mcfg.max_members:
                bump(self.metrics, "members_full_ignored")
                return None
            self.members.add(node_id, address, incarnation, now)
            self.members.resolve_seed(address)
            out.append(PeerStateChanged(node_id, "unknown", MemberState.ALIVE.value))
            out.append(Log("info", f"peer {node_id} joined at {address}"))
            est = self.estimates[node_id] = PeerEstimate(node_id, incarnation)
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

    def _adopt(self, est: PeerEstimate, incarnation: int) -> None:
        """A node known by hearsay is now known first-hand: take its incarnation as is."""
        est.hearsay = False
        est.incarnation = incarnation
        member = self.members.get(est.node_id)
        if member is not None:
            member.incarnation = incarnation

    def _restart(
        self, member: Member, est: PeerEstimate, incarnation: int, now: float, out: list[Action]
    ) -> None:
        old = member.incarnation
        self._drop_payload(member.node_id)
        est.restart(incarnation)
        member.incarnation = incarnation
        member.last_heard = max(member.last_heard, now)
        self.routable.pop(member.node_id, None)
        bump(self.metrics, "peer_restarts")
        out.append(Log("info", f"peer {member.node_id} restarted ({old} -> {incarnation})"))

    def learn_peers(self, peers: tuple[PeerAddress, ...], now: float, out: list[Action]) -> None:
        for p in peers:
            if p.node_id == self.config.node_id or p.node_id in self.members:
                continue
            if len(self.members) >= self.mcfg.max_members:
                bump(self.metrics, "members_full_ignored")
                return
            # Known only by hearsay: it must speak (or be relayed) before we route to it.
            self.members.add(p.node_id, p.address, 0, now)
            self.members.resolve_seed(p.address)
            self.estimates[p.node_id] = PeerEstimate(p.node_id, 0, hearsay=True)
            out.append(PeerStateChanged(p.node_id, "unknown", MemberState.ALIVE.value))

    def forget(self, node_id: str) -> None:
        self.reset(node_id)
        self.members.remove(node_id)
        self.estimates.pop(node_id, None)
        self.routable.pop(node_id, None)

    def reset(self, node_id: str) -> None:
        """Drop a peer's state but keep it as a member (dead: a tombstone)."""
        self._drop_payload(node_id)
        est = self.estimates.get(node_id)
        if est is not None:
            est.reset_state()

    # ================================================================ alive/suspect/dead
    def heard_directly(
        self, est: PeerEstimate, heartbeat: int, now: float, out: list[Action]
    ) -> None:
        """A message from the peer itself: always a heartbeat."""
        est.heartbeat = max(est.heartbeat, heartbeat)
        self.heard(est.node_id, now, out)

    def heard_relayed(
        self, est: PeerEstimate, heartbeat: int, now: float, out: list[Action]
    ) -> None:
        """Its state relayed by another: a heartbeat only if its round counter moved on."""
        if heartbeat > est.heartbeat:
            est.heartbeat = heartbeat
            self.heard(est.node_id, now, out)

    def heard(self, node_id: str, now: float, out: list[Action]) -> None:
        t = self.members.heard(node_id, now)
        if t is not None:
            out.append(_changed(t))
            est = self.estimates.get(node_id)
            if est is not None and t.old is not MemberState.ALIVE:
                # Back after a silence (partition, pause): what we "sent" it meanwhile was
                # most likely lost; repair from its ack now instead of after the resend window.
                est.resend_from_ack()

    def apply_digest(self, digest: tuple[DigestEntry, ...], now: float, out: list[Action]) -> None:
        """Newer heartbeats named in an epidemic digest count as hearing from those nodes."""
        for d in digest:
            est = self.estimates.get(d.node_id)
            if est is not None and est.hearsay:
                self._adopt(est, d.incarnation)
            if est is None or d.incarnation != est.incarnation or d.heartbeat <= est.heartbeat:
                continue
            est.heartbeat = d.heartbeat
            self.heard(d.node_id, now, out)
            self.sync_routable(d.node_id)

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
                self.reset(t.node_id)
                actions.append(Log("info", f"peer {t.node_id} is dead (silent); estimate dropped"))
            self.sync_routable(t.node_id)
        return actions

    def forward_failed(self, peer_id: str, now: float) -> list[Action]:
        if peer_id not in self.members:
            return []
        t = self.members.apply(peer_id, MemberEvent.FORWARD_FAILED, now)
        self.sync_routable(peer_id)
        return [] if t is None else [_changed(t)]

    def sync_routable(self, node_id: str) -> None:
        member = self.members.get(node_id)
        est = self.estimates.get(node_id)
        ok = member is not None and member.state is MemberState.ALIVE
        if ok and est is not None and est.load is not None:
            self.routable[node_id] = None
        else:
            self.routable.pop(node_id, None)

    # ========================================================================== refusals
    def refuse(self, msg: Gossip) -> Log | None:
        """A peer serving another model: the log line the first time (then it is forgotten)."""
        bump(self.metrics, "messages_rejected_fingerprint")
        bump(self.metrics, "messages_rejected")
        if msg.sender in self._refused or len(self._refused) >= self.mcfg.max_refused:
            return None
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
        return Log("warning", text)

    def reject_self(self, msg: Gossip) -> list[Action]:
        bump(self.metrics, "messages_rejected_self")
        bump(self.metrics, "messages_rejected")
        if msg.incarnation == self.config.incarnation or self._self_clash_logged:
            return []
        self._self_clash_logged = True
        text = f"another node at {msg.address or '?'} uses this node's id {msg.sender!r}"
        return [Log("error", text)]

    # ====================================================== what membership sends along
    def peer_list(
        self, target: str | None, first: bool, full: bool, sent: int
    ) -> tuple[PeerAddress, ...]:
        """Everyone for joiners; a small random sample on first contact and now and then."""
        if full:
            ids = [m.node_id for m in self.members if m.state is not MemberState.DEAD]
        elif first or (target is not None and sent % self.mcfg.sample_every == 0):
            sample = self.mcfg.peer_sample
            ids = self.live if len(self.live) <= sample else self.rng.sample(self.live, sample + 1)
        else:
            return ()
        out = []
        for node_id in ids:
            member = self.members.get(node_id)
            if node_id != target and member is not None and member.state is not MemberState.DEAD:
                out.append(PeerAddress(node_id, member.address))
        return tuple(out[: self._max_peers])

    def dead_due(self) -> list[str]:
        """Dead members to probe this round (every ``dead_probe_every`` rounds), else none."""
        if self.heartbeat % self.mcfg.dead_probe_every != 0:
            return []
        return [m.node_id for m in self.members if m.state is MemberState.DEAD]

    def seeds_due(self) -> list[str]:
        """Seed addresses to contact this round: all while lonely, else unknown ones now and
        then (every ``seed_every`` rounds)."""
        if not self.members.seeds:
            return []
        lonely = self.members.count(MemberState.ALIVE) == 0
        if not lonely and self.heartbeat % self.mcfg.seed_every != 0:
            return []
        if not lonely:
            return [a for a in self.members.seeds if not self.members.address_known(a)]
        due = [a for a in self.members.seeds if self.members.seed_ready(a, self.heartbeat)]
        self._contacted(due)
        return due

    def add_seeds(self, addresses: tuple[str, ...]) -> list[str]:
        """Newly discovered seed addresses (own address and known members' skipped), marked
        as contacted now: the caller greets them at once. Returns those that are new."""
        own = self.config.address
        fresh = tuple(a for a in addresses if a != own)
        added = self.members.add_seeds(fresh, self.config.join.max_seeds)
        self._contacted(added)
        return added

    def _contacted(self, addresses: list[str]) -> None:
        cap = self.config.join.seed_backoff_max_rounds
        for address in addresses:
            self.members.seed_contacted(address, self.heartbeat, cap)


def _changed(t: Transition) -> PeerStateChanged:
    return PeerStateChanged(t.node_id, t.old.value, t.new.value)


def _describe(fp: Fingerprint) -> str:
    return f"model {fp.model!r}, tokenizer {fp.tokenizer!r}, block size {fp.block_size}"
