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

A shared machine does not keep one speed: other jobs come and go between runs, and a slower
machine changes not only latencies but the ``cost`` policy's decisions (it learns each node's
speed). Each run's *drift* is measured from its own locally served requests (actual / fitted
latency), and every configuration is simulated twice: at that run's speed (the fitted model
scaled by its drift: compared with the raw real figures) and at the fitted speed (compared with
the real figures corrected for drift: compute time divided by it, network delay kept).

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
from radixmesh.results.run_summary import Row, load_summary
from radixmesh.sim.costs import CostModel
from radixmesh.sim.network import NetworkConfig
from radixmesh.sim.runner import SimSpec
from radixmesh.sim.runner import run as run_sim
from radixmesh.sim.shell import ClusterConfig
from radixmesh.sim.sweep import requests_for, tokenizer_for
from radixmesh.workload import schedule

SIM_POLICIES = {p.value for p in Policy}


def real_runs(real_dir: Path) -> list[Row]:
    runs = load_summary(real_dir / "summary.json")["runs"]
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
    point = argparse.Namespace(
        **{**vars(args), "requests": real.get("planned_requests") or real["requests"],
           "seed": real.get("seed", args.seed)}
    )  # fmt: skip
    nodes = int(real["nodes"])
    reqs = requests_for(point, real["skew"] == "skewed", nodes)
    rate = real.get("arrival_rate")
    sched = "poisson" if rate else "sequential"
    if rate:
        reqs = schedule.poisson(reqs, nodes, float(rate), point.seed)
    policy = Policy.parse(real["policy"])
    interval = float(real["gossip_interval_ms"]) / 1000.0
    announce = real.get("gossip_announce_ms")  # absent: a run from before announcements
    cfg = ClusterConfig(
        nodes=nodes,
        cost=cost,
        router=RouterConfig(policy=policy),  # the runtime's defaults, as the real nodes
        gossip=GossipConfig.for_interval(
            interval, announce_gap_s=None if announce is None else float(announce) / 1000.0
        ),
        pushback=PushbackConfig(queue_threshold=args.pushback_threshold),
        network=NetworkConfig(delay_s=float(real["net_delay_ms"]) / 1000.0),
        cache_tokens=int(real["cache_tokens"]),
        seed=point.seed,
        tokenizer=tok_fp,
        service_noise=noise,
    )
    res = run_sim(SimSpec(real["name"], cfg, real.get("workload", "synthetic"), real["skew"],
                          sched), reqs, tokenize)  # fmt: skip
    return res.summary


def _key(r: Row) -> tuple[Any, ...]:
    return (r["skew"], r["cache_tokens"], r["nodes"])


def _none_of(rows: list[Row], r: Row) -> Row | None:
    cands = [x for x in rows if x["policy"] == "none" and _key(x) == _key(r)]
    same_delay = [x for x in cands if x["net_delay_ms"] == r["net_delay_ms"]]
    found = same_delay or cands
    return found[0] if found else None


def _ratio(rows: list[Row], r: Row) -> float | None:
    base = _none_of(rows, r)
    if base is None or not base.get("mean_latency_s") or r.get("mean_latency_s") is None:
        return None
    return float(r["mean_latency_s"]) / float(base["mean_latency_s"])


def drift_corrected_means(
    records_path: Path, cost: CostModel, delays: dict[str, float]
) -> dict[str, tuple[float, float]]:
    """Per real run: ``(drift, corrected mean latency)``.

    ``drift`` is the mean client latency of the run's locally served requests over what the
    cost model predicts for them: on a shared machine it moves between runs as other jobs come
    and go. The corrected mean divides each request's compute part by it and keeps its network
    part (``2 x delay`` for a forward), i.e. the run as if the machine had kept the fitted speed.
    """
    local: dict[str, list[float]] = {}
    reqs: dict[str, list[tuple[float, float]]] = {}
    with records_path.open(encoding="utf-8") as fh:
        for line in fh:
            rec = json.loads(line)
            run = rec["run"]
            if rec.get("error") or run not in delays:
                continue
            lat = float(rec["latency_s"])
            forwarded = rec.get("route") in ("forwarded", "fallback")
            reqs.setdefault(run, []).append((lat, 2 * delays[run] if forwarded else 0.0))
            if not forwarded:
                u = int(rec["prompt_tokens"]) - int(rec["cached_tokens"])
                acc = local.setdefault(run, [0.0, 0.0])
                acc[0] += lat
                acc[1] += cost.service_s(u, int(rec["cached_tokens"]), 1)
    out = {}
    for run, (real, pred) in local.items():
        drift = real / pred if pred > 0 else 1.0
        items = reqs[run]
        mean = sum(max(0.0, lat - net) / drift + net for lat, net in items) / len(items)
        out[run] = (drift, mean)
    return out


def _corrected_ratio(rows: list[Row], r: Row, corr: dict[str, tuple[float, float]]) -> float | None:
    base = _none_of(rows, r)
    if base is None or r["name"] not in corr or base["name"] not in corr:
        return None
    return corr[r["name"]][1] / corr[base["name"]][1]


def compare(
    real: list[Row],
    sim_run: list[Row],
    sim_fixed: list[Row],
    corr: dict[str, tuple[float, float]],
) -> list[Row]:
    """One row per configuration. ``sim_run``: simulated at each real run's own machine speed
    (the fitted model x that run's drift); ``sim_fixed``: at the fitted speed, to compare with
    the drift-corrected real figures."""
    return [
        {
            **_config_fields(r, corr),
            **_hit_fields(r, s),
            **_latency_fields(real, sim_run, r, s),
            **_fixed_speed_fields(real, sim_fixed, r, f, corr),
            **_routing_fields(r, s),
        }
        for r, s, f in zip(real, sim_run, sim_fixed, strict=True)
    ]


def _config_fields(r: Row, corr: dict[str, tuple[float, float]]) -> Row:
    return {
        "name": r["name"],
        "policy": r["policy"],
        "skew": r["skew"],
        "net_delay_ms": r["net_delay_ms"],
        "requests": r["requests"],
        "errors": r["errors"],
        "drift": corr.get(r["name"], (None, None))[0],
    }


def _hit_fields(r: Row, s: Row) -> Row:
    return {
        "real_actual_hit": r["actual_hit_rate"],
        "sim_actual_hit": s["actual_hit_rate"],
        "hit_diff_points": _diff_points(r["actual_hit_rate"], s["actual_hit_rate"]),
        "real_expected_hit": r["expected_hit_rate"],
        "sim_expected_hit": s["expected_hit_rate"],
    }


def _latency_fields(real: list[Row], sim_run: list[Row], r: Row, s: Row) -> Row:
    """Raw real figures against the simulation at that run's machine speed."""
    rr, sr = _ratio(real, r), _ratio(sim_run, s)
    return {
        "real_mean_s": r["mean_latency_s"],
        "sim_mean_s": s["mean_latency_s"],
        "real_ratio": rr,
        "sim_ratio": sr,
        "ratio_diff_pct": _pct_diff(sr, rr),
    }


def _fixed_speed_fields(
    real: list[Row], sim_fixed: list[Row], r: Row, f: Row, corr: dict[str, tuple[float, float]]
) -> Row:
    """Drift-corrected real figures against the simulation at the fitted speed."""
    rc, fr = _corrected_ratio(real, r, corr), _ratio(sim_fixed, f)
    return {
        "real_mean_corrected_s": corr.get(r["name"], (None, None))[1],
        "sim_fixed_mean_s": f["mean_latency_s"],
        "real_ratio_corrected": rc,
        "sim_fixed_ratio": fr,
        "corrected_ratio_diff_pct": _pct_diff(fr, rc),
    }


def _routing_fields(r: Row, s: Row) -> Row:
    return {
        "real_hotspot": r["hotspot_share"],
        "sim_hotspot": s["hotspot_share"],
        "real_forwarded": r["forwarded_share"],
        "sim_forwarded": s["forwarded_share"],
    }


def _pct_diff(sim: float | None, real: float | None) -> float | None:
    return None if sim is None or real is None or real == 0 else 100 * (sim - real) / real


def _diff_points(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else 100 * (b - a)


def _p(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def _f(v: float | None, fmt: str = ".3f") -> str:
    return "-" if v is None else format(v, fmt)


def _name(r: Row) -> str:
    return f"{r['policy']}, {r['skew']}, {r['net_delay_ms']:g} ms"


def markdown(rows: list[Row]) -> str:
    """Two tables: routing behaviour (hit rates, forwards, hotspot) and latency."""
    a = [
        "| configuration | hit % real | hit % sim | Δ pts | expected % real | expected % sim "
        "| forwarded % real | forwarded % sim | hotspot % real | hotspot % sim |",
        "|" + " --- |" * 10,
    ]
    for r in rows:
        a.append(
            f"| {_name(r)} | {_p(r['real_actual_hit'])} | {_p(r['sim_actual_hit'])} | "
            f"{_f(r['hit_diff_points'], '+.1f')} | {_p(r['real_expected_hit'])} | "
            f"{_p(r['sim_expected_hit'])} | {_p(r['real_forwarded'])} | "
            f"{_p(r['sim_forwarded'])} | {_p(r['real_hotspot'])} | {_p(r['sim_hotspot'])} |"
        )
    b = [
        "| configuration | machine drift | mean s real | mean s sim | /none real | /none sim "
        "| Δ % | /none real, drift-corrected | /none sim, fitted speed | Δ % |",
        "|" + " --- |" * 10,
    ]
    for r in rows:
        b.append(
            f"| {_name(r)} | {_f(r['drift'], '.2f')} | {_f(r['real_mean_s'])} | "
            f"{_f(r['sim_mean_s'])} | {_f(r['real_ratio'])} | {_f(r['sim_ratio'])} | "
            f"{_f(r['ratio_diff_pct'], '+.1f')} | {_f(r['real_ratio_corrected'])} | "
            f"{_f(r['sim_fixed_ratio'])} | {_f(r['corrected_ratio_diff_pct'], '+.1f')} |"
        )
    return "\n".join(a) + "\n\n" + "\n".join(b) + "\n"


def main(args: argparse.Namespace) -> int:
    real_dir = Path(args.validate)
    out = Path(args.out or "sim-validate")
    out.mkdir(parents=True, exist_ok=True)
    cost, fitted_noise = _cost_model(args, real_dir, out)
    noise = fitted_noise if args.service_noise is None else args.service_noise
    real = real_runs(real_dir)
    if not real:
        raise ValueError(f"{real_dir}: no configuration the simulator can replay")
    delays = {r["name"]: float(r["net_delay_ms"]) / 1000.0 for r in real}
    corr = drift_corrected_means(real_dir / "requests.jsonl", cost, delays)
    sim_run, sim_fixed = _simulate_all(real, args, cost, corr, noise)
    rows = compare(real, sim_run, sim_fixed, corr)
    (out / "summary.json").write_text(json.dumps({"runs": sim_run}, indent=2) + "\n")
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


def _cost_model(args: argparse.Namespace, real_dir: Path, out: Path) -> tuple[CostModel, float]:
    """``--cost-model fit``: fitted to the real run's records (written to ``out``), with the
    fit's scatter as the service noise; else the named model, noiseless."""
    from radixmesh.sim import costfit, costs

    if args.cost_model != "fit":
        return costs.resolve(args.cost_model), 0.0
    fit_args = argparse.Namespace(
        from_records=str(real_dir / "requests.jsonl"), runs="", quiet=args.quiet,
        forward_overhead=args.forward_overhead,
    )  # fmt: skip
    doc = costfit.from_records(fit_args)
    (out / "costmodel.json").write_text(json.dumps(doc, indent=2) + "\n")
    return costs.CostModel.from_dict(doc), float(doc["fit"]["rel_rmse"])


def _simulate_all(
    real: list[Row],
    args: argparse.Namespace,
    cost: CostModel,
    corr: dict[str, tuple[float, float]],
    noise: float,
) -> tuple[list[Row], list[Row]]:
    """Each real configuration simulated at its run's speed (``cost`` x drift) and at ``cost``."""
    sim_run, sim_fixed = [], []
    for r in real:
        tokenize, tok_fp = tokenizer_for(args, int(r["nodes"]))
        drift = corr.get(r["name"], (1.0, 0.0))[0]
        sim_run.append(simulate_like(r, args, cost.scaled(drift), tokenize, tok_fp, noise))
        sim_fixed.append(simulate_like(r, args, cost, tokenize, tok_fp, noise))
        if not args.quiet:
            print(f"[validate] {r['name']}: simulated (drift {drift:.2f})", flush=True)
    return sim_run, sim_fixed
