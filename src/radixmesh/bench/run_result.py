"""One run's outcome (:class:`RunResult`) and its entry in ``summary.json`` (:func:`summary_entry`).

The runner (bench/runner.py) fills a ``RunResult`` as the run goes: what was planned and
dropped, the records, what the nodes said after it (placements, engine lag), the per-node load
over time and the processes' CPU use (bench/usage.py). :func:`summary_entry` turns it into the
run's line of ``summary.json``: the configuration, the figures of the records that are not
warm-up (results/run_summary.py), and everything the run measured besides.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from radixmesh.bench.emulated import PLANNED
from radixmesh.bench.spec import RunSpec
from radixmesh.results.records import Record
from radixmesh.results.run_summary import node_figures, summarize
from radixmesh.workload import Request
from radixmesh.workload.build import TOO_LONG, Drops
from radixmesh.workload.schedule import describe


@dataclass(slots=True)
class RunResult:
    spec: RunSpec
    records: list[Record] = field(default_factory=list)
    interrupted: bool = False
    skipped: str | None = None
    drops: Drops = field(default_factory=Drops)
    schedule: dict[str, Any] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    mode: str = "sequential"
    oracle_mismatches: int | None = None
    ideal_hit_rate: float | None = None
    node_ids: list[str] = field(default_factory=list)
    batch: str = ""
    paired_with: list[str] = field(default_factory=list)
    probe_requests: list[Request] = field(default_factory=list)
    capacity: dict[str, Any] | None = None
    placements: dict[str, float] | None = None  # the nodes' placement tags (cost), summed
    engine_lag: dict[str, Any] | None = None  # emulated engines: lag behind their profiles
    load: dict[str, Any] | None = None  # per-node load over time (bench/usage.py)
    cpu: dict[str, Any] | None = None  # the run's processes' CPU use (bench/usage.py)


def summary_entry(res: RunResult) -> dict[str, Any]:
    s, w = res.spec, res.spec.workload
    entry: dict[str, Any] = {
        "name": s.name, "policy": s.policy, "nodes": s.nodes, "workload": w.source,
        "skew": s.skew, "net_delay_ms": s.net_delay_s * 1000.0,
        "gossip_interval_ms": s.gossip_interval_s * 1000.0, "cache_tokens": s.cache_tokens,
        "gossip_announce_ms": None if s.gossip_announce_s is None
        else s.gossip_announce_s * 1000.0,
    }  # fmt: skip
    measured = [r for r in res.records if not r.warmup]
    excluded = len(res.records) - len(measured)
    entry.update(summarize(measured))
    entry.update(node_figures(measured, res.node_ids))
    entry.update({"group": s.group, "planned_requests": w.requests, "seed": w.seed})
    entry.update(res.schedule or describe([], s.concurrency, w.rate))
    entry.update({
        "dropped": res.drops.to_json(), "dropped_too_long": res.drops.dropped[TOO_LONG],
        "interrupted": res.interrupted, "skipped": res.skipped,
        "oracle_mismatches": res.oracle_mismatches, "lockstep": s.lockstep, "batch": res.batch,
        "paired_with": res.paired_with, "clusters_at_once": 1 + len(res.paired_with),
        "cpu_cores": os.cpu_count(), "threads_per_node": s.threads,
        "device": s.device, "dtype": s.dtype,
        "ideal_hit_rate": res.ideal_hit_rate, "workload_kind": w.kind,
        "load_fraction": w.load, "capacity": res.capacity, "placements": res.placements,
        "engine": s.engine, "profiles": s.profiles or None, "time_scale": s.time_scale,
        "engine_lag": res.engine_lag,
        "regions": None if s.region_map is None else s.region_map.to_json(),
        "warmup": {"requests": s.warmup_requests, "seconds": s.warmup_s,
                   "excluded": excluded},
        "output_lengths": w.output_lengths.text() if w.output_lengths else None,
        "think_s": w.think_s, "load_over_time": res.load, "cpu": res.cpu,
    })  # fmt: skip
    if res.capacity and res.capacity.get("rate"):
        basis = "planned" if res.capacity.get("basis") == PLANNED else "measured"
        entry["schedule_text"] += (f"; {100 * (w.load or 0):g} % of {basis} capacity "
                                   f"{res.capacity['capacity_rps']:.2f} req/s")  # fmt: skip
    if excluded:
        entry["schedule_text"] += f"; {excluded} warm-up requests excluded"
    return entry
