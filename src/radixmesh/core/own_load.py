"""What this node knows of itself: its engine's load, its measured speed, its token rate.

Theory of operation
-------------------
The shell reports the engine's load (``LoadChanged``: queue depth, requests running, the
queued requests' tokens) and each request served (``RequestServed``: prefill and decode
times). From those this part keeps:

* the own :class:`~radixmesh.core.estimators.ComputeModel` (prefill line, decode rate, mean
  service) and :class:`TokenRate` (bounded admission's default
  token cap);
* the utilization over ``load_window_s`` (bounded load compares it with the peers');
* the requests its engine serves at once (:meth:`OwnLoad.streams`: Little's law over the
  completions of ``load_window_s``; bounded admission's streams);
* the load report its gossip advertises (``Load``; cached while no push-back runs, since
  most rounds carry the same one);
* the node as the router sees it (:meth:`OwnLoad.self_info`: exact cache match, own queue
  priced by its queued tokens, own speed).

A speed no request has refreshed for a load window restarts from the median speed of the
peers that served lately (:meth:`OwnLoad.refresh_stale_speed`, run before every gossip round).
"""

from __future__ import annotations

from dataclasses import replace

from radixmesh.core.config import NodeConfig
from radixmesh.core.cost_model import NodeInfo
from radixmesh.core.estimators import ComputeModel, CostPriors, Ewma, SpeedReport, speed_is_stale
from radixmesh.core.events import LoadChanged, RequestServed
from radixmesh.core.gossip import Gossiper
from radixmesh.core.load_estimates import ArrivalRate, Utilization
from radixmesh.core.messages import Load
from radixmesh.core.peer_estimate import bump
from radixmesh.core.shadow_state import BatchState, aged

# a stale own speed restarts from the median of at most this many fresh peers' speeds
SPEED_SAMPLE = 16


class TokenRate:
    """Tokens (prompt + output) this node's engine gets through per second of service, per
    request stream: a ratio of two EWMAs (tokens per request, seconds per request), so long
    requests weigh as much as they cost. Cached prompt tokens count at what they really cost
    (next to nothing): the rate is the workload's own mix, measured. The prior: a request of
    256 uncached prompt tokens and 16 output tokens at the prior speeds."""

    PRIOR_PROMPT, PRIOR_OUTPUT = 256, 16

    def __init__(self, priors: CostPriors) -> None:
        prior_s = SpeedReport(priors.prefill_overhead_s, priors.prefill_s_per_token,
                              priors.decode_s_per_token, 0.0).service_s(
            self.PRIOR_PROMPT, 0, self.PRIOR_OUTPUT, priors.context_scale)
        self._tokens = Ewma(float(self.PRIOR_PROMPT + self.PRIOR_OUTPUT), priors.alpha)
        self._seconds = Ewma(max(prior_s, 1e-6), priors.alpha)

    def observe(self, tokens: int, service_s: float) -> None:
        if tokens > 0 and service_s > 0:
            self._tokens.observe(float(tokens))
            self._seconds.observe(service_s)

    @property
    def per_s(self) -> float:
        return self._tokens.value / max(self._seconds.value, 1e-9)


LITTLE_SPANS = 2.0  # streams(): a completion rate is read over >= this many mean services

class OwnLoad:
    """This node's load, speed and token rate, as measured (see the module docstring)."""

    def __init__(self, config: NodeConfig, gossip: Gossiper, metrics: dict[str, float]) -> None:
        self._config = config
        self._gossip = gossip
        self._metrics = metrics
        self._compute = ComputeModel(config.priors)
        self._token_rate = TokenRate(config.priors)  # bounded admission's default token cap
        self._busy = Utilization(config.router.load_window_s)
        self._completions = ArrivalRate(config.router.load_window_s, 0.25)  # (streams)
        # when the own speed estimate was last refreshed (served, adopted); None: it is
        # still the configured prior
        self._speed_at: float | None = None
        # when it last measured its speed itself (served a request): what its load reports
        # tell peers (``Load.speed_measured_at``), not the time of an adoption
        self._measured_at: float | None = None
        self._load = LoadChanged(0, 0, 0, 0)
        self._load_at = 0.0  # when the shell reported it (a batch report ages from then)
        self.prior_speed = self._compute.report()  # (for peers whose speed is not known yet)
        self._load_cache: Load | None = None

    @property
    def load(self) -> LoadChanged:
        """The engine's load as the shell last reported it."""
        return self._load

    def speed(self) -> SpeedReport:
        """This node's measured speed (what bounded admission reckons the queue's work with)."""
        return self._compute.report()

    def token_rate(self) -> float:
        """Tokens (prompt + output) per second of service of one request stream, measured."""
        return self._token_rate.per_s

    def streams(self, now: float) -> float:
        """Requests the engine serves at once, as this node measures service: at least the
        ones running, or by Little's law the completion rate times the mean service time.
        An engine whose queue the node cannot see (an external one: a request's service
        time includes its wait inside the engine, and it runs before its first token comes
        back) reads its real overlap, not the requests streaming; a serial engine reads 1.

        Little's law holds over a span much longer than one service: the completion rate is
        read over at least ``LITTLE_SPANS`` mean service times (16 requests of 10 s ending
        together read 70 streams over the rate's own 2.5 s floor, a serial engine of 20 s
        requests 4.5), and never more than the requests outstanding here (an engine cannot
        serve at once more than it was sent). Under-reading errs the safe way: admission
        then bounds the wait as if fewer ran at once."""
        service = self._compute.report().mean_service_s
        little = self._completions.at(now, LITTLE_SPANS * service) * service
        outstanding = max(self._load.queue_depth, self._load.inflight)
        return max(1.0, float(self._load.inflight), min(little, float(outstanding)))

    def invalidate(self) -> None:
        """The advertised load must be built again (something it reports changed)."""
        self._load_cache = None

    def load_changed(self, event: LoadChanged, now: float) -> None:
        self._load = event
        self._load_at = now
        self._busy.set_busy(event.queue_depth > 0, now)
        self._load_cache = None

    def served(self, event: RequestServed, now: float) -> None:
        bump(self._metrics, "requests_served")
        self._completions.add(now)
        self._speed_at = self._measured_at = now
        self._load_cache = None
        uncached = max(0, event.prompt_tokens - event.cached_tokens)
        self._compute.observe_prefill(uncached, event.cached_tokens, event.prefill_s)
        self._compute.observe_decode(event.decode_tokens, event.decode_s)
        self._compute.observe_service(event.service_s)
        self._token_rate.observe(event.prompt_tokens + event.decode_tokens, event.service_s)

    def advertised(self, now: float, pushback: float | None) -> Load:
        """This node's load as advertised now, with ``pushback`` seconds of back-off asked
        (cached while no push-back is running), with its engine's batch as of now (each
        message leaves it out when its receiver's copy is still good: ``Dissemination``)."""
        busy = round(self._busy.value(now), 2)  # 0.01 steps: the cache survives idle decay
        batch = self.batch(now)
        if pushback is not None:
            return replace(self._make_load(pushback, busy), batch=batch)
        cached = self._load_cache
        if cached is None or cached.utilization != busy:
            cached = self._load_cache = self._make_load(None, busy)
        return cached if batch is None else replace(cached, batch=batch)

    def _make_load(self, pushback: float | None, busy: float) -> Load:
        ev = self._load
        speed = self._compute.report()
        return Load(ev.queue_depth, ev.inflight, ev.cache_tokens, ev.cache_budget, speed,
                    pushback, busy, self._measured_at)

    def batch(self, now: float) -> BatchState | None:
        """The engine's batch from this node's shadow of it, aged to ``now`` (None: no
        batching engine's shadow)."""
        ev = self._load
        return None if ev.batch is None else aged(ev.batch, now - self._load_at)

    def self_info(self, cached_tokens: int, now: float) -> NodeInfo:
        """This node as the router sees it: exact cache match, own queue, own speed; each
        place in its queue priced by its queued tokens (exact here; a peer's queue is priced
        at its mean service: gossiping this price was tried, and a report describes a queue
        that is gone when the forward lands — worse in the simulator)."""
        ev = self._load
        speed = self._compute.report()
        batch = self.batch(now)
        per_place = speed.queued_service_s(
            ev.queue_depth, ev.queue_prompt_tokens, ev.queue_uncached_tokens,
            ev.queue_output_tokens, self._config.router.context_scale)
        return NodeInfo(
            self._config.node_id,
            True,
            cached_tokens,
            0.0,
            ev.queue_depth,
            speed,
            utilization=self._busy.value(now),
            queue_service_s=per_place,
            kv_usage=ev.cache_tokens / ev.cache_budget if ev.cache_budget > 0 else 0.0,
            batch=batch,
        )

    def refresh_stale_speed(self, now: float) -> None:
        """An own speed estimate no request has refreshed for a load window (this node idle)
        starts again from the median speed of the routable peers that served lately, and
        so do its peers' views of it (its next load report carries it). A node that learnt
        a slow speed from a few requests served while the machine was oversubscribed would
        otherwise keep it for good: it looks too slow to itself and to its peers, is sent
        nothing, and never measures again (on the real cluster such a node served nothing
        for whole runs, its engine idle while its peers queued). A node really slower than
        the median is sent a request or two, and they bring its estimate back.
        A node that has measured nothing yet (its speed is the configured prior) adopts the
        peers' median at the first round after one of them has served, not a window later:
        the default prior is the tiny engine's on an idle machine, and a node still
        advertising it looked 4-5x faster than peers that had measured a loaded one, so in a
        run's first seconds cold copies went to the nodes that had served nothing (one
        client in the simulator with the fitted speeds: 2 agent tasks' steps copied cold
        to an idle node next to the holder of 1,456 of their 1,664 tokens). It does so while
        busy too: a node whose first requests are long cold prefills measures nothing until
        they end, and meanwhile its prior made it the cheapest queue in the mesh (real
        cluster, MMLU with 16 clients: in a run's first 5 s, five requests of new subjects
        went to the one node still prefilling its first prompt, 2,496 tokens, and waited
        13-28 s there; the other three had measured theirs)."""
        window = self._config.router.load_window_s
        if not speed_is_stale(self._speed_at, self._load.queue_depth > 0, now, window):
            return
        if self._speed_at is not None:
            self._speed_at = now  # (checked again a window later)
        if self._compute.restart_from(self._fresh_speeds(now, window)):
            self._speed_at = now
            self._load_cache = None
            bump(self._metrics, "speed_adopted")

    def _fresh_speeds(self, now: float, window: float) -> list[SpeedReport]:
        """The speeds of (at most SPEED_SAMPLE) routable peers that served lately."""
        fresh: list[SpeedReport] = []
        for peer in self._gossip.routable:
            est = self._gossip.estimates.get(peer)
            if est is None or est.speed is None or est.speed_measured_at is None:
                continue
            if now - est.speed_measured_at < window:
                fresh.append(est.speed)
                if len(fresh) >= SPEED_SAMPLE:
                    break
        return fresh
