"""Online estimators for what a request will cost: forward round-trip, prefill, decode.

Theory of operation
-------------------
The router predicts each candidate's latency as::

    forward RTT (0 for self) + queue wait + prefill(uncached | cached) + decode(max_tokens)

Every term is an estimate fed by observations; each starts from a prior so the first decisions
are sane. Estimates are exponentially weighted (a new observation weighs ``alpha``): cheap,
O(1), and they track drift (a node that slows down is noticed within a few requests).

Prefill is not linear in the number of uncached tokens: attention over the cached context
grows with it. The model is ``overhead + rate * work(u, c)`` with
``work(u, c) = u * (1 + (c + u / 2) / context_scale)`` — ``u`` uncached tokens attending over
``c`` cached plus (on average) half of themselves. ``overhead`` and ``rate`` are tracked
together by a two-state Kalman filter whose uncertainty lies mostly along the line itself
(:class:`PrefillFit`: a machine that turns slower is slower at every size; the split between
overhead and rate is learnt slowly from prefills of different sizes); ``context_scale`` is a
constant of the hardware/model (how many context tokens double a token's cost), given in the
priors. (The rate alone, as an EWMA of ``(seconds - overhead)/work`` under the prior's
overhead, followed each node's mix of requests wherever the true overhead differed from the
prior's. A plain least-squares fit of both, tried before that, was ill-conditioned on the
narrow spread of sizes a node serves: on the real tiny engine, 21 % noise per request, the
per-node fits differed by more than the router's 1.5× tolerance and at 200 ms one node took
71 % of the requests. Weighted least squares with a ridge towards the prior held, but kept
the rate of the last prefills of different sizes while the overhead followed the hits. Nodes'
speeds are compared by their times at two reference sizes (:func:`prefill_times`), not field
by field.)

The estimates of load and links (round trip, utilization, queue-wait error, queued blocks)
are in ``core/load_estimates.py``; they share this module's priors and EWMA.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class CostPriors:
    """Starting estimates, used until observations arrive (defaults: `tiny` preset on CPU)."""

    rtt_s: float = 0.002  # round-trip overhead of one forward (network + HTTP), seconds
    prefill_overhead_s: float = 0.004  # fixed per-request prefill cost, seconds
    prefill_s_per_token: float = 8e-5  # seconds per uncached token at zero context
    context_scale: float = 4096.0  # context tokens that double one token's prefill cost
    decode_s_per_token: float = 0.007  # seconds per generated token
    alpha: float = 0.2  # EWMA weight of a new observation

    def stretched(self, scale: float) -> CostPriors:
        """These priors for an engine ``scale`` times slower than their figures (an emulated
        mesh's ``--time-scale``, as ``RouterConfig.stretched``): every duration ``scale`` times
        longer, so that a node's first requests weigh compute against the round trip as the
        simulator's do (``1``: itself)."""
        if scale == 1.0:
            return self
        return replace(self, rtt_s=self.rtt_s * scale,
                       prefill_overhead_s=self.prefill_overhead_s * scale,
                       prefill_s_per_token=self.prefill_s_per_token * scale,
                       decode_s_per_token=self.decode_s_per_token * scale)

    def __post_init__(self) -> None:
        for name in ("rtt_s", "prefill_overhead_s", "prefill_s_per_token", "decode_s_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.context_scale <= 0:
            raise ValueError("context_scale must be > 0")
        if not 0 < self.alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")


class Ewma:
    """Exponentially weighted moving average with a prior."""

    __slots__ = ("alpha", "count", "value")

    def __init__(self, prior: float, alpha: float) -> None:
        self.value = prior
        self.alpha = alpha
        self.count = 0

    def observe(self, x: float) -> None:
        # The first observations weigh more so a bad prior is forgotten quickly.
        weight = max(self.alpha, 1.0 / (self.count + 2))
        self.value += weight * (x - self.value)
        self.count += 1


def prefill_work(uncached: float, cached: float, context_scale: float) -> float:
    """Work units of prefilling ``uncached`` tokens after ``cached`` ones (see module doc)."""
    return uncached * (1.0 + (cached + uncached / 2.0) / context_scale)


@dataclass(frozen=True, slots=True)
class SpeedReport:
    """A node's own measured speed, as it gossips it (never a router-side counter)."""

    prefill_overhead_s: float
    prefill_s_per_token: float  # rate per work unit (see prefill_work)
    decode_s_per_token: float
    mean_service_s: float  # mean wall time of one request on this node (queue wait excluded)

    def prefill_s(self, uncached: int, cached: int, context_scale: float) -> float:
        if uncached <= 0:
            return 0.0
        work = prefill_work(uncached, cached, context_scale)
        return self.prefill_overhead_s + self.prefill_s_per_token * work

    def service_s(self, uncached: int, cached: int, max_tokens: int, context_scale: float) -> float:
        return self.prefill_s(uncached, cached, context_scale) + self.decode_s_per_token * max(
            0, max_tokens - 1
        )

    def queued_service_s(self, depth: int, prompt_tokens: int, uncached_tokens: int,
                         output_tokens: int, context_scale: float) -> float | None:
        """The mean predicted service of the ``depth`` requests of a queue holding these
        tokens (prompt, not cached when queued, output budgets; summed): one place in that
        queue priced by what its requests will compute, where ``mean_service_s`` is what
        the node's past requests cost (mostly warm, a queue of cold prefills costs about
        twice that). None: an empty queue, or one whose tokens were not reported."""
        if depth <= 0 or prompt_tokens <= 0:
            return None
        u = min(max(uncached_tokens, 0), prompt_tokens) / depth
        c = prompt_tokens / depth - u
        prefill = 0.0
        if u > 0:
            work = prefill_work(u, c, context_scale)
            prefill = self.prefill_overhead_s + self.prefill_s_per_token * work
        return prefill + self.decode_s_per_token * max(0.0, output_tokens / depth - 1)


# The prefill work (``prefill_work`` units) of a warm step, a few dozen new tokens, and of a
# cold prompt: prefill speeds are compared, and their median taken, by their times at these
REFERENCE_WORK = (64.0, 1024.0)


def prefill_times(speed: SpeedReport) -> tuple[float, float]:
    """``speed``'s prefill times at the two :data:`REFERENCE_WORK` sizes."""
    small, large = REFERENCE_WORK
    return (speed.prefill_overhead_s + speed.prefill_s_per_token * small,
            speed.prefill_overhead_s + speed.prefill_s_per_token * large)


def median_speed(speeds: Sequence[SpeedReport]) -> SpeedReport:
    """The median of ``speeds`` (at least one): for prefill, the line through the medians of
    their times at the :data:`REFERENCE_WORK` sizes; each other field's median. (Overhead and
    rate are fitted together (:class:`PrefillFit`): two nodes that agree on every prefill
    they served may split it differently, and a per-field median would pair one node's
    overhead with another's rate.)"""
    if not speeds:
        raise ValueError("median_speed needs at least one speed")
    times = [prefill_times(s) for s in speeds]
    mid = (_median([t[0] for t in times]), _median([t[1] for t in times]))
    overhead, rate = _line_through(mid, speeds, times)
    return SpeedReport(
        prefill_overhead_s=overhead,
        prefill_s_per_token=rate,
        decode_s_per_token=_median([s.decode_s_per_token for s in speeds]),
        mean_service_s=_median([s.mean_service_s for s in speeds]),
    )


def _line_through(mid: tuple[float, float], speeds: Sequence[SpeedReport],
                  times: list[tuple[float, float]]) -> tuple[float, float]:
    """The prefill line (overhead, rate) through the median times ``mid`` at the reference
    sizes: a speed's own line when its times are those (rebuilt from them, rounding made it
    another, so that every node snapped to it was copied on every decision), else rebuilt."""
    for speed, t in zip(speeds, times, strict=True):
        if t == mid:
            return speed.prefill_overhead_s, speed.prefill_s_per_token
    (small, large), (t_small, t_large) = REFERENCE_WORK, mid
    rate = max(t_large - t_small, 0.0) / (large - small)
    overhead = t_small - rate * small
    if overhead < 0:
        return 0.0, t_large / large
    return overhead, rate


def _median(values: list[float]) -> float:
    """``statistics.median`` of a non-empty list, without its generality (the router's hot
    path takes one median of four figures per decision)."""
    values.sort()
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


class PrefillFit:
    """A node's prefill time as ``overhead + rate × work`` (see :func:`prefill_work`), both
    tracked by a two-state Kalman filter whose uncertainty lies mostly along the line
    itself: a machine that turns k times slower (or faster) is so at every size, so a
    prefill of any size moves both figures in proportion, while the line's *shape* (how
    overhead and rate split a prefill's time) is learnt from prefills of different sizes
    and drifts only slowly. Measurement noise is taken as ``noise`` × the predicted time
    (relative: a shared CPU's jitter grows with the work).

    The state is (overhead, rate × ``x_ref``), both in seconds. Its covariance starts as
    ``level_sd``² × θθᵀ + ``shape_sd``² × diag(θ²) (the prior can be off by a factor in
    level, and its shape is barely trusted: with ``shape_sd`` 3 an unusual shape, 170 ms +
    0.1 us a unit, was still 6 % off after 300 noiseless prefills) and grows each step by
    ``level_drift`` × θθᵀ + ``shape_drift`` × diag(θ²): the level may move ~√0.01 = 10 %
    between two prefills, the shape ~1 %.

    Why a filter, not least squares. Exponentially weighted least squares (the previous
    design) kept the rate of whatever prefills of *different sizes* it had last seen: a
    node that served a burst of cold prefills on a contended CPU and then only cache hits
    refreshed its overhead from the hits and kept the burst's rate, 2.3x too slow, for as
    long as it served hits (real cluster, the hot prefix at Poisson 50 % right after the
    capacity probe: three of four nodes; one advertised so lax a ``beat_s`` that a
    1,216-token request waited 3.9 s behind a 3,014-token one). Here those hits scale the
    rate with the overhead. (``scripts/prefill-fit-check.py``, 30 ms + 100 us a unit,
    lognormal noise 15 %, 40 seeds: after 40 prefills at 2.3x and 25 hits at 1x, a 3,000-unit
    prefill is priced 1.14x its time, 5th-95th percentile 1.01-1.30, against 2.40x,
    2.09-2.64, by least squares; in steady state 1.00x, 0.90-1.15, against 1.01x, 0.89-1.17.)

    Learning the rate alone under a fixed overhead (the design before least squares) put
    the whole time of a small prefill into its rate: a node serving mostly cache hits learnt
    a rate 10x its peers' (simulator, chat, one client, identical nodes). Here a node that
    served only one size predicts that size exactly and keeps roughly the prior's shape for
    the rest (the level direction is the uncertain one).

    Data that cannot tell the rate (larger prefills measured faster): an update that would
    drive the rate below zero halves it instead and moves the prediction at that size as
    the filter would have (or, where that needs a negative overhead, scales the whole line
    so): never a flat line at once (rate 0 priced every prefill alike: on the real cluster
    under memory pressure a node advertising 82 ms + 0 us a unit drew a cold 1,686-token
    prefill away from the entry node holding 1,356 of its tokens). The covariance takes the
    filter's update either way."""

    __slots__ = ("_p00", "_p01", "_p11", "level_drift", "level_sd", "noise", "overhead",
                 "rate", "shape_drift", "shape_sd", "x_ref")

    def __init__(self, overhead: float, rate: float, x_ref: float = 512.0, noise: float = 0.2,
                 level_drift: float = 0.01, shape_drift: float = 1e-4, level_sd: float = 3.0,
                 shape_sd: float = 30.0) -> None:
        if overhead < 0 or rate < 0 or overhead + rate <= 0 or x_ref <= 0 or noise <= 0 \
                or level_drift < 0 or shape_drift < 0 or level_sd < 0 or shape_sd <= 0:
            raise ValueError("PrefillFit needs overhead, rate >= 0 (not both 0), x_ref > 0, "
                             "noise > 0, drifts >= 0, level_sd >= 0 and shape_sd > 0")
        self.x_ref, self.noise = x_ref, noise
        self.level_drift, self.shape_drift = level_drift, shape_drift
        self.level_sd, self.shape_sd = level_sd, shape_sd
        self.restart(overhead, rate)

    def restart(self, overhead: float, rate: float) -> None:
        """Forget every observation; ``overhead`` and ``rate`` are the new prior."""
        self.overhead, self.rate = max(overhead, 0.0), max(rate, 0.0)
        a, b = self.overhead, self.rate * self.x_ref
        lv, sh = self.level_sd ** 2, self.shape_sd ** 2
        self._p00, self._p01, self._p11 = (lv + sh) * a * a, lv * a * b, (lv + sh) * b * b
        self._floor()

    def _floor(self) -> None:
        """Keep the covariance positive definite where a figure is 0 (a prior of no
        overhead): some uncertainty on each, a thousandth of the other's scale."""
        a, b = self.overhead, self.rate * self.x_ref
        tiny = (1e-3 * max(a, b, 1e-9)) ** 2
        self._p00 = max(self._p00, tiny)
        self._p11 = max(self._p11, tiny)
        bound = 0.999 * math.sqrt(self._p00 * self._p11)
        self._p01 = min(max(self._p01, -bound), bound)

    def observe(self, work: float, seconds: float) -> None:
        if not (work > 0 and seconds >= 0 and math.isfinite(work) and math.isfinite(seconds)):
            return
        a, b = self.overhead, self.rate * self.x_ref
        # the machine's level and, slowly, the line's shape may have moved since
        q, s = self.level_drift, self.shape_drift
        p00 = self._p00 + (q + s) * a * a
        p01 = self._p01 + q * a * b
        p11 = self._p11 + (q + s) * b * b
        h = work / self.x_ref  # the observation is a + b·h
        predicted = a + b * h
        ph0, ph1 = p00 + p01 * h, p01 + p11 * h
        hph = ph0 + h * ph1
        r = (self.noise * predicted) ** 2
        if hph + r <= 0:
            return
        k0, k1 = ph0 / (hph + r), ph1 / (hph + r)
        error = seconds - predicted
        new_a, new_b = a + k0 * error, b + k1 * error
        if new_b < 0:
            # larger prefills measured faster: halve the rate (never to 0 at once: a flat line
            # prices every prefill alike) and move this prediction as the filter would have
            target = predicted + hph / (hph + r) * error
            new_b = 0.5 * b
            new_a = target - new_b * h
            if new_a < 0:  # or keep the shape and move the line's level
                scale = max(target, 0.0) / predicted if predicted > 0 else 1.0
                new_a, new_b = a * scale, b * scale
        elif new_a < 0:  # no overhead: the best line through zero
            new_a, new_b = 0.0, max(b + p11 * h / (p11 * h * h + r) * (seconds - b * h), 0.0)
        self.overhead, self.rate = new_a, new_b / self.x_ref
        self._p00, self._p01, self._p11 = p00 - k0 * ph0, p01 - k0 * ph1, p11 - k1 * ph1
        self._floor()


def speed_is_stale(measured_at: float | None, busy: bool, now: float, window_s: float) -> bool:
    """Whether a node's own speed estimate should start again from the median of its peers
    that served lately (``ComputeModel.restart_from``): at once if it never measured
    anything (its speed is still the configured prior), busy or not; else once it has
    been idle with no request refreshing it for ``window_s`` (not while a sample is
    coming). The nodes (``NodeCore``) and the benchmark's oracle follow this one rule."""
    if measured_at is None:
        return True
    return not busy and now - measured_at >= window_s


class ComputeModel:
    """This node's own prefill/decode speed, learnt from the requests it served."""

    def __init__(self, priors: CostPriors) -> None:
        self.priors = priors
        self._prefill = PrefillFit(priors.prefill_overhead_s, priors.prefill_s_per_token)
        self._decode = Ewma(priors.decode_s_per_token, priors.alpha)
        self._service = Ewma(
            priors.prefill_overhead_s + 256 * priors.prefill_s_per_token, priors.alpha
        )

    def observe_prefill(self, uncached: int, cached: int, seconds: float) -> None:
        if uncached <= 0 or seconds < 0:
            return
        self._prefill.observe(prefill_work(uncached, cached, self.priors.context_scale), seconds)

    def observe_decode(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds >= 0:
            self._decode.observe(seconds / tokens)

    def observe_service(self, seconds: float) -> None:
        if seconds >= 0:
            self._service.observe(seconds)

    def restart_from(self, fresh: Sequence[SpeedReport]) -> bool:
        """An estimate gone stale (nothing served for a load window) starts again from the
        median of ``fresh``, the speeds of peers that served lately; False (kept) when there
        are none (an idle mesh: nobody has a fresher one). Without it a node that learnt a
        slow speed at a busy moment is sent nothing and never measures again."""
        if not fresh:
            return False
        self.adopt(median_speed(fresh))
        return True

    def adopt(self, speed: SpeedReport) -> None:
        """Start again from ``speed`` (the mesh's median, when this node's own estimate has
        gone stale): the next observations weigh as much as after a fresh start."""
        self._prefill.restart(speed.prefill_overhead_s, speed.prefill_s_per_token)
        for ewma, value in ((self._decode, speed.decode_s_per_token),
                            (self._service, speed.mean_service_s)):
            ewma.value, ewma.count = value, 0

    def report(self) -> SpeedReport:
        return SpeedReport(
            prefill_overhead_s=self._prefill.overhead,
            prefill_s_per_token=self._prefill.rate,
            decode_s_per_token=self._decode.value,
            mean_service_s=self._service.value,
        )
