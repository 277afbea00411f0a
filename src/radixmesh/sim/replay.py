"""Validation of an emulated mesh: the simulator replays the run's own trace and compares.

Theory of operation
-------------------
``radixmesh sim --validate BENCH_DIR`` on a ``radixmesh bench --engine emulated`` run folder
(``summary.json`` entries with ``engine: "emulated"``; :mod:`radixmesh.sim.validate` keeps the
built-in-engine path). For every run of a policy the simulator expresses — the nodes' policies,
and the gateways ``sglang`` / ``smg`` as its models of them (``sim/gateway.py``: sglang-router
0.3.2's ``cache_aware``, SMG 1.13's) — the simulator replays exactly
what the real run's clients sent: each request of ``requests.jsonl`` (the run's records) at its
recorded send time (``t_send``, unscaled) into its recorded entry node, with the output length
it got. The prompts come from the workload the run was built from (``workload_kind``,
``planned_requests``, ``seed`` of its summary; ``--trace`` or a ``trace.jsonl`` in the folder,
``--mmlu-dir`` and ``--synthetic-scale`` as given to the bench), matched by request id: an id
the workload does not have is refused, naming it, and the mean prompt length of both sides is
reported (``prompt_tokens``: other workload flags give other prompts under the same ids).
Regenerating nothing else — not the arrival times, not the entries, not the draws a bursty or
session schedule made — the comparison is of the mesh alone.

The simulated mesh is the real one's: each node's engine on its profile (``profiles``, the
bench's syntax and parser; the profile's KV pool), the run's link delay, and its regions when
the summary names them (``regions`` / ``region_delays``; else ``--regions`` /
``--region-delays`` as given here). A forward's HTTP work, which the real run did on the wall
clock, is charged at the simulator's figure divided by the run's time scale. The requests the
real run left out of its figures as warm-up (records flagged ``warmup``) are replayed and left
out the same way. Compared per run: the hit rate (points apart) and the mean and p99 TTFT,
each as the ratio to ``none``'s run on the same mesh, real against simulated. ``--out`` gets
the comparison (``validation.json`` / ``.md``), the replay's ``summary.json`` and its records
(``requests.jsonl``, unless ``--no-records``; with ``--decisions`` each record carries the
node that served it as its entry node's router saw it): a policy change can be judged on the
real run's own sequence, request by request.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from radixmesh.core.config import GossipConfig
from radixmesh.core.router import Policy, RouterConfig
from radixmesh.options import gossip_config
from radixmesh.results.run_summary import Row, load_summary
from radixmesh.sim.gateway import CACHE_AWARE, SMG, GatewayConfig
from radixmesh.sim.network import NetworkConfig, parse_regions
from radixmesh.sim.runner import SimResult, SimSpec
from radixmesh.sim.runner import run as run_sim
from radixmesh.sim.shell import ClusterConfig
from radixmesh.sim.sweep import cluster_cost, profile_costs
from radixmesh.sim.tokens import TOKENIZERS
from radixmesh.workload import WorkloadSpec, build
from radixmesh.workload.request import Request

GATEWAYS = {"sglang": CACHE_AWARE, "smg": SMG}  # bench policy -> the sim's gateway
REPLAYABLE = {p.value for p in Policy} | set(GATEWAYS)


def is_emulated(real_dir: Path) -> bool:
    runs = load_summary(real_dir / "summary.json")["runs"]
    return any(r.get("engine") == "emulated" for r in runs)


def emulated_runs(real_dir: Path) -> list[Row]:
    runs = load_summary(real_dir / "summary.json")["runs"]
    return [r for r in runs if r.get("engine") == "emulated" and not r.get("skipped")
            and r.get("requests") and r.get("policy") in REPLAYABLE]  # fmt: skip


def records_by_run(path: Path) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = {}
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                rec = json.loads(line)
                out.setdefault(rec["run"], []).append(rec)
    return out


def workload_pool(real: Row, args: argparse.Namespace, real_dir: Path) -> dict[str, Request]:
    """The run's requests by id, rebuilt from the workload its summary names."""
    trace = args.trace or (str(real_dir / "trace.jsonl")
                           if (real_dir / "trace.jsonl").exists() else None)  # fmt: skip
    kind = real.get("workload_kind") or "mmlu"
    spec = WorkloadSpec(
        kind="mmlu" if trace else kind, requests=real.get("planned_requests"),
        skewed=real.get("skew") == "skewed", seed=int(real.get("seed") or 0),
        mmlu_dir=args.mmlu_dir, trace=trace, synthetic_scale=args.synthetic_scale,
        synthetic_groups=args.synthetic_groups,
    )  # fmt: skip
    return {r.id: r for r in build(spec, int(real["nodes"]))}


def replayed(records: list[Row], pool: dict[str, Request]) -> list[Request]:
    """The records' requests as sent: at their send times (from the first), into their entry
    nodes, with the output length each got."""
    sent = _in_send_order(records)
    if not sent:
        return []
    t0 = float(sent[0]["t_send"])
    out = []
    for rec in sent:
        req = pool.get(rec["id"])
        if req is None:
            raise ValueError(f"requests.jsonl: request {rec['id']!r} of run {rec['run']!r} is "
                             "not in the workload its summary names (give --trace or the "
                             "bench's workload flags)")  # fmt: skip
        got = rec.get("completion_tokens") or req.max_tokens
        out.append(replace(req, max_tokens=int(got)).with_entry(int(rec["entry"]))
                   .with_time(float(rec["t_send"]) - t0))  # fmt: skip
    return out


def warm_positions(records: list[Row]) -> frozenset[int]:
    """Which of :func:`replayed`'s requests (same order) the real run left out of its figures
    as warm-up: its records' own flags. Compared over other requests than the real run's, the
    simulator's figures kept the cold start (4 RAG nodes: 6-7 hit points under the real run's,
    every policy, ``none`` too)."""
    return frozenset(i for i, rec in enumerate(_in_send_order(records)) if rec.get("warmup"))


def _in_send_order(records: list[Row]) -> list[Row]:
    """``records`` as their requests were sent (the order both functions above number)."""
    return sorted(records, key=lambda r: float(r["t_send"]))


def cluster_like(real: Row, args: argparse.Namespace, tok_fp: str) -> ClusterConfig:
    nodes = int(real["nodes"])
    node_costs = profile_costs(str(real["profiles"]), nodes)
    gateway = GatewayConfig(kind=GATEWAYS[real["policy"]]) if real["policy"] in GATEWAYS else None
    policy = Policy.NONE if gateway is not None else Policy.parse(real["policy"])
    cost = cluster_cost(argparse.Namespace(profiles=real["profiles"]), node_costs)
    # a hop's HTTP work ran on the wall clock, which the run's time scale divides: at 50x the
    # 3 ms the simulator charges a forward were 0.06 ms of the run's time (its link delay is
    # emulated, and simulated, at the run's own value)
    scale = float(real.get("time_scale") or 1.0)
    cost = replace(cost, forward_overhead_s=cost.forward_overhead_s / scale)
    return ClusterConfig(
        nodes=nodes,
        cost=cost,
        node_costs=node_costs,
        gateway=gateway,
        router=RouterConfig(policy=policy),  # the runtime's defaults, as the real nodes
        gossip=_gossip(real),
        network=_network(real, args),
        seed=int(real.get("seed") or 0),
        tokenizer=tok_fp,
    )


def _gossip(real: Row) -> GossipConfig:
    """The run's gossip rhythm (its interval and announcement gap, unscaled; ``null``: no
    announcements; absent: an older run's defaults), built as its nodes built theirs."""
    base = GossipConfig()
    interval_ms = real.get("gossip_interval_ms")
    announce = base.announce_gap_s
    if "gossip_announce_ms" in real:
        ms = real["gossip_announce_ms"]
        announce = None if ms is None else float(ms) / 1000.0
    interval = base.interval_s if interval_ms is None else float(interval_ms) / 1000.0
    return gossip_config(interval, base.mode.value, base.fanout, announce)


def _network(real: Row, args: argparse.Namespace) -> NetworkConfig:
    names = real.get("regions") or args.regions
    matrix = real.get("region_delays") or args.region_delays
    regions, delays = parse_regions(names, matrix) if names else ((), ())
    return NetworkConfig(delay_s=float(real["net_delay_ms"]) / 1000.0, regions=regions,
                         region_delay_s=delays)  # fmt: skip


def simulate(real: Row, args: argparse.Namespace, records: list[Row], real_dir: Path
             ) -> SimResult:
    """The run ``real`` replayed (``args.decisions``: each record with its ``considered``)."""
    tokenize, tok_fp = TOKENIZERS["bytes"]()  # the emulated mesh's (bench/emulated.py)
    reqs = replayed(records, workload_pool(real, args, real_dir))
    decisions = bool(getattr(args, "decisions", False))
    cfg = replace(cluster_like(real, args, tok_fp), decisions=decisions)
    spec = SimSpec(real["name"], cfg, real.get("workload", "trace"), real.get("skew", "uniform"),
                   "poisson", warm=warm_positions(records))  # open loop: the recorded times
    result = run_sim(spec, reqs, tokenize)
    real_tokens = [int(r["prompt_tokens"]) for r in records if r.get("prompt_tokens")]
    result.summary["replay_prompt_tokens"] = {  # the same prompts? (a template adds a few)
        "real": sum(real_tokens) / len(real_tokens) if real_tokens else None,
        "sim": sum(len(tokenize(r)) for r in reqs) / len(reqs) if reqs else None,
    }
    return result


def compare(real: list[Row], sim: list[Row]) -> list[Row]:
    rows = []
    for r, s in zip(real, sim, strict=True):
        rn, sn = _none_of(real, r), _none_of(sim, s)
        rows.append({
            "name": r["name"], "policy": r["policy"], "requests": r["requests"],
            "real_hit": r.get("actual_hit_rate"), "sim_hit": s.get("actual_hit_rate"),
            "hit_diff_points": _points(r.get("actual_hit_rate"), s.get("actual_hit_rate")),
            "real_mean_ttft_s": r.get("mean_ttft_s"), "sim_mean_ttft_s": s.get("mean_ttft_s"),
            "real_mean_ratio": _ratio(r, rn, "mean_ttft_s"),
            "sim_mean_ratio": _ratio(s, sn, "mean_ttft_s"),
            "real_p99_ratio": _ratio(r, rn, "p99_ttft_s"),
            "sim_p99_ratio": _ratio(s, sn, "p99_ttft_s"),
            "prompt_tokens": s.get("replay_prompt_tokens"),
        })  # fmt: skip
    return rows


def _none_of(rows: list[Row], r: Row) -> Row | None:
    key = (r["nodes"], r.get("profiles"), r.get("workload"), r.get("net_delay_ms"))
    found = [x for x in rows if x["policy"] == "none"
             and (x["nodes"], x.get("profiles"), x.get("workload"), x.get("net_delay_ms")) == key]
    return found[0] if found else None  # fmt: skip


def _ratio(r: Row, none: Row | None, key: str) -> float | None:
    if none is None or r.get(key) is None or not none.get(key):
        return None
    return float(r[key]) / float(none[key])


def _points(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else 100 * (b - a)


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def markdown(rows: list[Row]) -> str:
    lines = [
        "| run | policy | hit % real | hit % sim | Δ pts | TTFT mean s real | sim | "
        "mean / none real | sim | p99 / none real | sim |",
        "|" + " --- |" * 11,
    ]
    for r in rows:
        hit = [_f(None if v is None else 100 * v, ".1f") for v in (r["real_hit"], r["sim_hit"])]
        lines.append(
            f"| {r['name']} | {r['policy']} | {hit[0]} | {hit[1]} | "
            f"{_f(r['hit_diff_points'], '+.1f')} | {_f(r['real_mean_ttft_s'], '.3f')} | "
            f"{_f(r['sim_mean_ttft_s'], '.3f')} | {_f(r['real_mean_ratio'], '.2f')} | "
            f"{_f(r['sim_mean_ratio'], '.2f')} | {_f(r['real_p99_ratio'], '.2f')} | "
            f"{_f(r['sim_p99_ratio'], '.2f')} |"
        )
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    real_dir = Path(args.validate)
    real = emulated_runs(real_dir)
    if not real:
        raise ValueError(f"{real_dir}: no emulated run of a policy the simulator replays")
    records = records_by_run(real_dir / "requests.jsonl")
    results = [simulate(r, args, records.get(r["name"], []), real_dir) for r in real]
    sim = [res.summary for res in results]
    rows = compare(real, sim)
    out = Path(args.out or "sim-validate")
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"runs": sim}, indent=2) + "\n")
    if not getattr(args, "no_records", False):  # the replayed records, as the sweep writes
        with (out / "requests.jsonl").open("w") as fh:
            for res in results:
                res.write_records(fh)
    (out / "validation.json").write_text(
        json.dumps({"real": str(real_dir), "replayed": "trace", "rows": rows}, indent=2) + "\n"
    )
    table = markdown(rows)
    (out / "validation.md").write_text(table)
    print(table)
    return 0
