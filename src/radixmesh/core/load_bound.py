"""Bounded load: how much busier than the mean a node may be and still take more.

The cost policy sends no forward to a peer busier than ``(1 + load_bound)`` x the mean
utilization of the candidates (plus one request's slack, :func:`request_slack`), and placement
names no busier member a new owner (``placement_load_bound``): consistent hashing with bounded
load (Mirrokni et al.). A batching engine's node is exempt: its predicted TTFT holds its load
(``core/cost_model.py``). Pure functions of the router's :class:`~.cost_model.NodeInfo`."""

from __future__ import annotations

from collections.abc import Sequence

from radixmesh.core.cost_model import NodeInfo


def mean_utilization(nodes: Sequence[NodeInfo]) -> float:
    """The mean of the nodes' utilizations (0 for none): what bounded load compares to."""
    return sum(n.utilization for n in nodes) / len(nodes) if nodes else 0.0


def over_bound(node: NodeInfo, mean: float, bound: float | None, slack: float = 0.0) -> bool:
    """Whether ``node`` is busier than ``(1 + bound)`` × the ``mean`` utilization plus
    ``slack`` (bounded load; None: never)."""
    if bound is None or mean <= 0.0:
        return False
    return node.utilization > (1.0 + bound) * mean + slack


def request_slack(node: NodeInfo, window_s: float) -> float:
    """One request's worth of ``node``'s busy time over the utilization's window: the slack
    a *forward* bound needs, since with light traffic (a single node active) the mean is
    tiny and a node must still be able to take the next request. Placement takes none: it
    only names who makes a copy not yet made, and at low load the slack is as large as the
    differences it must see (one request in a 10 s window against utilizations near 1/16)."""
    return node.speed.mean_service_s / window_s
