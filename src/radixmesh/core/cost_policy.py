"""The ``cost`` routing policy: rank by what each choice costs the mesh, keep prefixes placed.

Theory of operation
-------------------
Argmin predicted latency = rtt + queue wait + prefill(uncached) + decode,
plus, under load, what the choice costs the requests queued behind it
and those that will arrive while it runs (:func:`mesh_cost`: the
candidate's service once more for each request queued there, and half
of it for each one expected to arrive during it, at the rate the
candidate serves requests). A peer must
beat self by ``min_gain_s`` and ``min_gain_frac`` of the local work
(hysteresis against noisy speed estimates). Equal
predictions keep self first, and ties among peers are broken by load,
then at random — never "the first peer".
*Bounded load*: a peer whose gossiped utilization exceeds
``(1 + load_bound)`` × the mean utilization of the available nodes
(default 1.5×) takes no forwards (it stays in the fallback order).
Affinity alone makes the first node to cache a popular prefix a
hotspot even when queues are empty (one client, the paper's schedule);
with the bound, the overflow is served where it enters, that node caches
the prefix too, and hot prefixes end up replicated on as many nodes as
their traffic needs. The bound yields to a peer with room: one over
it that has room (utilization < 0.5, or no queue expected when the
request arrives) and is predicted to answer fastest still gets the
request — where nothing queues, balancing buys no time and must not
throw away hits (``load_bound_bypass`` can ask for a larger saving).
*Placement and replicas* (``core/placement.py``): each request's prefix
has an *owner set* on a consistent-hashing ring of the routable members
— one owner for a cold or lukewarm prefix, as many as its measured load
needs for a hot one. The preferred candidates are the owners and the
nodes that hold the prefix; the best of them (near-equal ones picked at
random, self first: two entry nodes with the same stale view do not
pick the same peer) wins when it is predicted at most
``placement_slack`` (75 %) slower than the best choice now (an
owner making the first copy: ``first_copy_slack``, 10 % of that copy's work), if
that choice would copy the prefix or holds less of the request (by
more than the hysteresis is worth). A member busier than
``(1 + placement_load_bound)`` × the mean utilization (1.15×, tighter
than ``load_bound``) is passed over on the ring, self included:
it keeps the prefixes it holds, and new ones go to the next member
clockwise (consistent hashing with bounded load; the ring's arcs and
the prefixes' popularity are uneven: on the real cluster one node of
four owned 30 % of the ring and served 40 % of MMLU's requests). A peer is
preferred only if a later request entering elsewhere would gain at
least a round trip by using its copy (else nobody would be forwarded
to it: over a slow link every node keeping its own copy wins). So every
entry node sends a new prefix to the same node (no second cold copy),
new prefixes spread over all nodes, and a hot prefix's overflow goes to
the next owner on the ring — a deliberate replica — instead of a cold
copy wherever it entered. Where fewer nodes hold a prefix than its load
asks owners for, and the best choice is a holder, the cheapest owner
without a copy makes a replica when the TTFT a warm replica would save
the prefix's requests to come here (against that holder now: its queue,
mostly) pays for the cold prefill (``_replica``). Each candidate is
tagged (``placement``: hit, first copy, deliberate replica, second copy,
unplaced, local copy) so the node can count what its decisions cost.
*Ski rental*: a forward to a holder rents its copy for one round trip,
plus the queue wait it met there beyond the one this node predicted for
itself (signed: a holder no busier than this node costs nothing on
average; the rent never goes below 0); a copy here costs, once, what
staying costs more than forwarding now (never less than the extra
service it makes here, less that round trip; a forward the slack chose,
slower than staying, is no rental). The node sums that rent per prefix
(``rent_s``) and keeps the request here (tag ``local_copy``) once it
reaches the price: after ~75 forwards of a prefix to an idle holder over
a 4 ms link, at the first or second over a 400 ms one, after a few to a
holder where each waits 0.1 s. A node fronting a batching engine prices the copy by its
TTFT and what its prefill delays its batch. *Rentals to come* count too (ski rental with a
known rate): the prefix's confident rate here × ``replica_window_s`` × the round trip, where
a copy would avoid them (warm, this node beats the forward's TTFT). A shared prompt every
entry keeps seeing (agentic's tool prompt) is then copied after a few requests instead of
forwarded to its few holders again and again (issue #52).
*Its own queue, by its tokens*: the deciding node knows what its queued
requests will compute (their uncached tokens, ``LoadChanged``), so each
place in its own queue is priced at that (``NodeInfo.queue_service_s``),
here and in the refusal check; at depth × mean service a queue of cold
prefills behind mostly warm traffic looked half as long as it was. A
peer's queue stays at its mean service: gossiping the price was tried,
and a report prices a queue that is gone when the forward lands.
*Stale queues*: per peer, the node learns how far its predictions of the
peer's queue wait were off, from the waits its forwards met there
(``wait_error_s``); a forward must save more than that too.
*Robust speeds*: learnt speeds within ``speed_tolerance`` (1.5×) of the
candidates' median (a prefill line judged by its times at a warm step's
and a cold prompt's size) count as the median, so that estimation noise on a
shared machine cannot send cold requests to whichever node looks fastest
(positive feedback: that node caches the new prefix, the others never do).
A speed far off the median for lack of recent requests is not noise
the tolerance can absorb: the node restarts it (``OwnLoad.refresh_stale_speed``).

*Far peers, for load alone*: a peer whose round trip alone is longer
than the request's TTFT here, holding no more of it than this node, is
never ranked first: slower for the request whatever its queue (issue
#52: a request crosses regions only when that is predicted faster), the
mesh cost may not send it there for the others' sake, on the stalest
load view this node has (``_far_and_slower``).

Why one file over 400 lines (~530): the rules above are one ranking that
shares its intermediate values (each candidate's parts, the preferred and
barred sets, the placement's pick, the replica's limit); split, each part
would take and return all of them.

Because a peer's prediction includes its forward RTT, ``cost`` forwards only when the predicted
saving exceeds the forward cost: on a slow network it degenerates to ``none``. Its peer
candidates carry ``beat_s``: the peer checks it against its exact queue and cache and refuses
the forward when it cannot beat it, so a view of the peer's queue that is a gossip round old
costs one round trip, not a long wait in a queue that many nodes chose at once. Such a
refusal says the peer's queue wait, which the sender takes as a fresh report of that queue;
it does not back off from the peer (it is not busy as such, and a holder that refused a
cold request must stay a candidate for the hits it holds). ``beat_s`` is
what staying costs (the local prediction, plus the local miss's extra work × the local queue
under load; × ``1 + placement_slack`` for a preferred holder, + ``first_copy_slack`` × the
copy's work for an owner making the first copy), *not* minus the RTT: when
the forward arrives, its way out is spent, and the way back is paid whether the peer answers
the request or refuses it — so the peer should take it whenever its wait + service beats what
the sender would do instead. (Subtracting the RTT refused forwards
that still paid: at 16–1,024 simulated nodes 0.4–0.5 refusals per request.)
"""

from __future__ import annotations

from collections.abc import Sequence
from random import Random  # the type only: instances are passed in, never the global one

from radixmesh.core.cost_model import (
    Candidate,
    NodeInfo,
    Placement,
    Priced,
    RouteInput,
    Tag,
    batch_externality,
    candidate,
    mesh_decoding,
    predict_prefill,
    predict_service,
    predict_ttft,
    predict_wait,
    priced,
    with_cached,
)
from radixmesh.core.load_bound import mean_utilization, over_bound, request_slack
from radixmesh.core.router_config import RouterConfig

# a candidate as the cost policy sorts them: (mesh cost, queue depth, tie-break, node)
_Keyed = tuple[float, float, float, NodeInfo]
NEAR_HEAD = 4  # fallbacks put ahead of far peers (CostPolicy._near_first); >= max_peer_attempts


class CostPolicy:
    """The cost policy's ranking (stateless: its configuration only)."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config

    def rank(
        self,
        req: RouteInput,
        nodes: Sequence[NodeInfo],
        avail: list[NodeInfo],
        rng: Random,
        placement: Placement | None,
    ) -> list[Candidate]:
        """The cost policy: each candidate's mesh cost and whether it is preferred for the
        prefix are computed once, for the choice and for the ``beat_s`` each forward carries."""
        me = next(n for n in avail if n.is_self)
        scale = self.config.context_scale
        decoding = mesh_decoding(avail)  # one decode batch for every candidate's compute
        parts = {n.node_id: priced(req, n, scale, decoding) for n in avail}
        local = parts[me.node_id].cost_s
        preferred = set() if placement is None else {
            n.node_id for n in avail if self._preferred(req, n, me, placement)
        }
        order, bought, most = self._by_cost(req, avail, parts, rng, placement, preferred, decoding)
        if placement is None:
            return [candidate(req, n, scale, None if n.is_self else local,
                              cost_s=parts[n.node_id].cost_s, parts=parts[n.node_id])
                    for n in order]  # fmt: skip
        owners = set(placement.owners)
        held = placement.held_tokens
        anyone = any(n.cached_tokens >= held for n in nodes)
        out = []
        for n in order:
            if n.is_self:
                beat = None
            elif n.node_id not in preferred:
                beat = local
            else:
                beat = self._preferred_limit(req, local, me, n.cached_tokens >= held)
                if most is not None and n is order[0]:  # a replica: held to its limit
                    beat = max(beat, most)
            tag = Tag.LOCAL_COPY if n.is_self and bought else _tag(n, owners, held, anyone)
            p = parts[n.node_id]
            out.append(candidate(req, n, scale, beat, tag, p.cost_s, p))
        return out

    def _by_cost(
        self,
        req: RouteInput,
        avail: list[NodeInfo],
        parts: dict[str, Priced],
        rng: Random,
        placement: Placement | None,
        preferred: set[str],
        decoding: float | None,  # the decision's decode batch (``mesh_decoding``)
    ) -> tuple[list[NodeInfo], bool, float | None]:
        """The candidates, best first (``parts``: their predictions, ranked by mesh cost),
        whether staying here is a bought copy (rent), and the most a replica ranked first may
        cost (``_replica``; None: not one); ``preferred``: the owners and holders worth a round
        trip. A far peer, for load alone and slower (``_far_and_slower``), is never first."""
        me = next(n for n in avail if n.is_self)
        keyed = [(parts[n.node_id].cost_s, n.queue_depth, rng.random(), n) for n in avail]
        keyed.sort(key=lambda k: (k[0], not k[3].is_self, k[1], k[2]))
        order = [k[3] for k in keyed]
        overloaded = self._over_bound(avail)
        mine = next(k for k in keyed if k[3].is_self)
        best = next((k for k in keyed if k[3].node_id not in overloaded), mine)
        if self._far_and_slower(best[3], me, parts):  # rare: the next that is not
            best = next((k for k in keyed if k[3].node_id not in overloaded
                         and not self._far_and_slower(k[3], me, parts)), mine)  # fmt: skip
        if (self._bypasses_bound(keyed[0], best)
                and not self._far_and_slower(keyed[0][3], me, parts)):
            best = keyed[0]  # a large certain saving (a long cached prefix) beats balancing
        # Hysteresis against noisy *speed* estimates: a share of the local work, not of the
        # local queue wait (under load 10 % of the wait exceeded any cache saving); and
        # against stale *queue* views: what predictions of the peer's wait are lately off by.
        if mine[0] - best[0] < self._needed(mine[0] - predict_wait(me)) + best[3].wait_error_s:
            best = mine
        bought, replica = False, None
        if placement is not None:
            pick = self._placed(req, keyed, best, preferred, overloaded, rng, placement.held_tokens)
            best, replica = self._replica(req, keyed, best, pick, preferred, overloaded, placement)
            if self._buys_copy(req, mine, best, placement, decoding):
                best, bought, replica = mine, True, None
        rest = [n for n in order if n is not best[3]]
        return [best[3], *self._near_first(rest, me, parts)], bought, replica

    def _near_first(self, rest: list[NodeInfo], me: NodeInfo, parts: dict[str, Priced]
                    ) -> list[NodeInfo]:
        """The fallbacks after the first choice (a refusal, or this node full, leaving or
        its engine down, tries them in order), with the first ``NEAR_HEAD`` peers that are
        not far and slower (``_far_and_slower``) ahead of those that are: a request this
        node cannot keep goes to a near peer before it crosses a region for load alone.
        Scans only as far as it needs: the route stays cheap at 1,024 peers."""
        head: list[NodeInfo] = []
        far: list[NodeInfo] = []
        i = 0
        while i < len(rest) and len(head) < NEAR_HEAD:
            (far if self._far_and_slower(rest[i], me, parts) else head).append(rest[i])
            i += 1
        return [*head, *far, *rest[i:]] if far else rest

    def _buys_copy(self, req: RouteInput, mine: _Keyed, best: _Keyed, placement: Placement,
                   decoding: float | None) -> bool:
        """Ski rental: a forward to a holder rents its copy for one round trip; a copy here
        costs, once, what staying costs more than the forward now. Rent until the round
        trips spent on this prefix reach that price, then buy. Over a 4 ms link against
        a 0.3 s prefill that takes ~75 forwards of one prefix from this node (a hot one
        is then copied here too); over a 400 ms one, where every node keeping its own
        copy is what wins, the first or second request buys.
        (A forward the placement slack chose, slower now than staying, is not a rental:
        it avoids a second copy while gossip is a round behind.)
        The price is never below the extra service the copy makes this node compute,
        less the round trip it saves now: a holder that is busy for the moment makes
        the forward slow, not the copy cheap (under load, copies bought while holders
        were busy cost 6-9 points of hit rate and no latency in the simulator)."""
        me, there = mine[3], best[3]
        gain = mine[0] - best[0]
        held = placement.held_tokens
        renting = there.cached_tokens >= held > me.cached_tokens  # a hit there, not here
        if not (renting and gain > 0.0):
            return False
        rent = placement.rent_s + self._rent_to_come(req, placement, me, there)
        if me.batch is not None:
            return self._batch_copy_price(req, me, there, decoding) <= rent
        scale = self.config.context_scale
        extra_service = predict_service(req, me, scale) - predict_service(req, there, scale)
        price = max(gain, extra_service - there.rtt_s)
        return price <= rent + there.rtt_s

    def _rent_to_come(
        self, req: RouteInput, placement: Placement, me: NodeInfo, there: NodeInfo
    ) -> float:
        """The round trips this node will spend renting the copy at ``there`` over the next
        ``replica_window_s`` if it buys none: the prefix's confident rate here × that window
        (the span its rate is measured over, no further) × the round trip. Ski rental with a
        known rate buys at once when the rentals to come cost more than the copy: a shared
        prompt every entry keeps seeing is copied on its first confident requests, not
        rented ~75 times (agentic: the tool prompt, forwarded to its few holders). Only if
        a copy would avoid them: warm, this node must beat the forward's TTFT (a slow node
        would still forward; mixed-16, agentic 80 %: A10G copies, p99 89 -> 530 ms)."""
        scale = self.config.context_scale
        warm = with_cached(me, there.cached_tokens)
        if predict_ttft(req, warm, scale) >= predict_ttft(req, there, scale):
            return 0.0
        return placement.rate_hz * self.config.replica_window_s * there.rtt_s

    def _batch_copy_price(self, req: RouteInput, me: NodeInfo, there: NodeInfo,
                          decoding: float | None) -> float:
        """A copy's price on a batching engine: this node's predicted TTFT here beyond the
        forward's (round trip included), at least the copy's extra prefill plus what it
        delays the requests joining the batch (``batch_externality``); bought once the rent
        paid *before* this forward reaches it. (The FIFO rule, this forward's round trip
        counted as paid, bought on a loaded host at a prefix's first forward: 16 emulated
        H100s, RAG 80 %: 17 copies of 400 requests, 13 at rent 0; misses 48 ms vs SMG 32.)"""
        scale = self.config.context_scale
        warm = with_cached(me, there.cached_tokens)
        extra = predict_prefill(req, me, scale) - predict_prefill(req, warm, scale)
        extra += (batch_externality(req, me, scale, decoding)
                  - batch_externality(req, warm, scale, decoding))
        gain = predict_ttft(req, me, scale) - predict_ttft(req, there, scale)
        return max(gain, extra)

    def _placed(
        self,
        req: RouteInput,
        keyed: list[_Keyed],
        best: _Keyed,
        preferred: set[str],
        overloaded: set[str],
        rng: Random,
        held: int,
    ) -> _Keyed:
        """The best preferred candidate (an owner, or a node holding the prefix) if it costs
        at most ``placement_slack`` more than ``best`` now; near-equal ones are picked at
        random, self first (entry nodes sharing a stale view must not all pick one peer).
        The slack avoids a copy: where ``best`` holds the prefix (``held`` tokens) already,
        only a candidate holding more of the request than ``best``, by more than the
        hysteresis is worth, has one to avoid (a conversation whose newer turns a peer holds
        must not stay on the node that holds its first ones: the chat workload re-prefilled
        its history on the stale holder). Candidates over the load bound are not preferred."""
        cfg = self.config
        copies = best[3].cached_tokens < held  # serving at ``best`` copies the prefix
        pref = [
            k for k in keyed
            if k[3].node_id in preferred and k[3].node_id not in overloaded
            and (k is best or copies or self._holds_more(req, k[3], best[3]))
        ]
        if not pref:
            return best
        low = pref[0][0]  # keyed is sorted by prediction
        if low > self._preferred_limit(req, best[0], best[3], pref[0][3].cached_tokens >= held):
            return best  # every preferred node is busy or slow now: the fastest choice wins
        near = [k for k in pref if k[0] <= low + max(cfg.min_gain_s, cfg.near_tie * low)]
        if best in near:
            return best
        pick = next((k for k in near if k[3].is_self), None) or near[rng.randrange(len(near))]
        return self._holder_instead(pick, keyed, preferred, overloaded, held)

    def _replica(self, req: RouteInput, keyed: list[_Keyed], best: _Keyed, pick: _Keyed,
                 preferred: set[str], overloaded: set[str], placement: Placement
                 ) -> tuple[_Keyed, float | None]:
        """The placement's ``pick``, with None; or, where that is ``best`` and holds the prefix
        while fewer of the candidates hold it than its load here says it needs (its owner
        set's size: ``Placer._replicas``; the candidates are those ranked, so a prefix with
        many owners may look held by fewer than hold it), the cheapest preferred owner not
        holding it, with the most it may cost: if its cost now is within ``best``'s by
        ``first_copy_slack`` of the copy's work there and what the replica is worth to later
        requests (``_replica_credit``). The forward carries that limit as its ``beat_s``: the
        peer's exact cost is checked against what the replica was chosen at, not against
        staying here."""
        held = placement.held_tokens
        if pick is not best or best[3].cached_tokens < held or len(placement.owners) < 2:
            return pick, None
        if sum(1 for k in keyed if k[3].cached_tokens >= held) >= len(placement.owners):
            return pick, None
        owner = next((k for k in keyed if k[3].node_id in preferred and k[3].cached_tokens < held
                      and k[3].node_id not in overloaded and k[3].node_id in placement.owners),
                     None)  # fmt: skip
        if owner is None:
            return pick, None
        copy = predict_service(req, owner[3], self.config.context_scale)
        limit = best[0] + self.config.first_copy_slack * copy
        limit += self._replica_credit(req, best[3], owner[3], placement)
        return (owner, limit) if owner[0] <= limit else (pick, None)

    def _replica_credit(self, req: RouteInput, holder: NodeInfo, owner: NodeInfo,
                        placement: Placement) -> float:
        """What a replica at ``owner`` is worth beyond this request: the TTFT the prefix's
        requests from this node would save there, warm, against ``holder`` now (its queue,
        mostly; also a round trip or a speed), for half of those expected over
        ``replica_window_s`` (its confident rate here: ski rental with a known rate, as
        ``_rent_to_come``). Without it no owner made a copy while the prefix had a holder
        (only a node holding more of the request was preferred to it), however long that
        holder's queue (16 emulated H100s, RAG at 80 %: a document drawing 13 % of the
        requests stayed on one node to the end)."""
        scale = self.config.context_scale
        warm = with_cached(owner, holder.cached_tokens)
        saved = predict_ttft(req, holder, scale) - predict_ttft(req, warm, scale)
        return max(0.0, saved) * placement.rate_hz * self.config.replica_window_s / 2.0

    def _preferred_limit(
        self, req: RouteInput, cost: float, alternative: NodeInfo, holder: bool
    ) -> float:
        """The most a preferred candidate may cost when ``alternative`` (the best choice now,
        predicted at ``cost``) is what it is preferred to: a holder, ``placement_slack`` more
        than all of ``cost``; an owner that would make the prefix's first copy (as would
        ``alternative``), ``first_copy_slack`` of the copy's work only (a slack on all of
        ``cost``, mostly queue under load, piled new subjects onto one owner on the real
        cluster; holders keep it: narrower cost MMLU 1.8 points of hits). An owner's is
        small: a holder's copy is certain, an owner's pays only if later requests come, and
        every entry node spends it at once on one stale view of the owner (a herd). At 0.75
        of the copy's work h100-16 (``sim --experiment regimes``) was 0.84x `none`'s mean,
        at 0.1 0.75x (p99 0.77 -> 0.63x); 0.1 of a copy still exceeds a round trip."""
        if holder:
            return cost * (1.0 + self.config.placement_slack)
        copy = predict_service(req, alternative, self.config.context_scale)
        return cost + self.config.first_copy_slack * copy

    @staticmethod
    def _holder_instead(
        pick: _Keyed,
        keyed: list[_Keyed],
        preferred: set[str],
        overloaded: set[str],
        held: int,
    ) -> _Keyed:
        """A peer the placement picked to make a copy gives way to a holder of the prefix
        predicted no slower now (the cheapest, within the load bound): the forward is made
        either way, and the holder needs no copy. (A holder that saves this node less than
        the hysteresis is not preferred for itself, so a chat conversation's second turn went
        to the owner of its key, which re-prefilled the first turn that the node it ran on
        held: 8 of 100 one-client requests, 811 tokens.) The holder carries the placement's
        ``beat_s`` (it joins ``preferred``)."""
        if pick[3].is_self or pick[3].cached_tokens >= held:
            return pick
        for k in keyed:  # sorted by prediction: the first one found is the cheapest
            if k[0] > pick[0]:
                break
            if k[3].cached_tokens >= held and k[3].node_id not in overloaded:
                preferred.add(k[3].node_id)
                return k
        return pick

    def _holds_more(self, req: RouteInput, node: NodeInfo, than: NodeInfo) -> bool:
        """Whether ``node`` holds more of the request than ``than`` by more than the
        hysteresis: what its longer cached prefix would save on ``than``'s speed."""
        if node.cached_tokens <= than.cached_tokens:
            return False
        scale = self.config.context_scale
        there = predict_service(req, than, scale)
        saved = there - predict_service(req, with_cached(than, node.cached_tokens), scale)
        return saved >= self._needed(there)

    def _needed(self, work_s: float) -> float:
        """The least a forward must save over staying, for local work ``work_s``."""
        return max(self.config.min_gain_s, self.config.min_gain_frac * work_s)

    def _preferred(
        self, req: RouteInput, node: NodeInfo, me: NodeInfo, placement: Placement
    ) -> bool:
        """Whether ``node`` is preferred for the request's prefix: an owner or a holder, and,
        for a peer, one whose copy is worth a round trip. A copy there saves a later request
        entering elsewhere (here, say) the prefill of what it holds beyond this node's cache
        (a holder: its cached prefix; an owner: at most this whole prompt). Less the round
        trip and the queue error, that gain must be at least the hysteresis and at least one
        more round trip: else later requests would rent it briefly or not at all (ski
        rental), so concentrating the prefix there buys little.
        (At 1 s one way the slack sent cold 3,000-token prompts across a 2 s round trip; at
        200 ms it sent MMLU requests to holders of a 1,500-token prefix it took 0.3 s to
        prefill; with a long prompt every node holds, agentic steps to their scratchpad's
        holder for a few hundred tokens.)"""
        holds = node.cached_tokens >= placement.held_tokens
        if not holds and node.node_id not in placement.owners:
            return False
        if node.is_self:
            return True
        scale = self.config.context_scale
        copy = node.cached_tokens if holds else req.prompt_tokens
        here = predict_service(req, with_cached(node, me.cached_tokens), scale)
        there = predict_service(req, with_cached(node, copy), scale)
        net = here - there - node.rtt_s - node.wait_error_s  # what a later forward gains
        return net >= max(self._needed(here), node.rtt_s)

    def _far_and_slower(self, n: NodeInfo, me: NodeInfo, parts: dict[str, Priced]) -> bool:
        """Whether ``n`` is a peer whose round trip alone is longer than the request's TTFT
        here and which holds no more of it than this node: a forward there is slower for
        the request whatever the peer's queue, and would be made for load alone. The mesh
        cost may not send it there for the others' sake (issue #52: a request crosses
        regions only when that is predicted faster): the request pays the round trip for
        certain, while what it saves the others rests on the far peer's load, the stalest
        view this node has. (regions-16, agentic, 80 %: such forwards, 2 % of the requests,
        each 80 ms slower, were the p99: the entry's own arrival rate, exact, against far
        peers' reports of their first arrivals priced joining its batch at 3-6x theirs.
        Tried and dropped: a bar on far holders too, and "far" as over 10 % of the TTFT
        here (docs/ideas-tried.md).)"""
        if n.is_self or n.cached_tokens > me.cached_tokens:
            return False
        p = parts[me.node_id]
        return n.rtt_s > p.ahead_s + p.prefill_s

    def _bypasses_bound(
        self, top: _Keyed, best: _Keyed
    ) -> bool:
        """Whether the fastest candidate, over the load bound, gets the request anyway: it has
        room (utilization under ``load_bound_floor``, or less than one request expected in
        its queue when this one arrives) and saves at least ``load_bound_bypass`` of the
        time. Utilization is a 10 s average: a holder that made a few long cold prefills
        lately is over the floor while idle now. (gpu-70b, one client, simulated: the floor
        alone made 8 of 500 requests cold `replica` copies next to an idle holder, with the
        queue as well 2. Asking half the time as the saving kept agents' steps off the
        holder of their scratchpad: 90.1 % of prompt tokens cached, 91.1-91.8 % asking none.)"""
        cfg = self.config
        room = top[3].utilization < cfg.load_bound_floor or top[3].queue_depth < 1.0
        return room and top[0] < (1.0 - cfg.load_bound_bypass) * best[0]

    def _over_bound(self, avail: list[NodeInfo]) -> set[str]:
        """Peers whose utilization exceeds ``(1 + load_bound)`` × the mean (bounded load)."""
        if len(avail) < 2:
            return set()
        mean = mean_utilization(avail)
        bound, window = self.config.load_bound, self.config.load_window_s
        return {
            n.node_id for n in avail
            if not n.is_self and n.batch is None
            and over_bound(n, mean, bound, request_slack(n, window))
        }


def _tag(node: NodeInfo, owners: set[str], held: int, anyone: bool) -> Tag:
    if node.cached_tokens >= held:
        return Tag.HIT
    if node.node_id in owners:
        return Tag.REPLICA if anyone else Tag.FIRST
    return Tag.SECOND_COPY if anyone else Tag.UNPLACED
