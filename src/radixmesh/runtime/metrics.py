"""The node's metrics, exposed through ``prometheus_client`` (text format 0.0.4).

Each :class:`RuntimeMetrics` owns its own ``CollectorRegistry`` (several nodes run in one
process in tests and in ``radixmesh cluster``; the library's global default registry is never
used). It holds two kinds of things:

* plain counters the runtime bumps on its hot paths (``m.requests[route] += 1``, ...), read at
  scrape time by a collector that gives each its Prometheus type (counters end in ``_total``);
* ``prometheus_client`` histograms, observed once per request or forward
  (:meth:`RuntimeMetrics.observe_engine`, :meth:`~RuntimeMetrics.observe_request`,
  :meth:`~RuntimeMetrics.observe_forward`).

:func:`render` adds what only the node knows at scrape time: its gauges and the counters of
its parts (``peer_auth_*``, ``peer_tls_*``, ``netem_*``, ``kv_events_*``), the core's
``NodeCore.metrics()`` as ``radixmesh_core_<name>`` (counters ``..._total``), and peer states.
A value the core and the runtime both report (queue depth, incarnation, peers by state,
requests by route, rejected requests) is exported once, under the runtime's name. The names
are listed in docs/modules.md ("Metrics").
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.parser import text_string_to_metric_families

PREFIX = "radixmesh_"
ROUTES = ("local", "forwarded", "fallback")

# Latency buckets (seconds): a tiny CPU model answers in milliseconds, a real one in seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0, float("inf"))
# Token-count buckets: powers of two up to a long prompt.
TOKEN_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                 32768, 65536, 131072, float("inf"))

# In the flat dict of the node's parts, the names that are levels, not counts (all others
# are counters: they only grow).
RUNTIME_GAUGES = frozenset({
    "queue_depth", "inflight", "cache_tokens", "cache_budget_tokens", "cache_locked_tokens",
    "incarnation", "peer_auth_enabled", "peer_auth_replay_cache_size", "peer_tls_enabled",
    "kv_events_connected", "kv_index_blocks", "engine_launch_running", "peer_links_open",
    "engine_up", "engine_foreign_running", "engine_foreign_waiting",
})
# The same for NodeCore.metrics(): its levels; everything else there is a counter.
CORE_GAUGES = frozenset({
    "peers_routable", "view_peers", "view_entries", "summary_version", "summary_blocks",
    "leaving", "engine_down", "requests_in_flight",
})
# NodeCore.metrics() names the runtime already exports under its own name (not twice).
CORE_DUPLICATES = frozenset({
    "queue_depth",  # radixmesh_queue_depth
    "incarnation",  # radixmesh_incarnation
    "peers_alive", "peers_suspect", "peers_dead",  # radixmesh_peers{state}
    "requests_local", "requests_forwarded", "requests_fallback",  # radixmesh_requests_total
    "requests_rejected",  # radixmesh_rejected_requests_total
})

_NAME_RE = re.compile(r"[^a-zA-Z0-9_]")


def _sanitize(name: str) -> str:
    return _NAME_RE.sub("_", name)


@dataclass
class RuntimeMetrics:
    requests: Counter[str] = field(default_factory=Counter)  # by route: local|forwarded|fallback
    served_for_peers: int = 0  # forwarded requests this node executed for others
    refused_for_peers: int = 0  # forwarded requests refused as busy (at the push-back threshold)
    client_errors: Counter[int] = field(default_factory=Counter)  # by HTTP status
    prompt_tokens: int = 0  # prompt tokens executed on this node's engine
    cached_tokens: int = 0  # of which reused from the KV cache (cache hit tokens)
    completion_tokens: int = 0  # generated here, including by requests cancelled midway
    cancelled: int = 0  # engine requests stopped because their client went away
    client_disconnects: int = 0  # non-streaming clients that went away before their answer
    rejected: int = 0  # client requests answered 429: full here and no peer took them
    engine_retries: int = 0  # client requests routed again: the engine died before a token
    forwards_rejected: int = 0  # peers' forwards refused as malformed (400), never executed
    forward_attempts: int = 0
    forward_failures: Counter[str] = field(default_factory=Counter)  # by reason
    forward_overhead_s_sum: float = 0.0  # RequestDone.forward_overhead_s, summed
    forward_overhead_count: int = 0
    gossip_in_messages: int = 0
    gossip_in_bytes: int = 0
    gossip_out_messages: int = 0
    gossip_out_bytes: int = 0
    gossip_send_failures: int = 0
    gossip_oversize: int = 0  # gossip bodies refused before decoding (too large)
    peer_state_changes: Counter[str] = field(default_factory=Counter)  # by new state
    core_errors: int = 0  # exceptions escaping NodeCore.handle (a bug; never expected)
    registry: CollectorRegistry = field(default_factory=CollectorRegistry, repr=False,
                                        compare=False)

    def __post_init__(self) -> None:
        def hist(name: str, help_: str, labels: tuple[str, ...],
                 buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, help_, labels, registry=self.registry,
                             buckets=buckets)

        self.request_seconds = hist(
            "request_duration_seconds",
            "Client requests from arrival at this node to their end (done, error or cancelled),"
            " by route and outcome.", ("route", "outcome"), LATENCY_BUCKETS)
        self.ttft_seconds = hist(
            "time_to_first_token_seconds",
            "Requests run on this engine: queue time plus prefill, the time to their first "
            "token.", (), LATENCY_BUCKETS)
        self.queue_seconds = hist(
            "queue_seconds", "Requests run on this engine: time admitted but not started.",
            (), LATENCY_BUCKETS)
        self.prefill_tokens = hist(
            "prefill_tokens", "Prompt tokens per request run on this engine, by whether their "
            "KV was reused from the cache (cached) or computed (uncached).", ("kind",),
            TOKEN_BUCKETS)
        self.forward_seconds = hist(
            "forward_offer_seconds", "Forwards offered to a peer, from the offer to its first "
            "reply, by outcome (accepted, busy, or the failure reason).", ("outcome",),
            LATENCY_BUCKETS)

    # ------------------------------------------------------------------ observations
    def observe_engine(self, queue_s: float, prefill_s: float, prompt_tokens: int,
                       cached_tokens: int) -> None:
        """One request finished on this node's engine (``GenerateResult``'s figures)."""
        cached = max(0, min(cached_tokens, prompt_tokens))
        self.queue_seconds.observe(max(queue_s, 0.0))
        self.ttft_seconds.observe(max(queue_s, 0.0) + max(prefill_s, 0.0))
        self.prefill_tokens.labels("cached").observe(cached)
        self.prefill_tokens.labels("uncached").observe(prompt_tokens - cached)

    def observe_request(self, route: str, outcome: str, seconds: float) -> None:
        """A client request ended here: ``outcome`` done | error | cancelled."""
        self.request_seconds.labels(route, outcome).observe(max(seconds, 0.0))

    def observe_forward(self, outcome: str, seconds: float) -> None:
        """A forward's first reply (``accepted``, ``busy``) or its failure reason."""
        self.forward_seconds.labels(outcome).observe(max(seconds, 0.0))


# ------------------------------------------------------------------------- collectors
def _counter(name: str, help_: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + _sanitize(name), help_, value=value)


def _labelled(name: str, help_: str, label: str,
              samples: Mapping[Any, float]) -> CounterMetricFamily:
    fam = CounterMetricFamily(PREFIX + name, help_, labels=[label])
    for key, value in samples.items():
        fam.add_metric([str(key)], value)
    return fam


def _gauge(name: str, help_: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + _sanitize(name), help_, value=value)


_RUNTIME_COUNTERS: tuple[tuple[str, str, str], ...] = (
    # (exported name, RuntimeMetrics field, help)
    ("served_for_peers", "served_for_peers", "Forwarded requests executed here for other nodes."),
    ("refused_for_peers", "refused_for_peers",
     "Forwarded requests refused as busy (queue at the push-back threshold)."),
    ("prompt_tokens", "prompt_tokens", "Prompt tokens run on this engine."),
    ("cache_hit_tokens", "cached_tokens",
     "Prompt tokens whose KV was reused from this node's cache."),
    ("completion_tokens", "completion_tokens", "Tokens generated here."),
    ("cancelled_requests", "cancelled",
     "Engine requests stopped because their client went away."),
    ("rejected_requests", "rejected",
     "Client requests answered 429: this node full and no peer took them."),
    ("client_disconnects", "client_disconnects",
     "Non-streaming clients that went away before their answer."),
    ("engine_retries", "engine_retries",
     "Client requests routed again: the engine died before their first token."),
    ("forwards_rejected", "forwards_rejected",
     "Peers' forwards refused as malformed, never executed."),
    ("forward_attempts", "forward_attempts", "Forwards started."),
    ("gossip_in_messages", "gossip_in_messages", "Gossip messages received (before validation)."),
    ("gossip_in_bytes", "gossip_in_bytes", "Gossip bytes received."),
    ("gossip_out_messages", "gossip_out_messages", "Gossip messages sent."),
    ("gossip_out_bytes", "gossip_out_bytes", "Gossip bytes sent."),
    ("gossip_send_failures", "gossip_send_failures", "Gossip pushes that failed."),
    ("gossip_oversize", "gossip_oversize", "Gossip bodies refused as too large."),
    ("core_errors", "core_errors", "Internal errors in the core (bugs)."),
)


def _runtime_families(m: RuntimeMetrics) -> Iterator[Metric]:
    yield _labelled("requests", "Client requests by route taken.", "route",
                    {r: m.requests[r] for r in (*ROUTES, *sorted(set(m.requests) - set(ROUTES)))})
    yield _labelled("client_errors", "Client requests answered with an error, by HTTP status.",
                    "status", dict(sorted(m.client_errors.items())))
    yield _labelled("forward_failures", "Forwards that failed, by reason.", "reason",
                    dict(sorted(m.forward_failures.items())))
    yield _labelled("peer_state_changes", "Peer membership transitions, by new state.",
                    "state", dict(sorted(m.peer_state_changes.items())))
    for name, attr, help_ in _RUNTIME_COUNTERS:
        yield _counter(name, help_, float(getattr(m, attr)))
    yield SummaryMetricFamily(
        PREFIX + "forward_overhead_seconds",
        "Forward overheads of successful forwards (client time minus remote handling).",
        count_value=m.forward_overhead_count, sum_value=m.forward_overhead_s_sum)


def _part_families(gauges: Mapping[str, float]) -> Iterator[Metric]:
    """The flat dict of the node's parts: levels as gauges, counts as ``<name>_total``."""
    for name, value in sorted(gauges.items()):
        words = name.replace("_", " ")
        if name in RUNTIME_GAUGES:
            yield _gauge(name, f"Current {words}.", value)
        else:
            yield _counter(name, f"Count of {words}.", value)


def _state_families(core: Mapping[str, float], peer_states: Mapping[str, str],
                    node_id: str) -> Iterator[Metric]:
    counts: Counter[str] = Counter(peer_states.values())
    peers = GaugeMetricFamily(PREFIX + "peers", "Known peers by membership state.",
                              labels=["state"])
    for s in ("alive", "suspect", "dead"):
        peers.add_metric([s], counts[s])
    yield peers
    each = GaugeMetricFamily(PREFIX + "peer_state", "1 for each peer's current membership "
                             "state.", labels=["peer", "state"])
    for p, s in sorted(peer_states.items()):
        each.add_metric([p, s], 1)
    yield each
    for name, value in sorted(core.items()):
        if name in CORE_DUPLICATES:
            continue
        if name in CORE_GAUGES:
            yield _gauge(f"core_{name}", f"NodeCore level {name}.", float(value))
        else:
            yield _counter(f"core_{name}", f"NodeCore counter {name}.", float(value))
    info = GaugeMetricFamily(PREFIX + "node_info", "Static node identity.", labels=["node_id"])
    info.add_metric([node_id], 1)
    yield info


class _Scrape:
    """One scrape: the node's registry (histograms) plus the families built from its counters,
    gauges, core metrics and peer states at this moment."""

    def __init__(self, m: RuntimeMetrics, gauges: Mapping[str, float],
                 core: Mapping[str, float], peer_states: Mapping[str, str],
                 node_id: str) -> None:
        self._args = (m, gauges, core, peer_states, node_id)

    def collect(self) -> Iterator[Metric]:
        m, gauges, core, peer_states, node_id = self._args
        yield from _runtime_families(m)
        yield from _part_families(gauges)
        yield from _state_families(core, peer_states, node_id)
        yield from m.registry.collect()


def render(
    m: RuntimeMetrics,
    gauges: Mapping[str, float],
    core: Mapping[str, float],
    peer_states: Mapping[str, str],
    node_id: str,
) -> str:
    """Prometheus text for one node (``GET /metrics``)."""
    return generate_latest(_Scrape(m, gauges, core, peer_states, node_id)).decode()


# ------------------------------------------------------------------------------ reading
def parse_samples(text: str) -> dict[str, float]:
    """A Prometheus text page (any exporter's: a node's, vLLM's) as
    ``{'name{k="v",...}': value}``, labels in the page's order (no labels: the bare name), by
    ``prometheus_client``'s parser. A line it cannot parse is skipped; the rest are kept."""
    try:
        return _samples(text)
    except ValueError:
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.strip() and not line.startswith("#"):
                with contextlib.suppress(ValueError):
                    out.update(_samples(line + "\n"))
        return out


def _samples(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in s.labels.items())
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


def sample_sum(samples: Mapping[str, float], name: str) -> float:
    """The sum of ``name``'s samples over all its label sets."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))
