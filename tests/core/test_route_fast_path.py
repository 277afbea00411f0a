"""The router's hot path computes each prediction once: it must equal the plain definitions.

``cost_model.priced`` (one node's wait, prefill, service and mesh cost, each evaluated once),
``robust_speeds`` (copies only the nodes whose speed snaps), ``with_cached`` (a NodeInfo copy
without ``dataclasses.replace``) and ``estimators._median`` are checked against the simple
reference each replaced: ``predict_*`` and the mesh cost's formula, ``replace`` on every node,
``statistics.median``. Exact equality: the fast path may not move a decision by one ulp.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from radixmesh.core.cost_model import (
    NodeInfo,
    RouteInput,
    batch_externality,
    candidate,
    median_speed,
    predict_latency,
    predict_prefill,
    predict_service,
    predict_ttft,
    predict_wait,
    prefill_times,
    priced,
    robust_speeds,
    with_cached,
)
from radixmesh.core.estimators import SpeedReport, _median
from radixmesh.core.shadow_state import BatchState

SCALE = 4096.0

speed_st = st.builds(
    SpeedReport,
    st.floats(0, 0.05),
    st.floats(1e-7, 1e-3),
    st.floats(1e-4, 0.05),
    st.floats(0.001, 1.0),
)
batch_st = st.builds(
    BatchState,
    st.just(0.005), st.floats(1e-6, 1e-4), st.floats(0, 1e-8), st.floats(0, 1e-3),
    st.floats(0, 1e-6), st.just(8192), st.just(64), st.just(100_000), st.integers(0, 20),
    st.integers(0, 5), st.integers(0, 10), st.integers(0, 20_000), st.integers(0, 9_000),
    st.integers(0, 20_000), st.floats(0, 0.2), st.floats(0, 0.02), st.floats(0, 0.1),
    st.floats(0, 50),
)  # fmt: skip


@st.composite
def node_st(draw: st.DrawFn, is_self: bool = False) -> NodeInfo:
    return NodeInfo(
        "self" if is_self else draw(st.sampled_from(["a", "b", "c", "d"])),
        is_self,
        draw(st.integers(0, 5_000)),
        0.0 if is_self else draw(st.floats(0, 0.1)),
        draw(st.one_of(st.integers(0, 8), st.floats(0, 8))),
        draw(speed_st),
        utilization=draw(st.floats(0, 1)),
        queue_service_s=draw(st.one_of(st.none(), st.floats(0.001, 0.5))) if is_self else None,
        batch=draw(st.one_of(st.none(), batch_st)),
        lateness_s=0.0 if is_self else draw(st.floats(-0.05, 0.05)),
        lateness_median_s=0.0 if is_self else draw(st.floats(-0.05, 0.05)),
    )


req_st = st.builds(RouteInput, st.integers(1, 8_000), st.integers(1, 256))


def reference_cost(req: RouteInput, n: NodeInfo) -> float:
    """The mesh cost as written before the hot path (``cost_model.mesh_cost``'s docstring)."""
    service = predict_service(req, n, SCALE)
    if n.batch is not None:
        return predict_latency(req, n, SCALE) + batch_externality(req, n, SCALE)
    mean = n.speed.mean_service_s
    arrivals = n.utilization / mean if mean > 0.0 else 0.0
    latency = (0.0 if n.is_self else n.rtt_s) + predict_wait(n) + service
    return latency + service * n.queue_depth + arrivals * service * service / 2.0


@settings(max_examples=300, deadline=None)
@given(req_st, st.booleans().flatmap(node_st))
def test_priced_is_the_plain_predictions(req: RouteInput, n: NodeInfo) -> None:
    p = priced(req, n, SCALE)
    assert p.cost_s == reference_cost(req, n)
    assert p.ahead_s + p.service_s == predict_latency(req, n, SCALE)
    assert p.ahead_s + p.prefill_s == predict_ttft(req, n, SCALE)
    assert p.prefill_s == predict_prefill(req, n, SCALE)
    c = candidate(req, n, SCALE)
    assert c.predicted_latency_s == predict_latency(req, n, SCALE)
    # the TTFT forecast: the same wait corrected by the lateness's median, not its mean
    forecast = replace(n, lateness_s=n.lateness_median_s)
    assert c.ttft_s == pytest.approx(predict_ttft(req, forecast, SCALE), rel=1e-12, abs=1e-15)
    rtt = 0.0 if n.is_self else n.rtt_s
    assert c.wait_s == (rtt + predict_wait(n)) - rtt  # as before: the sum's own rounding


def reference_snapped(speed: SpeedReport, median: SpeedReport, tol: float) -> SpeedReport:
    mine, mids = prefill_times(speed), prefill_times(median)
    if all(m / tol <= t <= m * tol for t, m in zip(mine, mids, strict=True)):
        speed = replace(speed, prefill_overhead_s=median.prefill_overhead_s,
                        prefill_s_per_token=median.prefill_s_per_token)  # fmt: skip
    mid = median.decode_s_per_token
    if mid / tol <= speed.decode_s_per_token <= mid * tol:
        speed = replace(speed, decode_s_per_token=mid)
    return speed


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.booleans().flatmap(node_st), min_size=1, max_size=8),
    st.sampled_from([1.0, 1.1, 1.5, 3.0]),
    st.booleans(),
)
def test_robust_speeds_is_replace_on_every_node(
    nodes: list[NodeInfo], tol: float, shared: bool
) -> None:
    if shared:  # peers sharing one report object (the memo by id must not mix them up)
        nodes = [replace(n, speed=nodes[0].speed) for n in nodes]
    median = median_speed([n.speed for n in nodes])
    want = [replace(n, speed=reference_snapped(n.speed, median, tol)) for n in nodes]
    got = robust_speeds(nodes, tol)
    assert got == want or len(nodes) < 2
    assert all(g is n for g, n, w in zip(got, nodes, want, strict=True) if w == n)


@given(st.booleans().flatmap(node_st), st.integers(0, 10_000))
def test_with_cached_is_replace(n: NodeInfo, tokens: int) -> None:
    assert with_cached(n, tokens) == replace(n, cached_tokens=tokens)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=9))
def test_median_is_statistics_median(values: list[float]) -> None:
    assert _median(list(values)) == statistics.median(values)


def test_equal_speeds_are_their_own_median_and_are_not_copied() -> None:
    # The median's prefill line rebuilt from its reference times came out 0.003999999999999999
    # for a line of 0.004: every node was then "snapped" to it and copied on every decision
    # (robust_speeds 20.5 -> 8.6 us for four nodes sharing one report)
    speed = SpeedReport(0.004, 8e-05, 0.007, 0.02448)
    twin = SpeedReport(0.004, 8e-05, 0.007, 0.02448)  # equal, another object (a peer's)
    median = median_speed([speed, twin, speed, twin])
    assert (median.prefill_overhead_s, median.prefill_s_per_token) == (0.004, 8e-05)
    nodes = [NodeInfo("self", True, 0, 0.0, 2, speed)] + [
        NodeInfo(f"n{i}", False, 64, 0.002, 1, twin if i % 2 else speed) for i in range(3)]
    assert all(got is n for got, n in zip(robust_speeds(nodes, 1.5), nodes, strict=True))
