"""/metrics through prometheus_client: types, names, one series per value, one registry per node."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixmesh.core import node as core_node
from radixmesh.runtime.config import ServeConfig
from radixmesh.runtime.metrics import (
    CORE_DUPLICATES,
    CORE_GAUGES,
    RUNTIME_GAUGES,
    RuntimeMetrics,
    render,
)
from radixmesh.runtime.node import NodeService

# NodeCore.metrics() counters kept outside core.node._COUNTERS (the lifecycle's own).
LIFECYCLE_COUNTERS = {"forwards_unknown_peer", "lifecycle_stale_events", "requests_cancelled",
                      "requests_failed"}
COUNTER_PREFIXES = ("admission_full_", "placement_")  # per bound / per placement tag


def families(text: str) -> dict[str, Any]:
    out = {}
    for fam in text_string_to_metric_families(text):
        assert fam.name not in out, f"{fam.name} exported twice"
        out[fam.name] = fam
    return out


def series(text: str) -> Counter[tuple[str, tuple[tuple[str, str], ...]]]:
    return Counter((s.name, tuple(sorted(s.labels.items())))
                   for fam in text_string_to_metric_families(text) for s in fam.samples)


def test_types_follow_the_prometheus_conventions() -> None:
    m = RuntimeMetrics()
    m.requests["forwarded"] += 2
    m.forward_failures["connect"] += 1
    m.forward_overhead_s_sum, m.forward_overhead_count = 0.5, 2
    parts = {"queue_depth": 3.0, "netem_dropped_loss": 4.0, "peer_auth_enabled": 1.0,
             "peer_auth_rejected_replayed": 1.0, "peer_auth_rejected_total": 1.0}
    core = {"gossip_bytes_out": 10.0, "view_peers": 2.0, "queue_depth": 3.0,
            "peers_alive": 1.0, "requests_local": 5.0}
    text = render(m, parts, core, {"b": "suspect"}, "a")
    fams = families(text)
    assert fams["radixmesh_requests"].type == "counter"
    [fwd] = [s for s in fams["radixmesh_requests"].samples if s.labels == {"route": "forwarded"}]
    assert fwd.name == "radixmesh_requests_total" and fwd.value == 2
    assert fams["radixmesh_queue_depth"].type == "gauge"
    assert fams["radixmesh_netem_dropped_loss"].type == "counter"
    assert "radixmesh_netem_dropped_loss_total 4.0" in text
    assert fams["radixmesh_peer_auth_enabled"].type == "gauge"
    assert "radixmesh_peer_auth_rejected_replayed_total 1.0" in text
    assert "radixmesh_peer_auth_rejected_total 1.0" in text
    assert fams["radixmesh_core_gossip_bytes_out"].type == "counter"
    assert "radixmesh_core_gossip_bytes_out_total 10.0" in text
    assert fams["radixmesh_core_view_peers"].type == "gauge"
    assert fams["radixmesh_forward_overhead_seconds"].type == "summary"
    assert 'radixmesh_peers{state="suspect"} 1.0' in text
    # what the runtime already exports is not exported a second time from the core
    for dup in ("queue_depth", "peers_alive", "requests_local"):
        assert f"radixmesh_core_{dup}" not in text
    assert all(n == 1 for n in series(text).values())
    for fam in fams.values():  # counters' samples all end in _total
        if fam.type == "counter":
            assert all(s.name.endswith("_total") for s in fam.samples), fam.name


def test_histograms_count_what_is_observed() -> None:
    m = RuntimeMetrics()
    m.observe_engine(queue_s=0.01, prefill_s=0.02, prompt_tokens=100, cached_tokens=64)
    m.observe_engine(queue_s=0.0, prefill_s=0.5, prompt_tokens=10, cached_tokens=50)  # clamped
    m.observe_request("forwarded", "done", 0.3)
    m.observe_forward("accepted", 0.002)
    m.observe_forward("busy", 0.001)
    fams = families(render(m, {}, {}, {}, "a"))
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for fam in fams.values() for s in fam.samples}
    assert fams["radixmesh_time_to_first_token_seconds"].type == "histogram"
    assert values[("radixmesh_time_to_first_token_seconds_count", ())] == 2
    assert values[("radixmesh_time_to_first_token_seconds_sum", ())] == pytest.approx(0.53)
    assert values[("radixmesh_queue_seconds_sum", ())] == pytest.approx(0.01)
    assert values[("radixmesh_prefill_tokens_sum", (("kind", "cached"),))] == 64 + 10
    assert values[("radixmesh_prefill_tokens_sum", (("kind", "uncached"),))] == 36 + 0
    assert values[("radixmesh_prefill_tokens_bucket", (("kind", "cached"), ("le", "64.0")))] == 2
    key = ("radixmesh_request_duration_seconds_count",
           (("outcome", "done"), ("route", "forwarded")))
    assert values[key] == 1
    assert values[("radixmesh_forward_offer_seconds_count", (("outcome", "busy"),))] == 1


def test_each_node_has_its_own_registry(engine: Any) -> None:
    """Two nodes in one process: separate series, nothing in prometheus_client's global
    registry, and every core metric classified (a new core gauge must be named here)."""
    a = NodeService(ServeConfig(node_id="a", port=18991), engine)
    b = NodeService(ServeConfig(node_id="b", port=18992), engine)
    a.metrics.observe_request("local", "done", 0.1)
    text_a, text_b = a.prometheus(), b.prometheus()
    assert 'radixmesh_node_info{node_id="a"} 1.0' in text_a
    assert "radixmesh_request_duration_seconds_count" in text_a
    assert "radixmesh_request_duration_seconds_count" not in text_b
    assert a.metrics.registry is not b.metrics.registry
    from prometheus_client import REGISTRY
    assert not any(n.startswith("radixmesh") for n in REGISTRY._names_to_collectors)
    for text in (text_a, text_b):
        fams = families(text)
        assert all(n == 1 for n in series(text).values())
        for fam in fams.values():
            if fam.type == "counter":
                assert all(s.name.endswith("_total") for s in fam.samples), fam.name
    core = a.core.metrics()
    known = set(core_node._COUNTERS) | LIFECYCLE_COUNTERS | CORE_GAUGES | CORE_DUPLICATES
    unclassified = {n for n in core if n not in known and not n.startswith(COUNTER_PREFIXES)}
    assert not unclassified, f"classify these in runtime/metrics.py: {sorted(unclassified)}"
    assert not CORE_GAUGES & set(core_node._COUNTERS)
    assert {"queue_depth", "inflight", "cache_tokens"} <= RUNTIME_GAUGES
