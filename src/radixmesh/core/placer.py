"""The placement of one request's prefix as this node decides it: key, owner set, rent.

Theory of operation
-------------------
:mod:`radixmesh.core.placement` has the pure pieces (the ring, the key's depth, the replica
count, decayed per-key sums); this part owns their state at one node and puts them together
for each request the cost policy ranks (:meth:`Placer.place`):

1. the *key*: the block at the placement depth, past the blocks every member holds
   (``shared_blocks``: a header common to all prompts must not name the prefix);
2. the key's *load*: its request rate here (``KeyRates.confident_rate``) × the members ×
   a warm request's service, and so its replica count ``k`` (``replicas_for``);
3. the *owner set*: the first ``k`` available members clockwise on the ring, passing over
   those busier than ``placement_load_bound`` allows (``owners``), cut at the first owner
   where a request now finds no queue (``owners_needed``);
4. the *rent*: what forwarding this prefix to a holder cost this node lately (round trips,
   waits beyond its own: ``KeySums``), which the router compares with a copy's price.

Owners the candidates lack are added to them (a random few of a very hot prefix's owners:
entry nodes differ, so load spreads).
"""

from __future__ import annotations

from collections.abc import Sequence
from random import Random  # the type only: instances are passed in, never the global one

from radixmesh.core.config import NodeConfig
from radixmesh.core.cost_model import (
    Candidate,
    NodeInfo,
    Placement,
    RouteInput,
)
from radixmesh.core.gossip import Gossiper
from radixmesh.core.load_bound import mean_utilization, over_bound
from radixmesh.core.peer_loads import PeerLoads
from radixmesh.core.peerview import PeerView
from radixmesh.core.placement import KeyRates, KeySums, Ring, placement_depth, replicas_for

ROUTE_TOP_K = 8  # deepest-matching available peers considered per request
SHARED_CHECK_MAX = 32  # members: up to this many, a request's prefix common to all is found


class Placer:
    """One node's ring, per-prefix request rates and rents (see the module docstring)."""

    def __init__(self, config: NodeConfig, gossip: Gossiper, view: PeerView,
                 peers: PeerLoads, rng: Random, now: float) -> None:
        self._config = config
        self._gossip = gossip
        self._view = view
        self._peers = peers
        self._rng = rng
        self._ring = Ring()  # prefixes' owners (consistent hashing over routable members)
        self._ring_checked = now  # when the ring's members are checked again at the latest
        self._key_rates = KeyRates(config.router.replica_window_s)  # requests/s per prefix here
        self._key_rent = KeySums(config.router.rent_window_s)  # rent paid per prefix

    def place(
        self,
        hashes: Sequence[int],
        req: RouteInput,
        nodes: list[NodeInfo],
        now: float,
        observe: bool = False,
    ) -> tuple[Placement, int] | None:
        """The request's prefix's owner set on the ring (owners missing from ``nodes`` are
        appended): as many owners as its load here says it needs (``core/placement.py``);
        with the placement key that names the prefix."""
        cfg = self._config.router
        if cfg.placement_depth_blocks is None or not hashes:
            return None
        block = self._config.fingerprint.block_size
        depth = placement_depth(len(hashes), cfg.placement_depth_blocks,
                                self._shared_blocks(hashes, nodes[0].cached_tokens // block))
        key = hashes[depth - 1]
        if observe:
            self._key_rates.add(key, now)  # one request
        held = depth * block
        self._update_ring(now)
        rate = self._key_rates.confident_rate(key, now)
        k = self._replicas(rate, held, req, nodes)
        owners = self._owners(key, k, nodes, now)
        if len(owners) > 1:
            owners = self._owners_needed(owners, nodes, now)
        self._add_missing(owners, hashes, req, nodes, now)
        return Placement(tuple(owners), held, self._key_rent.total(key, now), rate), key

    def _replicas(self, rate: float, held: int, req: RouteInput, nodes: list[NodeInfo]) -> int:
        """How many owners the key's load here says it needs: its (confident) ``rate`` here
        × the members × a warm request's service here: what one replica spends on each of the
        key's requests, with what its best holder holds of this one cached (not just the key's
        blocks: an MMLU prompt past its subject's key is a cold prefill's worth, and priced so
        every subject looked 5x as hot as it was)."""
        cfg = self._config.router
        members = len(self._ring)
        reused = min(max(held, *(n.cached_tokens for n in nodes)), req.prompt_tokens - 1)
        warm = nodes[0].speed.service_s(
            max(req.prompt_tokens - reused, 1), reused, req.max_tokens, cfg.context_scale,
        )
        load = rate * members * warm
        return replicas_for(load, cfg.replica_load, members, cfg.max_replicas)

    def _add_missing(self, owners: list[str], hashes: Sequence[int], req: RouteInput,
                     nodes: list[NodeInfo], now: float) -> None:
        """Append the owners ``nodes`` lacks to it (a random few of a very hot prefix's)."""
        block = self._config.fingerprint.block_size
        present = {n.node_id for n in nodes}
        missing = [o for o in owners if o not in present]
        if len(missing) > ROUTE_TOP_K:  # a very hot prefix: a random few of its owners (entry
            missing = self._rng.sample(missing, ROUTE_TOP_K)  # nodes differ: load spreads)
        for owner in missing:
            if owner not in present:
                cached = min(self._view.depth_of(owner, hashes) * block, req.prompt_tokens)
                info = self._peers.info(owner, cached, now)
                if info is not None:
                    nodes.append(info)

    def _owners_needed(self, owners: list[str], nodes: list[NodeInfo], now: float) -> list[str]:
        """A hot prefix's owners past the first are for requests that would wait: the set
        ends at the first owner where a request arriving now is expected to find an empty
        queue (own queue exact, a peer's expected one). The owner sets stay nested, so two
        entry nodes that disagree still agree on the owners they share. A prefix's load
        counts its requests, not whether they overlap: one client sending a hot prefix
        back to back keeps one node ~90 % busy with nothing ever queued, and its load asked
        for 2-3 owners; each replica was a cold prefill that no request waited less for
        (the real cluster's one-client hot-prefix run: 2 of 100 requests, two of its four
        slowest)."""
        known = {n.node_id: n for n in nodes}
        for i, owner in enumerate(owners[:-1]):
            info = known.get(owner) or self._peers.info(owner, 0, now)
            if info is None or info.queue_depth < 1.0:
                return owners[: i + 1]
        return owners

    def _owners(self, key: int, k: int, nodes: list[NodeInfo], now: float) -> list[str]:
        """The key's first ``k`` owners clockwise among the available members, passing over
        those busier than ``placement_load_bound`` allows (self included; the mean
        utilization is that of ``nodes``, the candidates): consistent hashing with bounded
        load, without the forward bound's slack. A busy member keeps what it holds; new
        prefixes go past it, to the same member from every entry node whose view of the load
        agrees. The ring's arcs and the prefixes' popularity are uneven (on the real cluster
        one node of four owned 30 % of the ring and served 40 % of MMLU's requests, every
        subject where it was first put)."""
        me = self._config.node_id

        def alive(m: str) -> bool:
            return m == me or self._peers.available(m, now)

        bound = self._config.router.placement_load_bound
        mean = mean_utilization([n for n in nodes if n.available])
        if bound is None or mean <= 0.0:  # nobody can be over the bound: the plain walk
            return self._ring.owners(key, k, alive)
        known = {n.node_id: n for n in nodes}

        def room(m: str) -> bool:
            if not alive(m):
                return False
            info = known.get(m) or self._peers.info(m, 0, now)
            return info is None or not over_bound(info, mean, bound)  # no slack (request_slack)

        return self._ring.owners(key, k, room) or self._ring.owners(key, k, alive)

    def _shared_blocks(self, hashes: Sequence[int], mine: int) -> int:
        """Blocks of this request's prefix that every member holds (self exactly, peers in
        the view): a header common to all prompts, such as a chat preamble or an agent's
        system prompt, which must not name the prefix. 0 in meshes too large to check every
        member per request (the fixed depth alone names the prefix there)."""
        routable = self._gossip.routable
        if not routable or len(routable) >= SHARED_CHECK_MAX:
            return 0
        shared = mine
        for member in routable:
            if shared == 0:
                break
            shared = min(shared, self._view.depth_of(member, hashes))
        return shared

    def _update_ring(self, now: float) -> None:
        """The ring over the routable members and self: O(members) to check, so checked when
        their count changes and otherwise once per gossip round (membership changes slower)."""
        routable = self._gossip.routable
        if len(routable) + 1 != len(self._ring) or now >= self._ring_checked:
            self._ring.update((*routable, self._config.node_id))
            self._ring_checked = now + self._config.gossip.interval_s

    # ---------------------------------------------------------------------------- rent
    def rent_paid(self, key: int, now: float, seconds: float) -> None:
        """Renting the key's copy elsewhere cost this node ``seconds`` (a round trip)."""
        self._key_rent.add(key, now, seconds)

    def rent_waited(
        self, key: int, waited: float, candidates: list[Candidate], now: float
    ) -> None:
        """A rental's queue wait at the holder, beyond the wait this node predicted for
        itself when it chose, is rent paid for the prefix's copy there (besides the round
        trip, counted when it chose): a holder that every entry node rents from becomes the
        busiest node, and its renters buy their own copies (ski rental, ``Placement.rent_s``)
        once the waits they met reach the copy's price. With the round trips alone a hot
        prefix stayed on one node of four: on the real cluster at Poisson 50 % that node
        served 58-65 % of the requests, and its queue made the hot prefix's mean 1.18-1.30x
        `none`'s (each entry node's own copy would have cost one cold prefill)."""
        own = next((c.wait_s for c in candidates if c.is_self), 0.0)
        # signed, so noise in either direction cancels; the rent never goes below 0: a burst
        # in which this node was the busier one must not block a copy for the rent's window
        paid = self._key_rent.total(key, now)
        self._key_rent.add(key, now, max(waited - own, -paid))
