"""Pure pieces of the chaos tooling: statistics, reports, convergence predicate."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixmesh.chaos.env import _staleness
from radixmesh.chaos.load import ClientOutcome, summarize
from radixmesh.chaos.report import FaultResult, rss_bytes, to_json, to_markdown
from radixmesh.results.run_summary import percentile


def test_percentile_nearest_rank() -> None:
    assert percentile([], 99) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0
    assert percentile([5.0], 100) == 5.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.0  # the lower middle: never interpolated
    assert percentile([4.0, 1.0, 3.0, 2.0], 0) == 1.0
    with pytest.raises(ValueError, match="q must be in"):
        percentile([1.0], 100.5)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-50, 50), min_size=1, max_size=40), st.floats(0.0, 100.0))
def test_percentile_is_the_smallest_value_with_q_percent_at_or_below(
    ints: list[int], q: float
) -> None:
    values = [float(v) for v in ints]
    got = percentile(values, q)
    at_or_below = sum(1 for v in values if v <= got)
    assert got in values and at_or_below * 100.0 >= q * len(values) - 1e-9
    below = sum(1 for v in values if v < got)  # any smaller observed value covers too little
    assert below == 0 or below * 100.0 < q * len(values) + 1e-9


def test_summarize_counts_failures_and_routes() -> None:
    ok = ClientOutcome("a", "u", 200, None, 0.1, 0.0, text="x", route="local")
    bad = ClientOutcome("b", "u", 500, "HTTP 500", 0.2, 0.0, route="forwarded")
    lost = ClientOutcome("c", "u", None, "ConnectError", 0.3, 0.0)
    s = summarize([ok, bad, lost])
    assert s["requests"] == 3 and s["failures"] == 2 and s["p50_s"] == 0.1
    assert s["routes"] == {"local": 1, "forwarded": 1, "none": 1}
    assert ok.ok and not bad.ok and not lost.ok


def test_fault_result_checks() -> None:
    r = FaultResult("f", requests=3)
    r.check(True, "fine")
    r.check(False, "slow", timing=True)
    assert r.functional_ok and not r.passed and r.failed_checks() == ["slow"]
    r.check(False, "broken | pipe")
    assert not r.functional_ok
    doc = json.loads(to_json([r]))["faults"][0]
    assert doc["fault"] == "f" and "FAILED: slow" in doc["notes"]
    assert "broken \\| pipe" in to_markdown([r])


def test_rss_of_this_process() -> None:
    rss = rss_bytes(os.getpid())
    assert rss is not None and rss > 10 * 2**20
    assert rss_bytes(2**22 + 12345) is None  # no such process


def test_staleness_predicate() -> None:
    truth = {"incarnation": 5, "version": 9}
    entry = {"state": "alive", "incarnation": 5, "view_version": 9}
    assert _staleness(entry, truth) is None
    assert _staleness(None, truth) == "unknown"
    assert _staleness({**entry, "state": "suspect"}, truth) == "state suspect"
    assert _staleness({**entry, "incarnation": 4}, truth) == "old incarnation"
    assert _staleness({**entry, "view_version": 8}, truth) == "version 8 != 9"


def test_operate_latency_splits_by_status_and_reads_server_time() -> None:
    from radixmesh.chaos.operate import _latency

    ok = [ClientOutcome(str(i), "u", 200, None, 0.1 * (i + 1), 0.0, server_s=0.05 * (i + 1))
          for i in range(10)]
    rejected = ClientOutcome("r", "u", 429, "HTTP 429: full", 0.01, 0.0)
    lost = ClientOutcome("l", "u", None, "ReadError", 5.0, 0.0)
    stats = _latency([*ok, rejected, lost])
    assert stats["n"] == 10 and stats["p50_s"] == 0.5 and stats["max_s"] == 1.0
    assert stats["server_p99_s"] == 0.5
    assert _latency([*ok, rejected], 429) == {"n": 1.0, "p50_s": 0.01, "p99_s": 0.01,
                                               "max_s": 0.01}


def test_chaos_config_extra_options_override_the_base() -> None:
    from radixmesh.chaos.env import ChaosConfig
    from radixmesh.chaos.operate import OperateConfig, with_extra

    cfg = ChaosConfig(serve=(("max_queue_wait", "5s"), ("policy", "cost")))
    options = cfg.options()
    assert options["max_queue_wait"] == "5s" and options["policy"] == "cost"
    assert options["gossip_interval"] == 0.2
    assert cfg.node().max_queue_wait == 5.0 and cfg.node().policy == "cost"
    assert ChaosConfig(serve=(("seed", "7"),)).seed == 7  # read back as serve reads it
    with pytest.raises(ValueError, match="no_such_option"):
        ChaosConfig(serve=(("no_such_option", 1),))
    op = with_extra(OperateConfig(extra=(("a", 1),)), {"b": 2, "a": 3})
    assert dict(op.extra) == {"a": 3, "b": 2}
