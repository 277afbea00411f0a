"""Cost model: priors before observations, EWMA convergence, RTT table, prefill shape, the
error of queue-wait predictions, what one place in a queue costs (``QueuedBlocks`` against a
list of the queued prompts)."""

from __future__ import annotations

import math
import random
import statistics

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from radixmesh.core.estimators import (
    ComputeModel,
    CostPriors,
    Ewma,
    PrefillFit,
    SpeedReport,
    median_speed,
    prefill_times,
    prefill_work,
    speed_is_stale,
)
from radixmesh.core.load_estimates import (
    Lateness,
    QueuedBlocks,
    RttTable,
    Utilization,
    WaitError,
)

PRIORS = CostPriors()


def test_priors_are_used_before_observations() -> None:
    report = ComputeModel(PRIORS).report()
    assert report.prefill_s_per_token == PRIORS.prefill_s_per_token
    assert report.decode_s_per_token == PRIORS.decode_s_per_token
    assert report.prefill_overhead_s == PRIORS.prefill_overhead_s
    assert report.mean_service_s > 0
    rtt = RttTable(PRIORS)
    assert rtt.get("peer") == PRIORS.rtt_s and not rtt.measured("peer")


@settings(max_examples=100, deadline=None)
@given(prior=st.floats(0, 10), x=st.floats(0, 10), alpha=st.floats(0.01, 1))
def test_ewma_converges_to_a_constant_input(prior: float, x: float, alpha: float) -> None:
    est = Ewma(prior, alpha)
    for _ in range(2000):
        est.observe(x)
    assert est.value == pytest.approx(x, rel=1e-6, abs=1e-9)


def test_compute_model_learns_rates() -> None:
    model = ComputeModel(PRIORS)
    true_rate = 3e-4
    for u, c in [(100, 0), (500, 1000), (50, 3000)] * 100:
        seconds = PRIORS.prefill_overhead_s + true_rate * prefill_work(u, c, PRIORS.context_scale)
        model.observe_prefill(u, c, seconds)
        model.observe_decode(10, 0.5)
        model.observe_service(0.25)
    report = model.report()
    assert report.prefill_s_per_token == pytest.approx(true_rate, rel=0.01)
    assert report.prefill_overhead_s == pytest.approx(PRIORS.prefill_overhead_s, rel=0.05)
    assert report.decode_s_per_token == pytest.approx(0.05)
    assert report.mean_service_s == pytest.approx(0.25)
    model.observe_prefill(0, 10, 1.0)  # ignored: nothing prefilled
    model.observe_decode(0, 1.0)
    model.observe_service(-1.0)
    assert model.report() == report


@settings(max_examples=200, deadline=None)
@given(
    overhead=st.floats(0, 0.2),
    rate=st.floats(1e-7, 1e-3),
    sizes=st.lists(st.tuples(st.integers(1, 4000), st.integers(0, 4000)), min_size=2,
                   max_size=6),
)
def test_prefill_fit_recovers_overhead_and_rate_from_any_mix_of_sizes(
    overhead: float, rate: float, sizes: list[tuple[int, int]]
) -> None:
    """Noiseless prefills of a mix of sizes at least 512 work units apart: the fit predicts
    every size within 3 % of the largest one's time (the ridge towards the prior is weak),
    whatever the true overhead (a prefill of a few tokens no longer puts the overhead into
    the rate). Sizes closer together than the ridge's scale keep more of the prior's
    proportions (the next test)."""
    works = [prefill_work(u, c, PRIORS.context_scale) for u, c in sizes]
    if max(works) - min(works) < 512:
        return
    model = ComputeModel(PRIORS)
    for _ in range(60):
        for (u, c), work in zip(sizes, works, strict=True):
            model.observe_prefill(u, c, overhead + rate * work)
    report = model.report()
    scale = overhead + rate * max(works)
    for (u, c), work in zip(sizes, works, strict=True):
        assert report.prefill_s(u, c, PRIORS.context_scale) == pytest.approx(
            overhead + rate * work, abs=0.03 * scale)


def test_prefill_fit_of_one_size_prices_other_sizes_near_the_prior_shape() -> None:
    """A node that served only warm prefills of a few tokens (30 ms + 200 us a unit, against
    a 4 ms + 80 us prior) predicts that size exactly and prices a cold prompt within a
    factor 2 of the truth (the data cannot tell the shape, the prior's stays roughly), not
    3x over it as when the rate alone was learnt."""
    model = ComputeModel(PRIORS)
    for _ in range(200):
        model.observe_prefill(20, 800, 0.03 + 2e-4 * prefill_work(20, 800, PRIORS.context_scale))
    report = model.report()
    warm = 0.03 + 2e-4 * prefill_work(20, 800, PRIORS.context_scale)
    assert report.prefill_s(20, 800, PRIORS.context_scale) == pytest.approx(warm, rel=1e-3)
    cold_true = 0.03 + 2e-4 * prefill_work(1000, 0, PRIORS.context_scale)
    assert 0.5 * cold_true < report.prefill_s(1000, 0, PRIORS.context_scale) < 2.0 * cold_true


def test_prefill_fit_scales_the_rate_with_the_overhead_when_only_hits_follow_a_burst() -> None:
    """The stale-rate case of the real cluster: prefills of every size on a CPU contended
    2.3x, then only cache hits at full speed. The hits bring a cold prompt's price back
    with them (within 25 % of the truth; least squares kept the burst's rate, 2.3x)."""
    fit = PrefillFit(0.004, 8e-5)
    rng = random.Random(7)
    true = lambda work: 0.03 + 1e-4 * work  # noqa: E731
    for _ in range(60):
        work = rng.choice([50.0, 1500.0, 3000.0])
        fit.observe(work, true(work) * rng.lognormvariate(0, 0.1))
    for _ in range(40):
        work = rng.choice([50.0, 1500.0, 2000.0, 3000.0])
        fit.observe(work, 2.3 * true(work) * rng.lognormvariate(0, 0.1))
    assert fit.overhead + 3000 * fit.rate > 1.8 * true(3000)  # it followed the burst
    for _ in range(30):
        work = rng.choice([40.0, 50.0, 60.0])
        fit.observe(work, true(work) * rng.lognormvariate(0, 0.1))
    assert fit.overhead + 50 * fit.rate == pytest.approx(true(50), rel=0.15)
    assert fit.overhead + 3000 * fit.rate == pytest.approx(true(3000), rel=0.25)


def test_prefill_fit_ignores_nonsense_and_restarts() -> None:
    fit = PrefillFit(0.004, 8e-5)
    for work, seconds in ((0.0, 1.0), (-5.0, 1.0), (100.0, -1.0), (math.nan, 1.0),
                          (100.0, math.inf)):
        fit.observe(work, seconds)
    assert (fit.overhead, fit.rate) == (0.004, 8e-5)
    for _ in range(50):
        fit.observe(100.0, 1.0)  # 1 s for 100 units: much slower than the prior
    assert fit.overhead + 100 * fit.rate == pytest.approx(1.0, rel=1e-3)
    fit.restart(0.01, 1e-4)
    assert (fit.overhead, fit.rate) == (0.01, 1e-4)
    for bad in ({"overhead": -1.0, "rate": 8e-5}, {"overhead": 0.0, "rate": 0.0},
                {"overhead": 0.004, "rate": 8e-5, "noise": 0.0}):
        with pytest.raises(ValueError):
            PrefillFit(**bad)


def test_prefill_fit_never_goes_negative() -> None:
    """Noisy data where larger prefills were measured faster: overhead and rate stay >= 0,
    and a few such pairs after a history of sound ones do not flatten the line (a flat
    line, rate 0, priced a 1,686-token prefill like a hit on the real cluster and drew it
    away from the node holding most of it)."""
    fit = PrefillFit(0.004, 8e-5)
    for _ in range(20):
        fit.observe(10.0, 0.5)
        fit.observe(3000.0, 0.01)
    # the line flattens towards the times' level: the rate is halved, never cut to 0 at once
    # (nor below), and the overhead carries a level between the two measured times
    assert fit.rate > 0 and fit.rate < 8e-5 / 2**30
    for work in (10.0, 3000.0):
        assert 0.01 < fit.overhead + fit.rate * work < 0.5
    fit = PrefillFit(0.004, 8e-5)
    for _ in range(20):
        fit.observe(100.0, 0.001)
        fit.observe(3000.0, 1.0)  # a line through these would cross zero above 0 units
    assert fit.overhead == 0.0 and fit.rate > 0  # the best line through zero instead
    fit = PrefillFit(0.004, 8e-5)
    for _ in range(30):
        for work in (50.0, 1500.0, 3000.0):
            fit.observe(work, 0.03 + 1e-4 * work)
    rate = fit.rate
    for _ in range(3):
        fit.observe(1800.0, 0.1)
        fit.observe(1500.0, 0.3)
    assert fit.rate > 0.5 * rate and 0.01 < fit.overhead < 0.1  # level near the 30 ms


def test_median_speed_is_the_median_prefill_line_not_mixed_fields() -> None:
    """Two nodes that agree on prefills of ~300 units but split them differently (one all
    overhead, one all rate), and a third: the median's times at both reference sizes are the
    medians of theirs (a per-field median would pair a small overhead with a small rate)."""
    speeds = [SpeedReport(0.1, 0.0, 0.007, 0.2), SpeedReport(0.0, 3.3e-4, 0.007, 0.3),
              SpeedReport(0.05, 1.5e-4, 0.009, 0.25)]
    med = median_speed(speeds)
    for i in range(2):
        assert prefill_times(med)[i] == pytest.approx(
            sorted(prefill_times(s)[i] for s in speeds)[1])
    assert med.decode_s_per_token == 0.007 and med.mean_service_s == 0.25
    with pytest.raises(ValueError):
        median_speed([])


def test_rtt_table_first_observation_replaces_prior_then_tracks() -> None:
    rtt = RttTable(PRIORS)
    rtt.observe("a", 0.05)
    assert rtt.get("a") == 0.05 and rtt.measured("a")
    for _ in range(200):
        rtt.observe("a", 0.01)
    assert rtt.get("a") == pytest.approx(0.01)
    rtt.observe("a", -1.0)  # ignored
    assert rtt.get("a") == pytest.approx(0.01)
    rtt.forget("a")
    assert rtt.get("a") == PRIORS.rtt_s


def test_a_peer_never_measured_is_priced_like_the_slowest_link_measured() -> None:
    rtt = RttTable(PRIORS)
    assert not rtt.known and rtt.get("new") == PRIORS.rtt_s  # nothing known: the prior
    rtt.observe("a", 0.5, probe=True)
    rtt.observe("b", 2.0, probe=True)
    assert rtt.known and rtt.get("new") == 2.0 and not rtt.measured("new")
    for _ in range(200):  # the slow link got fast: the next slowest prices the unknown,
        rtt.observe("b", 0.1)  # and b's probe said 20x its forwards: a's probe is scaled too
    assert rtt.get("a") == pytest.approx(0.5 * 0.1 / 2.0)
    assert rtt.get("new") == pytest.approx(0.1)
    rtt.forget("a")
    assert rtt.get("new") == pytest.approx(0.1)
    rtt.forget("b")
    assert not rtt.known and rtt.get("new") == PRIORS.rtt_s


_RTT_OPS = st.lists(st.tuples(st.sampled_from("abcd"), st.floats(-0.1, 3.0), st.booleans(),
                              st.booleans()), max_size=60)


@given(_RTT_OPS)
@settings(max_examples=200, deadline=None)
def test_rtt_table_matches_a_reference_of_its_estimates(ops: list[tuple[str, float, bool,
                                                                         bool]]) -> None:
    """Against a plain reference: each peer's forward EWMA else its probe EWMA, and an
    unmeasured peer at the largest of those (the incremental worst must never go stale)."""
    rtt = RttTable(PRIORS)
    forward: dict[str, Ewma] = {}
    probe: dict[str, Ewma] = {}
    ratio = Ewma(1.0, PRIORS.alpha)  # forward / probe of the peers measured both ways
    for peer, seconds, is_probe, drop in ops:
        if drop:
            rtt.forget(peer)
            forward.pop(peer, None)
            probe.pop(peer, None)
            continue
        rtt.observe(peer, seconds, probe=is_probe)
        table = probe if is_probe else forward
        if seconds >= 0 and not is_probe and peer in probe and probe[peer].value > 0:
            ratio.observe(min(seconds / probe[peer].value, 1.0))
        if seconds >= 0:
            if peer in table:
                table[peer].observe(seconds)
            else:
                table[peer] = Ewma(seconds, PRIORS.alpha)
                table[peer].count = 1
        own = {p: forward[p].value if p in forward else probe[p].value * ratio.value
               for p in {*forward, *probe}}
        for p in "abcd":
            assert rtt.measured(p) == (p in own)
            if p in own:
                assert rtt.get(p) == pytest.approx(own[p])
        expected = max(own.values()) if own else PRIORS.rtt_s
        assert rtt.get("never") == pytest.approx(expected)


def test_prefill_grows_with_context_and_is_zero_when_all_cached() -> None:
    speed = SpeedReport(0.004, 1e-4, 0.007, 0.1)
    assert speed.prefill_s(0, 500, 4096.0) == 0.0
    assert speed.prefill_s(100, 2000, 4096.0) > speed.prefill_s(100, 0, 4096.0)
    assert speed.prefill_s(200, 0, 4096.0) > speed.prefill_s(100, 0, 4096.0)
    assert speed.service_s(10, 0, 5, 4096.0) == pytest.approx(
        speed.prefill_s(10, 0, 4096.0) + 4 * 0.007
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rtt_s": -1.0},
        {"decode_s_per_token": -1.0},
        {"context_scale": 0.0},
        {"alpha": 0.0},
        {"alpha": 1.5},
    ],
)
def test_bad_priors(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        CostPriors(**kwargs)  # type: ignore[arg-type]


def test_rtt_forward_measurements_override_gossip_probes() -> None:
    rtt = RttTable(PRIORS)
    rtt.observe("a", 0.015, probe=True)  # gossip echo: includes encode/apply time
    assert rtt.get("a") == 0.015 and rtt.measured("a")
    rtt.observe("a", 0.003)  # a real forward
    assert rtt.get("a") == 0.003
    rtt.observe("a", 0.020, probe=True)
    assert rtt.get("a") == 0.003
    rtt.forget("a")
    assert rtt.get("a") == PRIORS.rtt_s and not rtt.measured("a")


def test_wait_error_is_the_size_of_recent_residuals_and_fades_when_forwards_stop() -> None:
    err = WaitError(alpha=0.2, window_s=10.0)
    assert err.spread(0.0) == 0.0
    for i in range(200):
        err.observe(0.05 if i % 2 else -0.05, i * 0.01)  # off by 50 ms, either way
    assert err.spread(2.0) == pytest.approx(0.05, rel=0.02)
    assert err.spread(32.0) == pytest.approx(err.spread(2.0) * math.exp(-3), rel=1e-6)
    before = err.spread(32.0)
    err.observe(float("nan"), 32.0)  # ignored
    assert err.spread(32.0) == before
    exact = WaitError(alpha=0.2, window_s=10.0)
    for i in range(50):
        exact.observe(0.0, float(i))  # one request at a time: every prediction right
    assert exact.spread(50.0) == 0.0
    with pytest.raises(ValueError):
        WaitError(alpha=0.0, window_s=1.0)


def test_lateness_is_the_signed_mean_of_recent_residuals_and_fades() -> None:
    late = Lateness(alpha=0.2, window_s=10.0)
    assert late.value(0.0) == 0.0
    for i in range(200):
        late.observe(0.08 if i % 2 else 0.02, i * 0.01)  # 50 ms late on average
    assert late.value(2.0) == pytest.approx(0.05, abs=0.01)
    assert late.value(12.0) == pytest.approx(late.value(2.0) * math.exp(-1), rel=1e-6)
    early = Lateness(alpha=0.5, window_s=10.0)
    for i in range(50):
        early.observe(-0.03, float(i) * 0.01)  # early: a negative correction, unlike WaitError
    assert early.value(0.5) == pytest.approx(-0.03, rel=0.01)
    early.observe(float("inf"), 0.5)  # ignored
    assert early.value(0.5) == pytest.approx(-0.03, rel=0.01)


def test_lateness_median_follows_the_typical_residual_not_the_outliers() -> None:
    """Skewed residuals, as forwards meet them (most on time, a few behind a burst): the
    mean (what ranking adds) is pulled up by the outliers, the median (what the TTFT
    forecast adds) stays with the typical forward; both fade the same way; a constant
    stream is its own median."""
    rng = random.Random(7)
    late = Lateness(alpha=0.2, window_s=10.0)
    assert late.median(0.0) == 0.0
    xs = [0.1 if rng.random() < 0.1 else rng.uniform(0.0, 0.004) for _ in range(2000)]
    means, medians = [], []
    for i, x in enumerate(xs):
        late.observe(x, i * 0.001)
        if i >= 1000:  # after the start: each estimate's typical value
            means.append(late.value(i * 0.001))
            medians.append(late.median(i * 0.001))
    now = len(xs) * 0.001
    assert statistics.mean(means) == pytest.approx(statistics.mean(xs), rel=0.25)  # ~0.012
    assert statistics.median(medians) == pytest.approx(statistics.median(xs), abs=0.001)
    assert late.median(now + 10.0) == pytest.approx(late.median(now) * math.exp(-1), rel=1e-6)
    assert late.both(now + 3.0) == pytest.approx((late.value(now + 3.0), late.median(now + 3.0)))
    flat = Lateness(alpha=0.5, window_s=10.0)
    for i in range(50):
        flat.observe(-0.03, i * 0.01)
    assert flat.median(0.5) == pytest.approx(-0.03, rel=0.01)
    flat.observe(float("nan"), 0.5)  # ignored
    assert flat.median(0.5) == pytest.approx(-0.03, rel=0.01)


def _chain(tokens: list[int], bs: int) -> list[int]:
    """Prefix-chained block ids of ``tokens`` (a block's id names its whole prefix)."""
    return [hash(tuple(tokens[: (i + 1) * bs])) for i in range(len(tokens) // bs)]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 2), min_size=1, max_size=40),
                          st.integers(0, 40)), max_size=30))
def test_queued_blocks_charge_what_no_earlier_queued_prompt_covers(
    steps: list[tuple[bool, list[int], int]],
) -> None:
    """Against a list of the queued prompts: a prompt's uncached tokens are those past both
    its cached prefix and the longest whole-block prefix it shares with a queued prompt."""
    bs = 4
    q = QueuedBlocks(bs)
    queued: list[list[int]] = []
    for remove, tokens, cached in steps:
        if remove and queued:
            q.remove(_chain(queued.pop(0), bs))
            continue
        cached = min(cached, len(tokens))
        shared = max((_common_blocks(tokens, other, bs) for other in queued), default=0)
        want = max(len(tokens) - max(cached, shared * bs), 1)
        assert q.uncached(_chain(tokens, bs), len(tokens), cached) == want
        q.add(_chain(tokens, bs))
        queued.append(tokens)
    for tokens in queued:
        q.remove(_chain(tokens, bs))
    assert len(q) == 0


def _common_blocks(a: list[int], b: list[int], bs: int) -> int:
    n = 0
    while (n + 1) * bs <= min(len(a), len(b)) and a[: (n + 1) * bs] == b[: (n + 1) * bs]:
        n += 1
    return n


def test_one_place_in_a_queue_is_priced_by_its_tokens() -> None:
    speed = SpeedReport(0.004, 1e-4, 0.007, mean_service_s=0.05)
    scale = PRIORS.context_scale
    assert speed.queued_service_s(0, 0, 0, 0, scale) is None  # empty
    assert speed.queued_service_s(3, 0, 0, 48, scale) is None  # tokens not reported
    # a queue of identical requests: each place is that request's predicted service
    one = speed.service_s(1000, 500, 16, scale)
    assert speed.queued_service_s(4, 6000, 4000, 64, scale) == pytest.approx(one)
    # the same requests, all warm, cost a fraction of it; all cold, more
    warm = speed.queued_service_s(4, 6000, 4, 64, scale)
    cold = speed.queued_service_s(4, 6000, 6000, 64, scale)
    assert warm is not None and cold is not None and warm < one < cold
    # more uncached tokens than prompt tokens (a confused shell) are capped at the prompt
    assert speed.queued_service_s(4, 6000, 9000, 64, scale) == cold


def test_a_prompt_is_cached_when_run_as_far_as_its_engine_or_its_queue_holds_it() -> None:
    q = QueuedBlocks(4)
    q.add([1, 2, 3])
    assert q.cached_when_run([1, 2, 9], 20, 0) == 8  # two blocks queued before it
    assert q.cached_when_run([1, 2, 9], 20, 12) == 12  # the engine holds more
    assert q.cached_when_run([1, 2, 3], 12, 0) == 11  # the last token is always computed
    assert q.cached_when_run([7], 20, 30) == 19


def test_queued_blocks_rejects_a_bad_block_size() -> None:
    with pytest.raises(ValueError):
        QueuedBlocks(0)


@given(st.lists(st.tuples(st.booleans(), st.floats(0.0, 8.0)), min_size=1, max_size=12),
       st.floats(0.5, 20.0), st.floats(0.0, 8.0))
@settings(max_examples=150, deadline=None)
def test_utilization_is_the_weighted_busy_time_over_the_span_it_covers(
    steps: list[tuple[bool, float]], window: float, after: float
) -> None:
    """Against a reference that integrates the busy indicator in small steps: weight
    ``exp(-age / window)``, divided by the weight of the time since the node was first busy
    (at least a quarter window), capped at 1; 0 before it was ever busy."""
    u = Utilization(window)
    t, history = 0.0, []  # (start, busy) of each interval
    for busy, dur in steps:
        u.set_busy(busy, t)
        history.append((t, busy))
        t += dur
    now = t + after
    first = next((s for s, b in history if b), None)
    if first is None:
        assert u.value(now) == 0.0
        return
    dt, acc, x = 1e-3, 0.0, 0.0
    bounds = [*(s for s, _ in history[1:]), now]
    for (start, busy), end in zip(history, bounds, strict=True):
        x = start
        while x < end:
            step = min(dt, end - x)
            if busy:
                acc += step * math.exp(-(now - (x + step / 2)) / window)
            x += step
    span = window * (1 - math.exp(-max(now - first, 0.25 * window) / window))
    assert u.value(now) == pytest.approx(min(1.0, acc / span), abs=2e-3)


def test_utilization_counts_the_busy_period_under_way() -> None:
    """A node busy since its first request reads busy while that request runs, not once it
    ends (it was a sum of finished services: 0 while a first 5 s prefill ran)."""
    u = Utilization(10.0)
    assert u.value(0.0) == 0.0
    u.set_busy(True, 100.0)  # after a long idle start
    assert u.value(103.0) == pytest.approx(1.0)
    u.set_busy(False, 103.0)
    assert 0.4 < u.value(106.0) < 0.5  # 3 s busy, then 3 s idle: the recent ones weigh more
    assert u.value(200.0) < 1e-3
    with pytest.raises(ValueError):
        Utilization(0.0)


@given(st.one_of(st.none(), st.floats(0, 100)), st.booleans(), st.floats(0, 200),
       st.floats(0.1, 50))
def test_a_speed_is_stale_if_never_measured_or_idle_and_a_window_old(
    measured_at: float | None, busy: bool, now: float, window: float
) -> None:
    stale = speed_is_stale(measured_at, busy, now, window)
    if measured_at is None:
        assert stale  # the prior: adopted at once, busy or not
    else:
        assert stale == (not busy and now - measured_at >= window)
