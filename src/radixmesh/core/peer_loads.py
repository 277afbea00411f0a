"""What this node expects of each peer's queue: the routing inputs beyond the cache view.

Theory of operation
-------------------
Gossip brings each peer's load report (queue depth, speed, utilization, push-back); this
part turns them into the :class:`~radixmesh.core.router.NodeInfo` the router ranks
(:meth:`PeerLoads.info`):

* **expected queue** (:meth:`PeerLoads.expected_queue`): a report is stale within a few
  service times, since other nodes send work there too; it relaxes towards the mean of all
  peers' reports (time constant ``queue_memory`` × its mean service), plus our own forwards
  sent since that the report cannot have counted (``Lifecycle.forwards_since``). A peer
  that refused our forward as slower said its queue wait: a fresher report
  (:meth:`PeerLoads.queue_reported`);
* **availability** (:meth:`PeerLoads.available`): routable (alive, with a load report) and
  not pushed back;
* **wait errors**: how far our predictions of a peer's queue wait were from the waits our
  forwards met there (``WaitError``): a forward must save more than that;
* **lateness**: how much later than predicted a peer met our forwards (first tokens,
  refusals' waits: ``Lateness``): added to its predicted wait;
* **idle peers** (:meth:`PeerLoads.least_loaded`): the cost policy also considers the two
  least-loaded unmatched peers, found through a lazily cleaned heap of the reports.

A peer's claimed wait is bounded (``MAX_REPORTED_WAIT_S``): a larger one is counted
(``forward_waits_rejected``) and ignored.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import TypeVar

from radixmesh.core.config import NodeConfig
from radixmesh.core.cost_model import NodeInfo
from radixmesh.core.estimators import SpeedReport
from radixmesh.core.gossip import Gossiper
from radixmesh.core.lifecycle import Lifecycle
from radixmesh.core.load_estimates import Lateness, RttTable, WaitError
from radixmesh.core.peer_estimate import PeerEstimate, bump
from radixmesh.core.shadow_state import BatchState, aged

_Kept = TypeVar("_Kept")
IDLE_PEERS = 2  # unmatched least-loaded peers the cost policy also considers
# a peer reporting a longer queue wait (a forward's, or its refusal's) is not believed
MAX_REPORTED_WAIT_S = 3600.0
# a queue depth a report may add to the mesh's mean (larger: counted as this); so one absurd
# report cannot swallow the others' depths in the running sum's rounding
MAX_QUEUE_DEPTH = float(1 << 20)


@dataclass(frozen=True, slots=True)
class QueueSeen:
    """A peer's latest queue report as this node took it in."""

    stamp: float | None  # the load report's stamp (None: no stamp)
    sent: int  # our forwards sent so far when it arrived (``Lifecycle.forwards_sent``)
    at: float  # our clock then
    depth: float  # its queue depth, or the depth its latest refusal's queue wait implies


@dataclass(frozen=True, slots=True)
class BatchSeen:
    """A peer's latest batch report (``Load.batch``) as this node took it in."""

    batch: BatchState
    at: float  # our clock when it arrived
    sent: int  # our forwards sent so far then
    incarnation: int  # the peer's incarnation that sent it


class PeerLoads:
    """The peers' queues, availability and wait errors as this node expects them."""

    def __init__(self, config: NodeConfig, gossip: Gossiper, rtt: RttTable,
                 lifecycle: Lifecycle, prior_speed: SpeedReport,
                 metrics: dict[str, float]) -> None:
        self._config = config
        self._gossip = gossip
        self._rtt = rtt
        self._lifecycle = lifecycle
        self._prior_speed = prior_speed
        self._metrics = metrics
        # peer -> its latest load report (``QueueSeen``); and the sum of those reports' queue
        # depths (the mesh's mean)
        self._load_seen: dict[str, QueueSeen] = {}
        self._queue_sum = 0.0
        self._queue_updates = 0  # since the sum was last recomputed (``_resum``)
        self._idle: list[tuple[int, float, str]] = []  # (queue depth, stamp, peer) lazy heap
        # per peer: how far the queue waits our forwards met were from what we predicted
        self._wait_errors: dict[str, WaitError] = {}
        # per peer: how much later than predicted it met our forwards
        self._lateness: dict[str, Lateness] = {}
        self._batches: dict[str, BatchSeen] = {}  # peer -> its latest batch report

    # ------------------------------------------------------------------------ reports
    def note_load(self, peer: str, now: float) -> None:
        """A message from or about ``peer`` was applied: take in its load report if new."""
        est = self._gossip.estimates.get(peer)
        if est is not None and est.load is not None:
            self._batch_seen(peer, est, now)
            seen = self._load_seen.get(peer)
            if seen is None or seen.stamp != est.stamp:  # a new load report: its queue is fresh
                self._queue_seen(peer, est.stamp, est.load.queue_depth, now)
        if est is not None and est.load is not None and peer in self._gossip.routable:
            heapq.heappush(self._idle, (est.load.queue_depth, est.stamp or 0.0, peer))
            self._trim_idle()

    def _batch_seen(self, peer: str, est: PeerEstimate, now: float) -> None:
        """Keep ``peer``'s latest batch report: a load without one (sent unchanged, see
        ``OwnLoad.advertised``) leaves the last one in force, aged from its own arrival; a new
        incarnation's reports start afresh."""
        assert est.load is not None
        batch, kept = est.load.batch, self._batches.get(peer)
        if batch is not None:
            if kept is None or kept.batch is not batch:
                self._batches[peer] = BatchSeen(batch, now, self._lifecycle.forwards_sent,
                                                est.incarnation)
        elif kept is not None and kept.incarnation != est.incarnation:
            del self._batches[peer]

    def queue_reported(self, peer: str, queue_s: float, now: float) -> None:
        """``peer`` refused our forward as slower and said its queue wait: a report of its
        queue fresher than its last gossip (its places priced at its mean service), which the
        next decisions age like any report (``expected_queue``). The peer stays a candidate:
        a holder that refused one request (a cold one, say) still gets the hits it holds
        when they pay with the queue it really has. (Backing off from it for that wait, as
        from a pushed-back peer, made the holder unavailable to this node and its prefixes
        look held by nobody: on 4 simulated nodes with 16 clients, `first` copies of
        subjects queued at their owner were made on the next member of the ring.)"""
        if not self.believable_wait(queue_s):
            return
        est = self._gossip.estimates.get(peer)
        seen = self._load_seen.get(peer)
        if est is None or est.load is None or seen is None:
            return
        speed = est.speed or self._prior_speed
        self._queue_seen(peer, seen.stamp, queue_s / max(speed.mean_service_s, 1e-6), now)

    def believable_wait(self, wait_s: float) -> bool:
        """Whether a queue wait a peer claimed is in range (else counted and ignored)."""
        if 0.0 <= wait_s <= MAX_REPORTED_WAIT_S:  # a peer's claim: bounded
            return True
        bump(self._metrics, "forward_waits_rejected")
        return False

    def _queue_seen(self, peer: str, stamp: float | None, depth: float, now: float) -> None:
        """Record ``peer``'s queue ``depth`` as seen now (its load report's ``stamp``), and
        keep the sum of the latest depths (the mesh's mean queue) in step."""
        depth = min(max(depth, 0.0), MAX_QUEUE_DEPTH)
        seen = self._load_seen.get(peer)
        self._queue_sum += depth - (0.0 if seen is None else seen.depth)
        self._load_seen[peer] = QueueSeen(stamp, self._lifecycle.forwards_sent, now, depth)
        self._queue_updates += 1
        if self._queue_updates > 2 * len(self._load_seen) + 16:
            self._resum()

    def _resum(self) -> None:
        """Recompute the sum of the reports exactly, over the routable peers only: a dead or
        forgotten peer's last report leaves the mean (else it stayed in it for good), and
        the running sum's rounding never accumulates. Amortized O(1) per report."""
        routable = self._gossip.routable
        self._load_seen = {p: s for p, s in self._load_seen.items() if p in routable}
        self._queue_sum = math.fsum(s.depth for s in self._load_seen.values())
        self._queue_updates = 0

    def reported(self) -> bool:
        """Whether any peer has reported its queue yet."""
        return bool(self._load_seen)

    def mean_queue(self) -> float:
        """The mean of the queue depths the peers last reported (0: no report yet)."""
        return self._queue_sum / max(len(self._load_seen), 1)

    # ----------------------------------------------------------------------- routing
    def info(self, peer: str, cached_tokens: int, now: float,
             prompt_tokens: int = 0) -> NodeInfo | None:
        """``peer`` as the router sees it (None: not available, or no load report);
        ``prompt_tokens``: the request's (what each of our forwards since its report is
        taken to add to a batching engine's work ahead)."""
        est = self._gossip.estimates.get(peer)
        if est is None or not self._available(peer, est, now) or est.load is None:
            return None
        load = est.load
        speed = est.speed or self._prior_speed
        batch = self._batch(peer, max(prompt_tokens - cached_tokens, 1), now)
        late = self._lateness.get(peer)
        lateness, median = (0.0, 0.0) if late is None else late.both(now)
        queue = self.expected_queue(peer, load.queue_depth, speed.mean_service_s, now)
        return NodeInfo(
            peer,
            False,
            cached_tokens,
            self._rtt.get(peer),
            queue,
            speed,
            batch=batch,
            utilization=load.utilization,
            wait_error_s=self.spread_of(peer, now),
            lateness_s=lateness,
            lateness_median_s=median,
            kv_usage=load.cache_tokens / load.cache_budget if load.cache_budget > 0 else 0.0,
        )

    def expected_queue(self, peer: str, reported: int, service_s: float, now: float) -> float:
        """The queue a request sent to ``peer`` now should expect: its report, which others'
        concurrent choices make stale within a few service times (it relaxes towards the
        mean of all peers' reports, with time constant ``queue_memory`` × its mean service),
        plus our own forwards to it that the report cannot have counted. The latest report
        is its gossip's or the queue wait it gave when it last refused us, whichever is newer
        (``queue_reported``). (Taking off the forwards the report counted that have ended
        since was tried: exact, yet the estimate got worse, since the same report's age
        also hides others' forwards; refused forwards per request at 16 simulated nodes,
        one client each, 0.114 / 0.106 -> 0.129 / 0.126.)"""
        seen = self._load_seen.get(peer)
        if seen is None:
            return float(reported)
        ours = self._lifecycle.forwards_since(peer, seen.sent)
        mean = self.mean_queue()
        memory = self._config.router.queue_memory * max(service_s, 1e-6)
        kept = math.exp(-max(now - seen.at, 0.0) / memory)
        return mean + (seen.depth - mean) * kept + ours

    def _batch(self, peer: str, tokens: int, now: float) -> BatchState | None:
        """``peer``'s latest batch report aged since it arrived, with our forwards sent since
        its latest load report (each taken to add ``tokens`` prompt tokens ahead:
        ``shadow_state.aged``): a report that left the batch out says the batch, aged, is
        still right, our forwards before it included (it is sent again when they change it
        for longer than a round: ``OwnLoad.advertised``)."""
        kept = self._batches.get(peer)
        if kept is None:
            return None
        seen = self._load_seen.get(peer)
        ours = self._lifecycle.forwards_since(peer, kept.sent if seen is None
                                              else max(kept.sent, seen.sent))
        return aged(kept.batch, now - kept.at, tokens * ours, ours)

    def available(self, peer: str, now: float) -> bool:
        """Whether ``peer`` may be routed to now (alive, reporting load, not pushed back)."""
        est = self._gossip.estimates.get(peer)
        return est is not None and self._available(peer, est, now)

    def _available(self, peer: str, est: PeerEstimate, now: float) -> bool:
        if peer not in self._gossip.routable:
            return False
        return est.pushback_until is None or est.pushback_until <= now

    def least_loaded(self, now: float) -> list[str]:
        """Up to IDLE_PEERS available peers with the lowest gossiped queue depth."""
        found: list[str] = []
        keep: list[tuple[int, float, str]] = []
        while self._idle and len(found) < IDLE_PEERS:
            entry = heapq.heappop(self._idle)
            depth, stamp, peer = entry
            est = self._gossip.estimates.get(peer)
            if (
                est is None
                or est.load is None
                or est.stamp != stamp
                or depth != est.load.queue_depth
            ):
                continue  # superseded by a newer report: drop for good
            if peer not in self._gossip.routable:
                continue  # re-pushed when it reports again
            keep.append(entry)
            if self._available(peer, est, now) and peer not in found:
                found.append(peer)
        for entry in keep:
            heapq.heappush(self._idle, entry)
        return found

    def _trim_idle(self) -> None:
        if len(self._idle) > 4 * max(16, len(self._gossip.estimates)):
            fresh = []
            for depth, stamp, peer in self._idle:
                est = self._gossip.estimates.get(peer)
                if est is not None and est.load is not None and est.stamp == stamp:
                    fresh.append((depth, stamp, peer))
            heapq.heapify(fresh)
            self._idle = fresh

    # --------------------------------------------------------------------- wait errors
    def spread_of(self, peer: str, now: float) -> float:
        """How far our predictions of ``peer``'s queue wait have lately been off."""
        err = self._wait_errors.get(peer)
        return 0.0 if err is None else err.spread(now)

    def wait_met(self, peer: str, residual_s: float, now: float) -> None:
        """A forward to ``peer`` met a queue wait ``residual_s`` longer than predicted."""
        self._wait_error(peer).observe(residual_s, now)

    def reports_batch(self, peer: str) -> bool:
        """Whether ``peer``'s view is a batch report (a batching engine), not a queue."""
        return peer in self._batches

    def lateness_of(self, peer: str, now: float) -> float:
        """How much later than predicted ``peer`` lately met our forwards."""
        late = self._lateness.get(peer)
        return 0.0 if late is None else late.value(now)

    def lateness_median_of(self, peer: str, now: float) -> float:
        """The median of the same residuals: what the TTFT forecast adds."""
        late = self._lateness.get(peer)
        return 0.0 if late is None else late.median(now)

    def late_by(self, peer: str, residual_s: float, now: float) -> None:
        """A forward to ``peer`` met it ``residual_s`` later than the ranking predicted (its
        first token, or the wait its refusal said). The prediction had the correction in
        force added (``predict_wait``), so that is added back: what is learnt is the raw
        error, not what is left of it (which would settle at half the error)."""
        late = self._lateness.get(peer)
        if late is None:
            cfg = self._config
            self._lateness = self._trimmed(self._lateness)
            late = self._lateness[peer] = Lateness(cfg.priors.alpha, cfg.router.error_window_s)
        late.observe(residual_s + late.value(now), now)

    def _wait_error(self, peer: str) -> WaitError:
        """``peer``'s queue-wait prediction error, created on first use."""
        err = self._wait_errors.get(peer)
        if err is None:
            cfg = self._config
            self._wait_errors = self._trimmed(self._wait_errors)
            err = self._wait_errors[peer] = WaitError(cfg.priors.alpha, cfg.router.error_window_s)
        return err

    def _trimmed(self, table: dict[str, _Kept]) -> dict[str, _Kept]:
        """``table`` without the peers no longer routable once it outgrows the membership."""
        routable = self._gossip.routable
        if len(table) > 2 * len(routable) + 16:
            return {p: e for p, e in table.items() if p in routable}
        return table
