"""The gossip layer as the node sees it: one :class:`Gossiper` composing its parts.

Theory of operation
-------------------
Gossip is split by what each part decides; every part is pure (time and a ``Random`` are
passed in) and all share one :class:`PeerEstimate` per peer::

    failure.py        FailureDetector  who exists: joins, incarnations (restarts, stale),
                                       heartbeats, alive/suspect/dead, seeds, refusals
    dissemination.py  Disseminator     rounds, targets, what each message carries (snapshot /
                                       delta / ack, load, speed, push-back, RTT echoes) and
                                       applying what arrives; the ``Payload`` interface
    epidemic.py       Epidemic         digests, rumors and relays of others' states
    cache_payload.py  CachePayload     the cache summary as the payload (LocalSummary out,
                                       PeerView in)

One incoming message is applied in this order: identity (sender's incarnation: new, restart,
stale), its heartbeat, its own state (load, payload, echo, ack, digest kept), the peers it
names, the heartbeats in its digest, the states it relays, then an answer if it asked.
One round: our heartbeat moves on, then a message to each target and the seeds due.
Configuration: ``GossipConfig`` with ``membership``, ``exchange`` and ``epidemic`` parts.
"""

from __future__ import annotations

from random import Random  # the type only: instances are passed in, never the global one

from radixmesh.core.cache_payload import CachePayload
from radixmesh.core.cache_summary import LocalSummary
from radixmesh.core.codec import Codec
from radixmesh.core.config import NodeConfig
from radixmesh.core.dissemination import Disseminator
from radixmesh.core.events import Action
from radixmesh.core.failure import FailureDetector
from radixmesh.core.load_estimates import RttTable
from radixmesh.core.membership import Membership
from radixmesh.core.messages import Gossip, Load
from radixmesh.core.peer_estimate import PeerEstimate, bump
from radixmesh.core.peerview import PeerView

__all__ = ["Gossiper", "PeerEstimate"]


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
        self.metrics = metrics
        self.payload = CachePayload(summary, view)
        self.failure = FailureDetector(
            config, members, rng, metrics, self.payload.forget_remote, codec.limits.max_peers
        )
        self.dissemination = Disseminator(
            config, self.payload, self.failure, rtt, codec, rng, metrics
        )
        self.estimates: dict[str, PeerEstimate] = self.failure.estimates
        self.routable: dict[str, None] = self.failure.routable  # an ordered set

    def receive(self, msg: Gossip, now: float, load: Load) -> list[Action]:
        """Apply one decoded message; returns replies, logs and state changes."""
        if msg.sender == self.config.node_id:
            return self.failure.reject_self(msg)
        failure = self.failure
        address = msg.address if msg.fingerprint is not None else self._known_address(msg)
        if address is None:  # no identity, and we do not know it: it repeats it soon
            bump(self.metrics, "messages_rejected_unverified")
            bump(self.metrics, "messages_rejected")
            return []
        if msg.fingerprint is not None and msg.fingerprint != self.config.fingerprint.digest:
            return self._refuse(msg, now, load)
        actions: list[Action] = []
        est = failure.resolve(msg.sender, msg.incarnation, address, now, actions)
        if est is None:  # an older incarnation, or a new id while the member table is full
            full = msg.sender not in failure.members
            bump(self.metrics, "messages_rejected_members_full" if full else
                 "messages_rejected_stale")  # fmt: skip
            bump(self.metrics, "messages_rejected")
            return actions
        self.dissemination.drop_future_stamp(est, msg.stamp)
        newest = est.stamp is None or msg.stamp >= est.stamp
        failure.heard_directly(est, msg.heartbeat, now, actions)
        self.dissemination.apply_direct(est, msg, now, newest)
        failure.learn_peers(msg.peers, now, actions)
        failure.apply_digest(msg.digest, now, actions)
        for state in msg.relays:
            self.dissemination.apply_relay(state, now, actions)
        failure.sync_routable(msg.sender)
        if msg.reply:
            member = failure.members.get(msg.sender)
            # A joining (or restarted) node knows nobody: it gets our whole member list.
            joining = msg.ack is None and not msg.peers
            if member is not None:
                actions.append(
                    self.dissemination.send(est, member, now, load, reply=False, full=joining)
                )
        return actions

    def _known_address(self, msg: Gossip) -> str | None:
        """The address of a sender that left its identity out (protocol 3: it did once we
        acknowledged it): the one we hold, if we heard this incarnation first-hand (its
        fingerprint was checked then) or a later one (the message is stale: refused as
        such); None otherwise."""
        if msg.address is not None:  # an address without its fingerprint: not a sender's
            return None
        member = self.failure.members.get(msg.sender)
        est = self.estimates.get(msg.sender)
        if member is None or est is None or est.hearsay:
            return None
        return member.address if msg.incarnation <= member.incarnation else None

    def _refuse(self, msg: Gossip, now: float, load: Load) -> list[Action]:
        """Another model's node: say why once, and tell it who we are (it refuses us too)."""
        log = self.failure.refuse(msg)
        if log is None:
            return []
        assert msg.address is not None  # (a fingerprint comes with its address)
        return [log, self.dissemination.hello(msg.address, now, load, reply=False)]

    def round(self, now: float, load: Load) -> list[Action]:
        """One round: our heartbeat, then a message to each target (and seeds while needed)."""
        self.failure.begin_round()
        return self.dissemination.round(now, load)

    def expire(self, now: float) -> list[Action]:
        """Silence timeouts: suspect, then dead (estimate dropped)."""
        return self.failure.expire(now)

    def forward_failed(self, peer_id: str, now: float) -> list[Action]:
        return self.failure.forward_failed(peer_id, now)

    def refused_forward(self, peer_id: str, retry_after_s: float, now: float) -> None:
        """The peer answered a forward with "busy": back off as if it had pushed back."""
        self.dissemination.refused_forward(peer_id, retry_after_s, now)
