"""A node's arrival rate (``load_estimates.ArrivalRate``): against a brute-force sum over the
arrival times, a steady stream read as its rate from its first seconds, one arrival not read as
a stream, and the shadow's and the simulator's batch reports carrying it."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
from hypothesis import given

from radixmesh.core.load_estimates import ArrivalRate
from radixmesh.core.profile import resolve
from radixmesh.core.shadow import RATE_MIN_SPAN, RATE_WINDOW_S, Shadow


def reference(arrivals: list[float], now: float, window: float, min_span: float) -> float:
    """Each arrival weighs exp(-age / window), summed, over the time such a sum covers since
    the first arrival (at least ``min_span`` windows)."""
    if not arrivals:
        return 0.0
    weight = sum(math.exp(-(now - t) / window) for t in arrivals)
    span = max(now - arrivals[0], min_span * window)
    return weight / (window * (1.0 - math.exp(-span / window)))


@given(gaps=st.lists(st.floats(0.0, 30.0), max_size=40), after=st.floats(0.0, 100.0),
       window=st.floats(0.1, 100.0), min_span=st.floats(1e-3, 1.0), start=st.floats(0.0, 1e4))
def test_the_rate_is_the_decayed_count_over_the_span_it_covers(
        gaps: list[float], after: float, window: float, min_span: float, start: float) -> None:
    rate = ArrivalRate(window, min_span)
    arrivals: list[float] = []
    t = start
    for gap in gaps:
        t += gap
        rate.add(t)
        arrivals.append(t)
        assert rate.at(t) == pytest.approx(reference(arrivals, t, window, min_span), rel=1e-9)
    now = t + after
    assert rate.at(now) == pytest.approx(reference(arrivals, now, window, min_span), rel=1e-9,
                                         abs=1e-300)


@pytest.mark.parametrize("r", [0.5, 2.0, 20.0, 200.0])
def test_a_steady_stream_reads_as_its_rate_from_its_first_seconds(r: float) -> None:
    """Read between arrivals (at an arrival the newest counts whole): within 10 % once six
    arrivals are in and the floor (0.1 s) is past, within 5 % from the first window on. Over
    the window instead of the span, the first second read a tenth of the rate."""
    window = RATE_WINDOW_S
    rate = ArrivalRate(window, RATE_MIN_SPAN)
    for k in range(int(4 * window * r)):
        rate.add(k / r)
        mid = (k + 0.5) / r
        if k >= 5 and mid >= RATE_MIN_SPAN * window:
            assert rate.at(mid) == pytest.approx(r, rel=0.1), (k, mid)
        if mid >= window:
            assert rate.at(mid) == pytest.approx(r, rel=0.05), (k, mid)


@given(window=st.floats(0.1, 100.0), min_span=st.floats(1e-3, 1.0),
       later=st.lists(st.floats(0.0, 1e3), min_size=1, max_size=20))
def test_one_arrival_reads_as_at_most_one_per_second_elapsed(
        window: float, min_span: float, later: list[float]) -> None:
    """Not as a steady stream: nothing before it, its first reading bounded by the floor
    (``min_span`` windows), and from there on t seconds after it at most 1 / t."""
    rate = ArrivalRate(window, min_span)
    assert rate.at(5.0) == 0.0
    rate.add(5.0)
    first = rate.at(5.0)
    assert first == pytest.approx(1.0 / (window * -math.expm1(-min_span)))
    for dt in later:
        assert rate.at(5.0 + dt) <= first
        if dt >= min_span * window:
            assert rate.at(5.0 + dt) * dt <= 1.0 + 1e-9


def test_an_idle_node_reads_a_falling_rate() -> None:
    rate = ArrivalRate(10.0, 0.01)
    for k in range(100):
        rate.add(k * 0.1)  # 10 per second for 10 s, then nothing
    readings = [rate.at(10.0 + 5.0 * j) for j in range(6)]
    assert readings == sorted(readings, reverse=True)
    assert readings[-1] < 0.1 * readings[0]


@pytest.mark.parametrize("window,min_span", [(0.0, 0.01), (-1.0, 0.01), (10.0, 0.0),
                                             (10.0, math.nan), (math.nan, 0.01)])
def test_a_bad_window_or_floor_is_refused(window: float, min_span: float) -> None:
    with pytest.raises(ValueError, match="window_s and min_span"):
        ArrivalRate(window, min_span)


def test_the_shadows_report_carries_the_rate_decayed_to_its_time() -> None:
    """The state is cached until a change, but its rate is read at the state's time (as the
    simulator's reports are): an engine that stopped taking requests reports a falling rate."""
    profile = resolve("h100-llama3-8b")
    shadow = Shadow(profile, time_scale=2.0)
    ref = ArrivalRate(RATE_WINDOW_S * 2.0, RATE_MIN_SPAN)
    assert shadow.state(0.0).rate == 0.0
    for k in range(20):
        shadow.add(k, [k + 1] * 64, 4, now=k * 0.5)
        ref.add(k * 0.5)
    for now in (9.5, 10.0, 30.0, 200.0):
        assert shadow.state(now).rate == pytest.approx(ref.at(now), rel=1e-12)
    assert shadow.state(200.0).rate < 0.05 * shadow.state(9.5).rate
