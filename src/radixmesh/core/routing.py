"""Ranking one request at this node: gather the candidates, place the prefix, rank, record.

Theory of operation
-------------------
:class:`~radixmesh.core.router.Router` is a pure ranking of :class:`NodeInfo` rows; this part
builds those rows from what the node knows and keeps the decision:

* self, exactly (``OwnLoad.self_info``); then, unless the policy is ``none``, the peers:
  for ``paper`` and ``cost`` the ``k`` deepest matching available peers from the view's
  inverted index (``PeerView.match_top``: O(request blocks + k), never every matched peer),
  for ``cost`` also the peers our forwards in flight are computing the prefix at and the
  two least-loaded unmatched peers, of equivalent holders two at random (``core/choices.py``);
  baselines (random, round_robin, least_loaded) consider every routable peer;
* for ``cost``, the prefix's placement (``Placer.place``);
* no round trip measured yet: the prior's guess of the network is no ground to send a
  request away on, so self comes first;
* a forward to a holder that is a hit there and not here rents the holder's copy: its round
  trip is rent paid for the prefix (``Placer.rent_paid``; ski rental);
* each ranking of a request goes into the node's ``DecisionLog``.

:meth:`Routing.candidates` is the request-level decision of where to try: only here for a
hop-limited request (``local_only``), one whose sampling the forward protocol cannot carry
(``plain`` false) and a prompt's later sample whose first is served here; the node serving
a prompt's first sample first for its other samples (``sample_of``: sample affinity, they
reuse its cached prompt), then here; an experiment's ``target`` first, then here; else the
ranking.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from random import Random  # the type only: instances are passed in, never the global one

from radixmesh.core.adapters import PeerAdapters
from radixmesh.core.choices import two_choices
from radixmesh.core.config import NodeConfig
from radixmesh.core.cost_model import Candidate, NodeInfo, RouteInput, Tag
from radixmesh.core.decisions import DecisionLog
from radixmesh.core.events import RequestArrived
from radixmesh.core.gossip import Gossiper
from radixmesh.core.lifecycle import Lifecycle
from radixmesh.core.load_estimates import RttTable
from radixmesh.core.own_load import OwnLoad
from radixmesh.core.peer_estimate import bump
from radixmesh.core.peer_loads import PeerLoads
from radixmesh.core.peerview import PeerView
from radixmesh.core.placer import ROUTE_TOP_K, Placer
from radixmesh.core.router import Router
from radixmesh.core.router_config import Policy
from radixmesh.core.sessions import SessionTable


class Unavailable:
    """``peer in Unavailable(peers, now)``: whether routing must skip that peer (lazy)."""

    __slots__ = ("_now", "_peers")

    def __init__(self, peers: PeerLoads, now: float) -> None:
        self._peers = peers
        self._now = now

    def __contains__(self, peer: object) -> bool:
        return not (isinstance(peer, str) and self._peers.available(peer, self._now))


class Routing:
    """The candidates of one request at this node, ranked (see the module docstring)."""

    def __init__(self, config: NodeConfig, own: OwnLoad, peers: PeerLoads, placer: Placer,
                 gossip: Gossiper, view: PeerView, lifecycle: Lifecycle, rtt: RttTable,
                 rng: Random, decisions: DecisionLog, metrics: dict[str, float],
                 sessions: SessionTable | None = None,
                 adapters: PeerAdapters | None = None) -> None:
        self._config = config
        self._own, self._peers, self._placer = own, peers, placer
        self._gossip, self._view, self._lifecycle, self._rtt = gossip, view, lifecycle, rtt
        self._rng = rng
        self._decisions = decisions
        self._metrics = metrics
        self._router = Router(config.router)
        self._sessions = sessions
        self._adapters = adapters

    def candidates(self, event: RequestArrived, now: float) -> list[Candidate]:
        """Where to try the request, best first (self listed); with an adapter, only the
        nodes that serve it (a hard constraint, core/adapters.py): not even self if it does
        not (the lifecycle then refuses the request once no holder took it)."""
        key = event.adapter
        if key is None or self._adapters is None:
            return self._candidates(event, now)
        here = any(a.key == key for a in self._config.adapters)
        # a node without the adapter ranks every holder, matched or not
        ranked = self._candidates(event, now, () if here else self._adapters.holders(key))
        serves = self._adapters.serves
        kept = [c for c in ranked if (here if c.is_self else serves(c.node_id, key))]
        # no alternative here: a holder has nothing to beat (it refuses only when full)
        return kept if here else [replace(c, beat_s=None) for c in kept]

    def _candidates(self, event: RequestArrived, now: float, also: Sequence[str] = ()
                    ) -> list[Candidate]:
        me = Candidate(self._config.node_id, True, event.local_cached, 0.0)
        here = self._config.node_id
        # hop-limited, or sampling the forward protocol cannot carry: only here
        if event.local_only or not event.plain or event.sample_of == here:
            return [me]
        # a prompt's other samples go where its first went (its prompt is cached there), as
        # an experiment's target does: that peer first, then here
        first = event.sample_of if event.sample_of is not None else event.target
        if first is not None and first != here:
            return [Candidate(first, False, 0, 0.0), me]
        fresh = self._lifecycle.get(event.rid) is None  # not a re-ranking after a refusal
        ranked = self.route(
            event.hashes, event.prompt_tokens, event.local_cached, event.max_tokens, now,
            observe=fresh, request=event.rid, also=also,
        )
        if event.session is None or self._sessions is None:
            return ranked
        # (tenants) a session goes where it went last unless predicted slower by the margin
        return self._sessions.prefer(ranked, event.session, now,
                                     self._config.router.policy is Policy.COST,
                                     lambda peer: self._peers.available(peer, now))

    def route(
        self,
        hashes: Sequence[int],
        prompt_tokens: int,
        local_cached_tokens: int,
        max_tokens: int,
        now: float,
        observe: bool = False,
        request: int | None = None,
        also: Sequence[str] = (),
    ) -> list[Candidate]:
        """Rank self and the available peers for one request (head = choice); ``observe``:
        count the request in its prefix's rate (its first ranking, not a re-ranking);
        ``request``: its number here, to keep the decision in the decision log; ``also``:
        peers to consider whatever they hold (an adapter's holders)."""
        bump(self._metrics, "routes")
        req = RouteInput(prompt_tokens, max_tokens)
        policy = self._config.router.policy
        nodes = [self._own.self_info(local_cached_tokens, now)]
        placed = None
        if policy is not Policy.NONE:
            nodes.extend(self.peer_infos(hashes, prompt_tokens, policy, now, also))
            if policy is Policy.COST:
                placed = self._placer.place(hashes, req, nodes, now, observe)
        placement, key = placed if placed is not None else (None, None)
        ranked = self._router.rank(req, nodes, self._rng, placement)
        if policy is Policy.COST and not self._rtt.known:
            # no round trip measured yet (no gossip echo): the prior's guess of this network
            # is no ground to send a request away on, so this node comes first; the peers
            # stay behind it for what it cannot serve (full, leaving)
            ranked.sort(key=lambda c: not c.is_self)  # stable: the peers keep their order
        if observe and key is not None:
            self._rent(ranked, nodes, key, now)
        if request is not None:
            self._decisions.record(now, request, not observe, prompt_tokens, max_tokens, nodes,
                                   placement, ranked)
        return ranked

    def _rent(self, ranked: list[Candidate], nodes: list[NodeInfo], key: int, now: float) -> None:
        """Renting a copy: a hit there, not here, predicted faster than staying (a forward
        the placement slack chose, slower than staying, avoids a second copy: no rent). The
        round trip it spends is rent paid now; the wait it meets there is added when done."""
        head = ranked[0]
        mine = next(c for c in ranked if c.is_self)
        if (head.placement is Tag.HIT and mine.placement is not Tag.HIT
                and head.predicted_latency_s < mine.predicted_latency_s):
            rtt = next((n.rtt_s for n in nodes if n.node_id == head.node_id), 0.0)
            self._placer.rent_paid(key, now, rtt)
            ranked[0] = replace(head, rent_key=key)

    def peer_infos(
        self, hashes: Sequence[int], prompt_tokens: int, policy: Policy, now: float,
        also: Sequence[str] = (),
    ) -> list[NodeInfo]:
        """The peers the policy considers for the request, as the router sees them."""
        if policy in (Policy.PAPER, Policy.COST):
            skip = Unavailable(self._peers, now)
            matched = dict(self._view.match_top(hashes, ROUTE_TOP_K, self._rng, skip))
            ids = list(matched)
            if policy is Policy.COST:
                self._in_flight_blocks(hashes, matched, ids, skip)
                ids.extend(p for p in self._peers.least_loaded(now) if p not in matched)
            ids.extend(p for p in also if p not in ids and p not in skip)
        else:  # baselines consider every node anyway
            matched = self._view.match(hashes)
            ids = list(self._gossip.routable)
        block = self._config.fingerprint.block_size
        out = []
        for peer in ids:
            cached = min(matched.get(peer, 0) * block, prompt_tokens)
            info = self._peers.info(peer, cached, now, prompt_tokens)
            if info is not None:
                out.append(info)
        choices = self._config.router.holder_choices
        if policy is Policy.COST and choices is not None:
            out = two_choices(out, self._rng, choices)
        return out

    def _in_flight_blocks(
        self, hashes: Sequence[int], matched: dict[str, int], ids: list[str], skip: Unavailable
    ) -> None:
        """Peers our forwards in flight are computing this request's prefix at: they hold
        it for this request (it queues behind them) though no gossip has said so yet; into
        ``matched`` (blocks) and ``ids`` (candidates). Two requests of a new prefix entering
        here a moment apart went to two nodes, each a cold prefill, whenever the first one's
        node had a queue (the peer's gossip of its queued blocks comes a round later)."""
        lifecycle = self._lifecycle
        for peer in lifecycle.peers_with_blocks():
            blocks = lifecycle.blocks_at(peer, hashes)
            if blocks > matched.get(peer, 0) and peer not in skip:
                if peer not in matched:
                    ids.append(peer)
                matched[peer] = blocks
