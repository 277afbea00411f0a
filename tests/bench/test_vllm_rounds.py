"""``vllm_check --rounds N`` (bench/vllm_rounds.py): alternated policy orders, request pairs,
the paired ratios with their bootstrap intervals; and the client errors by reason."""

from __future__ import annotations

import random

import pytest

from radixmesh.bench.vllm_replay import error_reasons
from radixmesh.bench.vllm_rounds import (
    paired_figures,
    paired_line,
    pairs,
    quantile_ratio_interval,
    round_orders,
)
from radixmesh.results.records import Record


def rec(seq: int, latency: float, error: str | None = None, status: int = 200) -> Record:
    r = Record("vllm-check", "p", seq, f"q{seq}", "g", 0, "n0", 0.0)
    r.latency_s, r.error, r.status = latency, error, status
    return r


def test_rounds_alternate_the_order() -> None:
    assert round_orders(["cost", "none"], 3) == [["cost", "none"], ["none", "cost"],
                                                 ["cost", "none"]]
    with pytest.raises(ValueError):
        round_orders(["cost"], 0)


def test_pairs_are_per_request_and_round_and_skip_failures() -> None:
    a = [[rec(1, 2.0), rec(0, 1.0)], [rec(0, 3.0), rec(1, 4.0, "HTTP 429", 429)]]
    b = [[rec(0, 10.0), rec(1, 20.0)], [rec(0, 30.0), rec(1, 40.0)]]
    assert pairs(a, b) == [(1.0, 10.0), (2.0, 20.0), (3.0, 30.0)]


def test_a_policy_faster_by_a_fifth_reads_0_8_with_an_interval_around_it() -> None:
    rng = random.Random(1)
    b = [[rec(i, rng.uniform(0.5, 3.0)) for i in range(100)] for _ in range(3)]
    a = [[rec(r.seq, 0.8 * r.latency_s * rng.uniform(0.9, 1.1)) for r in rs] for rs in b]
    fig = paired_figures(a, b)
    assert fig["pairs"] == 300
    assert fig["mean_ratio"] == pytest.approx(0.8, abs=0.03)
    lo, hi = fig["mean_interval"]
    assert lo <= fig["mean_ratio"] <= hi and hi < 0.9
    lo99, hi99 = fig["p99_interval"]
    assert lo99 <= fig["p99_ratio"] <= hi99 and lo99 > 0.6 and hi99 < 1.0
    line = paired_line("cost@4", "none", fig)
    assert line.startswith("- paired cost@4 / none over 300 requests: mean 0.8")


def test_quantile_interval_needs_two_pairs() -> None:
    assert quantile_ratio_interval([(1.0, 2.0)], 99) is None
    assert paired_figures([[rec(0, 1.0, "x", 500)]], [[rec(0, 1.0)]]) == {"pairs": 0}


def test_client_errors_are_counted_by_status_and_code() -> None:
    body = ("HTTP 429: b'{\"error\":{\"message\":\"The mesh is overloaded\","
            "\"type\":\"rate_limit_error\",\"param\":null,\"code\":\"overloaded\"}}'")
    recs = [rec(0, 1.0), rec(1, 0.1, body, 429), rec(2, 0.1, body, 429),
            rec(3, 0.1, "ReadTimeout: timed out", None)]  # type: ignore[arg-type]
    assert error_reasons(recs) == {"HTTP 429 overloaded": 2, "ReadTimeout": 1}
