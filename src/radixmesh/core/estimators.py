"""Online estimators for what a request will cost: forward round-trip, prefill, decode.

Theory of operation
-------------------
The router predicts each candidate's latency as::

    forward RTT (0 for self) + queue wait + prefill(uncached | cached) + decode(max_tokens)

Every term is an estimate fed by observations; each starts from a prior so the first decisions
are sane. Estimates are exponentially weighted moving averages (EWMA): cheap, O(1), and they
track drift (a node that slows down is noticed within a few requests).

Prefill is not linear in the number of uncached tokens: attention over the cached context
grows with it. The model is ``overhead + rate * work(u, c)`` with
``work(u, c) = u * (1 + (c + u / 2) / context_scale)`` — ``u`` uncached tokens attending over
``c`` cached plus (on average) half of themselves. ``rate`` is learnt from observations by
EWMA of ``(seconds - overhead) / work``; ``context_scale`` is a constant of the hardware/model
(how many context tokens double a token's cost), given in the priors. (Fitting the overhead
too, by weighted least squares over the last few requests, was tried: exact in the
simulator, but on the real tiny engine its noise, 21 % per request, made the per-node fits
differ by more than the router's 1.5× tolerance, and at 200 ms one node took 71 % of the
requests. The per-request EWMA of the rate averages that noise away.)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class CostPriors:
    """Starting estimates, used until observations arrive (defaults: `tiny` preset on CPU)."""

    rtt_s: float = 0.002  # round-trip overhead of one forward (network + HTTP), seconds
    prefill_overhead_s: float = 0.004  # fixed per-request prefill cost, seconds
    prefill_s_per_token: float = 8e-5  # seconds per uncached token at zero context
    context_scale: float = 4096.0  # context tokens that double one token's prefill cost
    decode_s_per_token: float = 0.007  # seconds per generated token
    alpha: float = 0.2  # EWMA weight of a new observation

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


def median_speed(speeds: Sequence[SpeedReport]) -> SpeedReport:
    """Each field's median over ``speeds`` (at least one)."""
    if not speeds:
        raise ValueError("median_speed needs at least one speed")
    return SpeedReport(
        *(statistics.median(getattr(s, f.name) for s in speeds) for f in fields(SpeedReport))
    )


class ComputeModel:
    """This node's own prefill/decode speed, learnt from the requests it served."""

    def __init__(self, priors: CostPriors) -> None:
        self.priors = priors
        self._overhead = priors.prefill_overhead_s
        self._rate = Ewma(priors.prefill_s_per_token, priors.alpha)
        self._decode = Ewma(priors.decode_s_per_token, priors.alpha)
        self._service = Ewma(
            priors.prefill_overhead_s + 256 * priors.prefill_s_per_token, priors.alpha
        )

    def observe_prefill(self, uncached: int, cached: int, seconds: float) -> None:
        if uncached <= 0 or seconds < 0:
            return
        work = prefill_work(uncached, cached, self.priors.context_scale)
        self._rate.observe(max(0.0, seconds - self._overhead) / work)

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
        self._overhead = speed.prefill_overhead_s
        for ewma, value in ((self._rate, speed.prefill_s_per_token),
                            (self._decode, speed.decode_s_per_token),
                            (self._service, speed.mean_service_s)):
            ewma.value, ewma.count = value, 0

    def report(self) -> SpeedReport:
        return SpeedReport(
            prefill_overhead_s=self._overhead,
            prefill_s_per_token=self._rate.value,
            decode_s_per_token=self._decode.value,
            mean_service_s=self._service.value,
        )


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
        covered = 0
        for h in hashes:
            if h not in self._held:
                break
            covered += 1
        return max(prompt_tokens - max(cached_tokens, covered * self.block_size), 1)

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


class RttTable:
    """Forward round-trip estimate per peer (EWMA), with the prior for peers never measured.

    Two sources, kept apart: real forwards (``probe=False``: what a forward actually added)
    and gossip echoes (``probe=True``: cheap, available before any forward, but they include
    the gossip path's own encode/apply time, so they overstate a forward's cost). A peer's
    estimate is its forward EWMA once one forward was measured, else its probe EWMA, else the
    prior.
    """

    def __init__(self, priors: CostPriors) -> None:
        self._priors = priors
        self._forward: dict[str, Ewma] = {}
        self._probe: dict[str, Ewma] = {}

    def observe(self, peer: str, seconds: float, probe: bool = False) -> None:
        if seconds < 0:
            return
        table = self._probe if probe else self._forward
        est = table.get(peer)
        if est is None:
            est = table[peer] = Ewma(seconds, self._priors.alpha)
            est.count = 1
            return
        est.observe(seconds)

    def get(self, peer: str) -> float:
        est = self._forward.get(peer) or self._probe.get(peer)
        return self._priors.rtt_s if est is None else est.value

    def measured(self, peer: str) -> bool:
        return peer in self._forward or peer in self._probe

    def forget(self, peer: str) -> None:
        self._forward.pop(peer, None)
        self._probe.pop(peer, None)


class Utilization:
    """Busy fraction of a node over roughly the last ``window_s`` seconds (exponential decay).

    Each finished request adds its service seconds; the estimate decays with time constant
    ``window_s``, so ``value(now)`` approximates ``busy seconds / window`` — 1.0 for a node
    that was never idle, 0.0 for one that served nothing lately.
    """

    __slots__ = ("_acc", "_at", "window_s")

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self.window_s = window_s
        self._acc = 0.0
        self._at: float | None = None

    def observe(self, busy_s: float, now: float) -> None:
        if busy_s <= 0:
            return
        self._acc = self._decayed(now) + busy_s
        self._at = now

    def value(self, now: float) -> float:
        return min(1.0, self._decayed(now) / self.window_s)

    def _decayed(self, now: float) -> float:
        if self._at is None or now <= self._at:
            return self._acc
        return self._acc * math.exp(-(now - self._at) / self.window_s)


class WaitError:
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

    __slots__ = ("_at", "_spread", "alpha", "window_s")

    def __init__(self, alpha: float, window_s: float) -> None:
        if window_s <= 0 or not 0 < alpha <= 1:
            raise ValueError("window_s must be > 0 and alpha in (0, 1]")
        self.alpha = alpha
        self.window_s = window_s
        self._spread = 0.0
        self._at: float | None = None

    def observe(self, residual_s: float, now: float) -> None:
        if not math.isfinite(residual_s):
            return
        kept = self.spread(now)
        self._spread = kept + self.alpha * (abs(residual_s) - kept)
        self._at = now

    def spread(self, now: float) -> float:
        if self._at is None:
            return 0.0
        return self._spread * math.exp(-max(now - self._at, 0.0) / self.window_s)
