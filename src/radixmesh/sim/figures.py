"""The simulator's own figures of one run (``summary["sim"]``), without its warm-up.

Theory of operation
-------------------
A run's benchmark figures come from the records of the requests that are not warm-up
(``--exclude-warmup``: ``Record.warmup``, :mod:`radixmesh.sim.runner`). The simulator's own
figures leave the warm-up out too, each in the one way its counter allows:

* a request's own — forward failures and refusals, deliberate replicas and second cold copies
  (``Counters``, also counted on each request's ``Journey``): summed over the measured
  requests' journeys, finished or not; refusals per request divide by the measured requests
  the workload holds;
* over time — gossip per node per second, gossip lost, the cores' own counters (refusal
  reasons, placement tags, summed over nodes) and the gateway's choices: their growth since
  the warm-up ended (:class:`Counts`, taken when the workload starts and again when its first
  measured request is sent after warm-up ones). Warm-up requests still in flight then count
  from there on, as in any window of a run;
* per decision — estimate errors, view ages, forwarded requests: the measured records';
* the whole run, labelled (``WHOLE_RUN``, in ``summary["warmup"]["whole_run"]``): the
  simulator's own speed (events, wall and virtual seconds) and the log lines; the view sizes
  are the nodes' state at the end.

With no warm-up excluded every window starts with the workload, as it always has.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixmesh.core.node import NodeCore
from radixmesh.core.router import Tag
from radixmesh.results.records import Record
from radixmesh.results.run_summary import mean, percentile, prediction_errors
from radixmesh.sim.shell import ClusterConfig, Journey, SimCluster

# the cores' own counters summed over nodes: why forwards were refused, and what the router
# believed each placement was (``placement_second_copy``: from the deciding node's view)
_CORE_SUMS = (
    "forwards_refused_busy",
    "forwards_refused_slower",
    "forwards_refused_full",
    *(f"placement_{t.value}" for t in Tag),
)
# counted on each request's journey (``sim/shell.py``)
JOURNEY_COUNTS = (
    "forward_failures", "forward_refusals", "second_cold_copies", "deliberate_replicas",
)  # fmt: skip
# ``summary["sim"]`` keys over the whole run, warm-up included
WHOLE_RUN = ("virtual_s", "wall_s", "events", "events_per_s", "logs")


@dataclass(frozen=True, slots=True)
class Counts:
    """The cluster's cumulative counters at one moment (:meth:`of`)."""

    t: float
    gossip: tuple[int, int, int]  # bytes, messages, lost
    cores: dict[int, tuple[NodeCore, dict[str, float]]]  # node -> its core then, its sums
    gateway: tuple[int, int]  # balanced, imbalanced choices

    @classmethod
    def of(cls, cluster: SimCluster) -> Counts:
        c, gw = cluster.counters, cluster.gateway
        cores = {
            n.idx: (n.core, {k: n.core.metrics().get(k, 0.0) for k in _CORE_SUMS})
            for n in cluster.nodes if n.core is not None
        }  # fmt: skip
        return cls(
            cluster.loop.now, (c.gossip_bytes, c.gossip_messages, c.gossip_lost), cores,
            (0, 0) if gw is None else (gw.balanced_choices, gw.imbalanced_choices),
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Window:
    """What a run's counters count over: from ``since`` (the warm-up's end) on, and the
    ``journeys`` of the measured requests sent, of ``planned`` in the workload."""

    t0: float  # the workload's start
    since: Counts
    journeys: Sequence[Journey]
    planned: int


def sim_figures(
    c: ClusterConfig,
    cluster: SimCluster,
    window: Window,
    records: list[Record],
    extras: list[dict[str, Any]],
    wall: float,
) -> dict[str, Any]:
    """The simulator-only figures of a run (``summary["sim"]``) from the measured
    ``records`` and their ``extras`` (the module docstring)."""
    now = cluster.loop.now
    return {
        "engine": "simulated",
        "cost_model": c.cost.name,
        "gossip_mode": c.gossip.mode.value,
        **_traffic(c, cluster, window, max(now - window.since.t, 1e-9)),
        **_estimate_errors(extras, c.block_size),
        "forwarded_requests": sum(1 for r in records if r.route == "forwarded"),
        **_view_ages(records, extras),
        "ttft_prediction_error": _prediction_errors(records, extras),
        "virtual_s": max(now - window.t0, 1e-9),
        "warmup_s": window.t0,
        "wall_s": wall,
        "events": cluster.loop.events,
        "events_per_s": cluster.loop.events / wall if wall > 0 else None,
        "logs": dict(cluster.counters.logs),
        **_view_sizes(cluster),
        **_gateway_figures(cluster, window.since),
    }


def _gateway_figures(cluster: SimCluster, since: Counts) -> dict[str, Any]:
    """With a gateway: how many of its choices were made by load alone (imbalanced)."""
    gw = cluster.gateway
    if gw is None:
        return {}
    return {
        "gateway_balanced_choices": gw.balanced_choices - since.gateway[0],
        "gateway_imbalanced_choices": gw.imbalanced_choices - since.gateway[1],
    }


def _traffic(c: ClusterConfig, cluster: SimCluster, window: Window, span: float
             ) -> dict[str, Any]:  # fmt: skip
    """Gossip per node per second and gossip lost since the warm-up ended; the measured
    requests' failed or refused forwards and cold copies."""
    counters = cluster.counters
    b0, m0, lost0 = window.since.gossip
    own = {k: sum(getattr(j, k) for j in window.journeys) for k in JOURNEY_COUNTS}
    return {
        "gossip_bytes_per_node_s": (counters.gossip_bytes - b0) / c.nodes / span,
        "gossip_messages_per_node_s": (counters.gossip_messages - m0) / c.nodes / span,
        "gossip_lost": counters.gossip_lost - lost0,
        "forward_failures": own["forward_failures"],
        "forward_refusals": own["forward_refusals"],
        "forward_refusals_per_request": own["forward_refusals"] / max(1, window.planned),
        # cold prefills of a prefix another engine held at placement (the truth; see cluster)
        "second_cold_copies": own["second_cold_copies"],
        "deliberate_replicas": own["deliberate_replicas"],
        **_core_counters(cluster, window.since),
    }


def _core_counters(cluster: SimCluster, since: Counts) -> dict[str, float]:
    """The cores' sums since ``since`` (a core restarted after it: all of its own)."""
    out = dict.fromkeys(_CORE_SUMS, 0.0)
    for node in cluster.nodes:
        if node.core is None:
            continue
        m = node.core.metrics()
        then, base = since.cores.get(node.idx, (None, {}))
        for name in _CORE_SUMS:
            out[name] += m.get(name, 0.0) - (base.get(name, 0.0) if then is node.core else 0.0)
    return out


def _estimate_errors(extras: list[dict[str, Any]], block_size: int) -> dict[str, Any]:
    """How far the expected cached tokens at each target were from the truth there, at
    decision time."""
    errors = [abs(e["estimate_error_tokens"]) for e in extras]
    return {
        "estimate_abs_error_tokens_mean": mean([float(e) for e in errors]),
        "estimate_abs_error_tokens_p99": percentile([float(e) for e in errors], 99),
        # wrong = off by at least one block (estimates are block-granular, truth is exact)
        "estimate_wrong_share": (
            sum(1 for e in errors if e >= block_size) / len(errors) if errors else None
        ),
    }


def _view_ages(records: list[Record], extras: list[dict[str, Any]]) -> dict[str, Any]:
    """Age of the gossiped view behind each decision that was not purely local."""
    ages = [e["view_age_s"] for r, e in zip(records, extras, strict=True) if r.route != "local"]
    return {
        "view_age_s_mean": mean(ages),
        "view_age_s_p99": percentile(ages, 99),
        "view_stale_share": (sum(1 for a in ages if a > 0) / len(ages)) if ages else None,
    }


def _prediction_errors(records: list[Record], extras: list[dict[str, Any]]
                       ) -> dict[str, dict[str, float | None]]:  # fmt: skip
    """The router's TTFT for the node that served each request (its last try) against the
    TTFT met: every such request, those served where they entered and those forwarded."""
    got = [(r.route, e["predicted_ttft_s"], r.ttft_s) for r, e in zip(records, extras, strict=True)
           if r.ttft_s is not None and e.get("predicted_ttft_s") is not None]
    return {name: prediction_errors([(p, a) for route, p, a in got if keep(route)])
            for name, keep in (("all", lambda _: True), ("local", lambda r: r == "local"),
                               ("forwarded", lambda r: r != "local"))}


def _view_sizes(cluster: SimCluster) -> dict[str, float]:
    """Mean per node: own advertised blocks, and entries held about peers (the estimate)."""
    own = views = 0.0
    up = [n for n in cluster.nodes if n.core is not None]
    for n in up:
        assert n.core is not None
        m = n.core.metrics()
        own += m["summary_blocks"]
        views += m["view_entries"]
    k = max(1, len(up))
    return {"own_blocks_per_node": own / k, "view_entries_per_node": views / k}
