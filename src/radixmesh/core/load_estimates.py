"""Online estimates of a node's load and links: round trip, utilization, wait error, queue.

Theory of operation
-------------------
The router's latency prediction (``core/estimators.py``: speeds, the priors and the EWMA these
share) needs, besides each node's speed, what stands between the request and that speed:

* :class:`RttTable` — each peer's forward round trip (forwards measured, gossip echoes as a
  fallback, the slowest link known for a peer never measured);
* :class:`Utilization` — a node's busy fraction over a window, counting the busy period
  under way (what bounded load compares);
* :class:`WaitError` — how far this node's predictions of a peer's queue wait were lately off
  (a forward must save more than that);
* :class:`Lateness` — how much later than predicted a peer lately answered this node's
  forwards (its mean added to its predicted wait, its median to the TTFT forecast);
* :class:`QueuedBlocks` — the prompt blocks of the requests queued on a node, so a block an
  earlier queued request computes counts as cached for a later one;
* :class:`ArrivalRate` — the requests a node's engine took per second lately (a batch
  report's ``rate``: what a forward joining that batch is priced by);
* :func:`decayed_span` — the time an exponentially decayed sum covers (what utilization and
  ``placement.KeyRates`` and :class:`ArrivalRate` divide by).

Each is O(1) per observation (``QueuedBlocks``: per block), pure, and time is an argument.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from radixmesh.core.estimators import CostPriors, Ewma


class QueuedBlocks:
    """The prompt blocks of the requests waiting or running on one node, so that what a
    queued request will compute is counted once: a block an earlier queued request computes
    is cached by the time a later one runs (a burst of requests for one cold document costs
    one prefill of it, not one each). Both shells keep one per node and report the queue's
    uncached tokens in ``LoadChanged``; ``hashes`` are a request's block hashes in order."""

    __slots__ = ("_held", "block_size")

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self._held: dict[int, int] = {}  # block hash -> queued requests that hold it

    def uncached(self, hashes: Sequence[int], prompt_tokens: int, cached_tokens: int) -> int:
        """Prompt tokens of a request that neither the cache (its ``cached_tokens``) nor an
        earlier queued request covers; at least 1 (the last prompt token is always computed)."""
        return max(prompt_tokens - max(cached_tokens, self.covered_tokens(hashes)), 1)

    def covered(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes`` (a request's block hashes, in order) a queued request
        has, from the first: the blocks it will find cached behind them."""
        n = 0
        for h in hashes:
            if h not in self._held:
                break
            n += 1
        return n

    def covered_tokens(self, hashes: Sequence[int]) -> int:
        """``covered`` in tokens."""
        return self.covered(hashes) * self.block_size

    def cached_when_run(self, hashes: Sequence[int], prompt_tokens: int, cached_tokens: int) -> int:
        """Tokens of a prompt its node will have cached when it runs it (first come, first
        served): what the engine holds (``cached_tokens``) or what a queued request computes
        first, whichever is longer; the last prompt token is always computed."""
        queued = min(self.covered_tokens(hashes), max(prompt_tokens - 1, 0))
        return max(min(cached_tokens, max(prompt_tokens - 1, 0)), queued)

    def add(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._held[h] = self._held.get(h, 0) + 1

    def remove(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            left = self._held.get(h, 0) - 1
            if left > 0:
                self._held[h] = left
            else:
                self._held.pop(h, None)

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, block: object) -> bool:
        return block in self._held


class RttTable:
    """Forward round-trip estimate per peer (EWMA), pessimistic for peers never measured.

    Two sources, kept apart: real forwards (``probe=False``: what a forward actually added)
    and gossip echoes (``probe=True``: cheap, available before any forward, but they include
    the gossip path's own encode/apply time, so they overstate a forward's cost). A peer's
    estimate is its forward EWMA once one forward was measured, else its probe EWMA, else the
    worst estimate of the peers measured, else (nothing measured: ``known`` is False) the
    prior. A peer never measured is priced like the slowest link known, not like the prior:
    on a 1 s link the prior's 2 ms made the very first forward of a run cost 2 s more than
    serving locally would have.

    A probe-only estimate is scaled by how much the probes of the peers measured both ways
    overstated their forwards (``forward / probe``, an EWMA of the peers' ratios, at most 1):
    on 16 emulated H100s sharing the 2-core box, the gossip echoes of peers a node had not
    forwarded to read 22-30 ms against 6-8 ms for the forwards it made, and the cost policy
    bought cold local copies of prefixes a peer held rather than pay those (25 of 400).
    """

    def __init__(self, priors: CostPriors) -> None:
        self._priors = priors
        self._forward: dict[str, Ewma] = {}
        self._probe: dict[str, Ewma] = {}
        self._worst: tuple[str, float] | None = None  # (peer, its estimate); None: recompute
        self._ratio = Ewma(1.0, priors.alpha)  # forward / probe round trip, over the peers

    def observe(self, peer: str, seconds: float, probe: bool = False) -> None:
        if seconds < 0:
            return
        probed = self._probe.get(peer)
        if not probe and probed is not None and probed.value > 0:
            self._ratio.observe(min(seconds / probed.value, 1.0))
            self._worst = None  # every probe-only estimate moved
        table = self._probe if probe else self._forward
        est = table.get(peer)
        if est is None:
            est = table[peer] = Ewma(seconds, self._priors.alpha)
            est.count = 1
        else:
            est.observe(seconds)
        self._update_worst(peer)

    def _update_worst(self, peer: str) -> None:
        value = self._own(peer)
        worst = self._worst
        if worst is None:
            return
        if value is not None and value >= worst[1]:
            self._worst = (peer, value)
        elif worst[0] == peer:  # the slowest link got faster (or was forgotten): recompute
            self._worst = None

    def _own(self, peer: str) -> float | None:
        est = self._forward.get(peer)
        if est is not None:
            return est.value
        est = self._probe.get(peer)
        return None if est is None else est.value * min(self._ratio.value, 1.0)

    @property
    def known(self) -> bool:
        """Whether any peer's round trip was measured (until then every estimate is the
        prior, which says nothing about this network)."""
        return bool(self._forward or self._probe)

    def get(self, peer: str) -> float:
        own = self._own(peer)
        if own is not None:
            return own
        if not self.known:
            return self._priors.rtt_s
        if self._worst is None:
            self._worst = max(((p, v) for p in {*self._forward, *self._probe}
                               if (v := self._own(p)) is not None), key=lambda pv: pv[1])
        return self._worst[1]

    def measured(self, peer: str) -> bool:
        return peer in self._forward or peer in self._probe

    def forget(self, peer: str) -> None:
        self._forward.pop(peer, None)
        self._probe.pop(peer, None)
        self._update_worst(peer)


def decayed_span(window_s: float, observed_s: float, min_span: float) -> float:
    """The seconds an exponentially decayed sum (time constant ``window_s``) covers after
    ``observed_s`` seconds of observation: ``window × (1 - exp(-t / window))``, ``t`` at least
    ``min_span`` windows. Dividing such a sum by the window instead under-reports a node's
    first windows (63 % after one); the floor keeps a first sample from counting as a
    steady stream. What :class:`Utilization`, :class:`ArrivalRate` and ``placement.KeyRates``
    divide by."""
    t = max(observed_s, min_span * window_s)
    return window_s * -math.expm1(-t / window_s)


class ArrivalRate:
    """Arrivals per second over roughly the last ``window_s`` seconds: each arrival counts
    ``exp(-age / window_s)``, and the sum is divided by the time it covers,
    :func:`decayed_span` of the time since the first arrival (floored at ``min_span``
    windows). Read at any time (:meth:`at` decays to ``now``): a node that stopped taking
    requests reads a falling rate, not the last one it had.

    Divided by the window instead (as the batch report's rate was, in ``core/shadow.py`` and
    a copy in the simulator), a node's first seconds read ``t / window`` of its true rate and
    peers priced joining its batch at nothing; in the simulator (``sim --experiment regimes``,
    ``cost``, 80 % Poisson) dividing by the span covered took RAG's mean TTFT from 233 to 201
    ms on 16 H100s and from 205 to 32 ms on the mixed 16 (docs/benchmarks.md).
    One arrival read ``t`` seconds later (past the floor) reads at most ``1 / t``: one
    request is not a steady stream. O(1) per arrival and per read."""

    __slots__ = ("_acc", "_at", "_since", "min_span", "window_s")

    def __init__(self, window_s: float, min_span: float) -> None:
        if not window_s > 0 or not min_span > 0:
            raise ValueError("window_s and min_span must be > 0")
        self.window_s = window_s
        self.min_span = min_span
        self._acc = 0.0  # weighted arrivals at ``_at``
        self._at = 0.0
        self._since: float | None = None  # the first arrival

    def add(self, now: float) -> None:
        """One arrival at ``now`` (an arrival earlier than the last counts as at the last)."""
        if self._since is None:
            self._since = self._at = now
        self._acc = self._decayed(now) + 1.0
        self._at = max(self._at, now)

    def at(self, now: float, min_span_s: float = 0.0) -> float:
        """The rate as of ``now``: 0 before the first arrival. ``min_span_s``: divide by at
        least this many seconds (a rate read over less than what it describes lasted)."""
        if self._since is None:
            return 0.0
        span = decayed_span(self.window_s, now - self._since, self.min_span)
        return self._decayed(now) / max(span, min_span_s)

    def _decayed(self, now: float) -> float:
        return self._acc * math.exp(-max(0.0, now - self._at) / self.window_s)


class Utilization:
    """Busy fraction of a node over roughly the last ``window_s`` seconds: the time it had a
    request queued or running, exponentially weighted (time constant ``window_s``).

    The node says when it becomes busy and idle (:meth:`set_busy`, from its engine's queue
    depth), so the figure counts the busy period under way: it is current while a long
    request runs. (It was the service seconds of the requests *finished*, added as each
    ended: on the real cluster with 16 clients a node prefilling its first cold 2,500-token
    prompts, 3-6 of them queued, read 0 for the run's first 5 s, so the bounded-load rules
    saw an idle node.)

    A weighted busy time is divided by the time it covers, ``window × (1 - exp(-t /
    window))`` with ``t`` the time since the node was first busy, floored at ``min_span``
    windows (as :class:`~radixmesh.core.placement.KeyRates` does): over the window itself, a
    node busy since its first request read 26 % after 3 s; the floor keeps one short first
    request from reading as a node always busy."""

    __slots__ = ("_acc", "_at", "_busy", "_since", "min_span", "window_s")

    def __init__(self, window_s: float, min_span: float = 0.25) -> None:
        if window_s <= 0 or not min_span > 0:
            raise ValueError("window_s and min_span must be > 0")
        self.window_s = window_s
        self.min_span = min_span
        self._acc = 0.0  # weighted busy seconds at ``_at``
        self._at: float | None = None
        self._busy = False
        self._since: float | None = None  # first busy

    def set_busy(self, busy: bool, now: float) -> None:
        """The node is busy (it has a request queued or running) from ``now`` on, or idle."""
        self._acc = self._weighted(now)
        self._at = now if self._at is None else max(now, self._at)
        self._busy = busy
        if busy and self._since is None:
            self._since = now

    def value(self, now: float) -> float:
        if self._since is None:
            return 0.0
        span = decayed_span(self.window_s, now - self._since, self.min_span)
        return min(1.0, self._weighted(now) / span)

    def _weighted(self, now: float) -> float:
        if self._at is None:
            return 0.0
        w = self.window_s
        kept = math.exp(-max(0.0, now - self._at) / w)
        return self._acc * kept + (w * (1.0 - kept) if self._busy else 0.0)


class _DecayingMean:
    """An EWMA of observations (weight ``alpha``) that decays towards 0 with time constant
    ``window_s`` while nothing is observed: what :class:`WaitError` and :class:`Lateness`
    keep per peer."""

    __slots__ = ("_at", "_mean", "alpha", "window_s")

    def __init__(self, alpha: float, window_s: float) -> None:
        if window_s <= 0 or not 0 < alpha <= 1:
            raise ValueError("window_s must be > 0 and alpha in (0, 1]")
        self.alpha = alpha
        self.window_s = window_s
        self._mean = 0.0
        self._at: float | None = None

    def _observe(self, x: float, now: float) -> None:
        if not math.isfinite(x):
            return
        kept = self._value(now)
        self._mean = kept + self.alpha * (x - kept)
        self._at = now

    def _value(self, now: float) -> float:
        if self._at is None:
            return 0.0
        return self._mean * math.exp(-max(now - self._at, 0.0) / self.window_s)


class WaitError(_DecayingMean):
    """How far this node's predictions of one peer's queue wait have lately been off, in
    seconds: an EWMA of ``|reported − predicted|`` over the forwards that peer served (each
    reports the wait it gave), decaying towards 0 with time constant ``window_s`` (once a
    burst is over the views are right again, and a node that stopped forwarding must not keep
    an old penalty). The router asks a forward to that peer to save more than this: a saving
    smaller than the error of the prediction it rests on is noise.

    A view of a peer's queue is a gossip round old, and every other entry node chooses at the
    same time: under bursty arrivals (Poisson) a peer that looked idle has a queue when the
    forward lands, and forwards saving a few milliseconds lose tens. One request at a time
    every residual is 0, and so is this. Kept per peer, so a peer that reports wrong waits
    only changes how often it is itself chosen."""

    __slots__ = ()

    def observe(self, residual_s: float, now: float) -> None:
        self._observe(abs(residual_s), now)

    def spread(self, now: float) -> float:
        return self._value(now)


class Lateness(_DecayingMean):
    """How much later than predicted one peer has lately met this node's forwards, in
    seconds: a signed EWMA of ``actual − predicted`` over the forwards that peer answered (the
    offer to the first token, placed by the peer's own timings, against the chosen candidate's
    ``ttft_s``) or refused as slower (the queue wait it said, against the candidate's
    ``wait_s``), decaying towards 0 with time constant ``window_s``. The router adds it to
    that peer's predicted wait (``NodeInfo.lateness_s``): a correction, where
    :class:`WaitError` is a margin.

    Why: a peer's batch report is up to a gossip round old and aged as if nobody else sent it
    work, and the forwards taken are those whose predictions came out lowest, so the
    predictions of chosen peers run early: 16 simulated H100s, hot prefix at 50 %, forwards
    predicted at 21 ms took 34 ms (`cost` 1.24x `none`'s TTFT); on the emulated mesh the
    forwarded TTFTs were predicted 52 % short. Learnt per peer from what its forwards met,
    with no configuration for heterogeneity. One request at a time, every residual is about
    0, and so is this.

    The same residuals' running median (:meth:`median`) corrects the TTFT a node forecasts
    for a forward (``Candidate.ttft_s``): the mean is what ranking needs (expected time), but
    the residuals are skewed (a few forwards land behind a burst others sent meanwhile), and a
    forecast judged by its absolute error wants the median: 16 simulated H100s, RAG at 80 %,
    forwarded TTFTs forecast with the mean came out 13.5 % long in the median (median absolute
    error 27.1 %, p90 87.0 %), with the median 0.7 % short (20.4 %, 52.3 %). A stochastic
    median: each residual moves it towards itself by ``alpha`` x the residuals' mean absolute
    deviation from it (never past it), decaying towards 0 as the mean does."""

    __slots__ = ("_dev", "_median")

    def __init__(self, alpha: float, window_s: float) -> None:
        super().__init__(alpha, window_s)
        self._median = 0.0
        self._dev = 0.0

    def observe(self, residual_s: float, now: float) -> None:
        if not math.isfinite(residual_s):
            return
        kept = self.median(now)
        gap = residual_s - kept
        self._dev += self.alpha * (abs(gap) - self._dev)
        self._median = kept + math.copysign(min(abs(gap), self.alpha * self._dev), gap)
        self._observe(residual_s, now)

    def value(self, now: float) -> float:
        """The mean residual: what the router adds to the peer's predicted wait."""
        return self._value(now)

    def median(self, now: float) -> float:
        """The median residual: what the TTFT forecast adds to it."""
        return self.both(now)[1]

    def both(self, now: float) -> tuple[float, float]:
        """(:meth:`value`, :meth:`median`), decayed once (the router's hot path)."""
        if self._at is None:
            return 0.0, 0.0
        kept = math.exp(-max(now - self._at, 0.0) / self.window_s)
        return self._mean * kept, self._median * kept
