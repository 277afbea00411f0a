"""Validation: replay a real ``radixmesh bench`` run's configurations in the simulator and
compare them side by side.

Theory of operation
-------------------
A bench output folder holds ``summary.json`` (one entry per configuration: policy, nodes,
delay, Δpoll, cache budget, skew, requests, seed, schedule) and ``requests.jsonl``. For every
configuration the simulator can express (node policies; the paper's sequential schedule or
Poisson arrivals), the same workload (same generator flags and seed) is simulated with the same
settings. The cost model is, by default, *fitted to the real run itself* (its locally served
requests: client latency against uncached/cached tokens; see ``calibrate --from-records``), so
hardware speed and machine load are taken from the very run being predicted and what is left
to validate is the routing, gossip, caching and forwarding behaviour.

Compared per configuration: actual (and expected) hit rate — target within ±3 points — and the
``policy / none`` mean-latency ratio (each side against its own ``none`` at the same skew,
cache and node count) — target within ±10 %.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from radixmesh.core.config import GossipConfig, PushbackConfig
from radixmesh.core.router import Policy, RouterConfig
from radixmesh.sim.cluster import ClusterConfig
from radixmesh.sim.costs import CostModel
from radixmesh.sim.network import NetworkConfig
from radixmesh.sim.runner import RunSpec
from radixmesh.sim.runner import run as run_sim
from radixmesh.workload import schedule

SIM_POLICIES = {p.value for p in Policy}
Row = dict[str, Any]


def real_runs(real_dir: Path) -> list[Row]:
    runs = json.loads((real_dir / "summary.json").read_text())["runs"]
    out = []
    for r in runs:
        if r.get("skipped") or r.get("policy") not in SIM_POLICIES:
            continue
        if (r.get("concurrency") or 1) > 1 or not r.get("requests"):
            continue
        out.append(r)
    return out


def simulate_like(
    real: Row, args: argparse.Namespace, cost: CostModel, tokenize: Any, tok_fp: str,
    noise: float = 0.0,
) -> Row:  # fmt: skip
    from radixmesh.sim import cli

    point = argparse.Namespace(
        **{**vars(args), "requests": real.get("planned_requests") or real["requests"],
           "seed": real.get("seed", args.seed)}
    )  # fmt: skip
    nodes = int(real["nodes"])
    reqs = cli._requests(point, real["skew"] == "skewed", nodes)
    rate = real.get("arrival_rate")
    sched = "poisson" if rate else "sequential"
    if rate:
        reqs = schedule.poisson(reqs, nodes, float(rate), point.seed)
    policy = Policy.parse(real["policy"])
    interval = float(real["gossip_interval_ms"]) / 1000.0
    cfg = ClusterConfig(
        nodes=nodes,
        cost=cost,
        router=RouterConfig(policy=policy, context_scale=cost.context_scale),
        gossip=GossipConfig.for_interval(interval),
        pushback=PushbackConfig(queue_threshold=args.pushback_threshold),
        network=NetworkConfig(delay_s=float(real["comm_delay_ms"]) / 1000.0),
        cache_tokens=int(real["cache_tokens"]),
        seed=point.seed,
        tokenizer=tok_fp,
        service_noise=noise,
    )
    res = run_sim(RunSpec(real["name"], cfg, real.get("workload", "synthetic"), real["skew"],
                          sched), reqs, tokenize)  # fmt: skip
    return res.summary


def _key(r: Row) -> tuple[Any, ...]:
    return (r["skew"], r["cache_tokens"], r["nodes"])


def _none_of(rows: list[Row], r: Row) -> Row | None:
    cands = [x for x in rows if x["policy"] == "none" and _key(x) == _key(r)]
    same_delay = [x for x in cands if x["comm_delay_ms"] == r["comm_delay_ms"]]
    return (same_delay or cands or [None])[0]


def _ratio(rows: list[Row], r: Row) -> float | None:
    base = _none_of(rows, r)
    if base is None or not base.get("mean_latency_s") or r.get("mean_latency_s") is None:
        return None
    return float(r["mean_latency_s"]) / float(base["mean_latency_s"])


def drift_factors(records_path: Path, cost: CostModel) -> dict[str, float]:
    """Per real run: mean client latency of its locally served requests over what the cost
    model predicts for them. On a shared machine this drifts between runs (other jobs come and
    go); dividing it out compares runs as if the machine had kept one speed."""
    sums: dict[str, list[float]] = {}
    with records_path.open(encoding="utf-8") as fh:
        for line in fh:
            rec = json.loads(line)
            if rec.get("error") or rec.get("route") != "local":
                continue
            u = int(rec["prompt_tokens"]) - int(rec["cached_tokens"])
            acc = sums.setdefault(rec["run"], [0.0, 0.0])
            acc[0] += float(rec["latency_s"])
            acc[1] += cost.service_s(u, int(rec["cached_tokens"]), 1)
    return {run: a / b for run, (a, b) in sums.items() if b > 0}


def _corrected_ratio(rows: list[Row], r: Row, drift: dict[str, float]) -> float | None:
    base = _none_of(rows, r)
    if base is None or r["name"] not in drift or base["name"] not in drift:
        return None
    raw = _ratio(rows, r)
    return None if raw is None else raw * drift[base["name"]] / drift[r["name"]]


def compare(real: list[Row], sim: list[Row], drift: dict[str, float] | None = None) -> list[Row]:
    rows = []
    for r, s in zip(real, sim, strict=True):
        rr, sr = _ratio(real, r), _ratio(sim, s)
        rc = _corrected_ratio(real, r, drift) if drift else None
        rows.append(
            {
                "name": r["name"],
                "policy": r["policy"],
                "skew": r["skew"],
                "comm_delay_ms": r["comm_delay_ms"],
                "requests": r["requests"],
                "real_actual_hit": r["actual_hit_rate"],
                "sim_actual_hit": s["actual_hit_rate"],
                "hit_diff_points": _diff_points(r["actual_hit_rate"], s["actual_hit_rate"]),
                "real_expected_hit": r["expected_hit_rate"],
                "sim_expected_hit": s["expected_hit_rate"],
                "real_mean_s": r["mean_latency_s"],
                "sim_mean_s": s["mean_latency_s"],
                "real_ratio": rr,
                "real_ratio_corrected": rc,
                "drift": (drift or {}).get(r["name"]),
                "sim_ratio": sr,
                "ratio_diff_pct": None if rr is None or sr is None else 100 * (sr - rr) / rr,
                "corrected_ratio_diff_pct": (
                    None if rc is None or sr is None else 100 * (sr - rc) / rc
                ),
                "real_hotspot": r["hotspot_share"],
                "sim_hotspot": s["hotspot_share"],
                "real_forwarded": r["forwarded_share"],
                "sim_forwarded": s["forwarded_share"],
            }
        )
    return rows


def _diff_points(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else 100 * (b - a)


def _p(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def _f(v: float | None, fmt: str = ".3f") -> str:
    return "-" if v is None else format(v, fmt)


def markdown(rows: list[Row]) -> str:
    head = (
        "| configuration | hit % real | hit % sim | Δ pts | exp. hit % real | exp. hit % sim "
        "| mean s real | mean s sim | /none real | /none real, drift-corr. | /none sim "
        "| Δ vs corr. % | hotspot % real | hotspot % sim | fwd % real | fwd % sim |\n|"
        + " --- |" * 16
        + "\n"
    )
    lines = []
    for r in rows:
        name = f"{r['policy']}, {r['skew']}, {r['comm_delay_ms']:g} ms"
        lines.append(
            f"| {name} | {_p(r['real_actual_hit'])} | {_p(r['sim_actual_hit'])} | "
            f"{_f(r['hit_diff_points'], '+.1f')} | {_p(r['real_expected_hit'])} | "
            f"{_p(r['sim_expected_hit'])} | {_f(r['real_mean_s'])} | {_f(r['sim_mean_s'])} | "
            f"{_f(r['real_ratio'])} | {_f(r['real_ratio_corrected'])} | {_f(r['sim_ratio'])} | "
            f"{_f(r['corrected_ratio_diff_pct'], '+.1f')} | {_p(r['real_hotspot'])} | "
            f"{_p(r['sim_hotspot'])} | {_p(r['real_forwarded'])} | {_p(r['sim_forwarded'])} |"
        )
    return head + "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    from radixmesh.sim import calibrate, cli, costs

    real_dir = Path(args.validate)
    out = Path(args.out or "sim-validate")
    out.mkdir(parents=True, exist_ok=True)
    if args.cost_model == "fit":
        fit_args = argparse.Namespace(
            from_records=str(real_dir / "requests.jsonl"), runs="", quiet=args.quiet,
            forward_overhead=args.forward_overhead,
        )  # fmt: skip
        doc = calibrate.from_records(fit_args)
        (out / "costmodel.json").write_text(json.dumps(doc, indent=2) + "\n")
        cost = costs.CostModel.from_dict(doc)
        fitted_noise = float(doc["fit"]["rel_rmse"])
    else:
        cost = costs.resolve(args.cost_model)
        fitted_noise = 0.0
    noise = fitted_noise if args.service_noise is None else args.service_noise
    real = real_runs(real_dir)
    if not real:
        raise ValueError(f"{real_dir}: no configuration the simulator can replay")
    sim = []
    for r in real:
        tokenize, tok_fp = cli.tokenizer_for(args, int(r["nodes"]))
        sim.append(simulate_like(r, args, cost, tokenize, tok_fp, noise))
        if not args.quiet:
            print(f"[validate] {r['name']}: simulated", flush=True)
    rows = compare(real, sim, drift_factors(real_dir / "requests.jsonl", cost))
    (out / "summary.json").write_text(json.dumps({"runs": sim}, indent=2) + "\n")
    (out / "validation.json").write_text(
        json.dumps(
            {"real": str(real_dir), "cost_model": cost.name, "service_noise": noise, "rows": rows},
            indent=2,
        )
        + "\n"
    )
    table = markdown(rows)
    (out / "validation.md").write_text(table)
    print(table)
    return 0
