"""The experiments behind docs/scale.md, each a function returning JSON-able rows.

* ``convergence``: an idle cluster of N nodes joins (time until every node routes to every
  other), then a random node's cache changes (``--trials`` times); the time until each other
  node's view holds the new version is measured (polled every ``interval/50``). Also the idle
  gossip bandwidth per node. Direct (delta to every peer each round, the paper's
  dissemination) vs epidemic (fanout k).
* ``scale``: the usual sweep over N with requests proportional to N, open-loop at a fixed load
  (the ratio to ``none`` at each N is what the plot shows).
* ``pushback``: hotspot share and tail latency near saturation, push-back on vs off.
* ``breakeven``: the one-way network delay at which forwarding to a node that holds the shared
  prefix stops paying, from the cost model, against prompt length and model cost; checked by
  simulating paper vs none over a delay sweep.

Plots are written by :mod:`radixmesh.sim.plots`. Over 400 lines because the four experiments
share one dispatcher, logger and checkpoint, and are read together with docs/scale.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from radixmesh.core.config import GossipConfig, GossipMode
from radixmesh.core.events import CacheChanged
from radixmesh.core.router import Policy, RouterConfig
from radixmesh.core.units import parse_duration
from radixmesh.results.run_summary import percentile
from radixmesh.sim import costs
from radixmesh.sim.costs import CostModel
from radixmesh.sim.network import NetworkConfig
from radixmesh.sim.runner import SimSpec
from radixmesh.sim.runner import run as run_sim
from radixmesh.sim.shell import (
    ClusterConfig,
    SimCluster,
    estimate_version,
    routable_count,
    summary_version,
)
from radixmesh.sim.sweep import (
    mean_prompt_tokens,
    parse_policies,
    requests_for,
    split_csv,
    sweep_point,
    tokenizer_for,
)

LogFn = Callable[[str], None]


def _log(args: argparse.Namespace) -> LogFn:
    if getattr(args, "quiet", False):
        return lambda _m: None
    return lambda m: print(f"[experiment] {m}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- convergence
def convergence(
    nodes: int,
    mode: GossipMode,
    interval_s: float,
    delay_s: float = 0.002,
    fanout: int = 3,
    seed: int = 0,
    change_blocks: int = 32,
    announce_gap_s: float | None = None,
    trials: int = 5,
    max_join_s: float = 120.0,
    seeds: int = 3,
) -> dict[str, Any]:
    """Join time, then convergence time of ``trials`` cache changes (each at a random node, at a
    random phase of its gossip round), in an idle cluster."""
    gossip = GossipConfig.for_interval(
        interval_s, mode=mode, fanout=fanout, announce_gap_s=announce_gap_s
    )
    cl = SimCluster(_idle_config(nodes, gossip, delay_s, seed, min(seeds, nodes), interval_s))
    wall0 = time.perf_counter()
    cl.start()
    step = interval_s / 50
    joined_at = _run_until(cl, step, max_join_s, lambda: _all_joined(cl))
    idle_bytes, idle_msgs = _idle_gossip(cl, interval_s)
    seen = _change_trials(cl, interval_s, step, seed, trials, change_blocks)
    return {
        "nodes": nodes,
        "mode": mode.value,
        "fanout": fanout if mode is GossipMode.EPIDEMIC else None,
        "interval_s": interval_s,
        "delay_s": delay_s,
        "seeds": min(seeds, nodes - 1),
        "join_s": joined_at,
        "trials": trials,
        **_convergence_stats(seen, nodes, interval_s),
        "idle_bytes_per_node_s": idle_bytes,
        "idle_messages_per_node_s": idle_msgs,
        "wall_s": time.perf_counter() - wall0,
        "events": cl.loop.events,
    }


def _idle_config(
    nodes: int, gossip: GossipConfig, delay_s: float, seed: int, seeds: int, interval_s: float
) -> ClusterConfig:
    return ClusterConfig(
        nodes=nodes,
        cost=costs.resolve("cpu-tiny"),
        router=RouterConfig(policy=Policy.PAPER),
        gossip=gossip,
        network=NetworkConfig(delay_s=delay_s),
        seed=seed,
        seeds=seeds,
        start_spread_s=interval_s,
    )


def _idle_gossip(cl: SimCluster, interval_s: float) -> tuple[float, float]:
    """Let membership settle, then gossip (bytes, messages) per node per second over a few
    idle rounds."""
    nodes = cl.config.nodes
    cl.loop.run(until=cl.loop.now + 2 * interval_s)
    b0, m0, t0 = cl.counters.gossip_bytes, cl.counters.gossip_messages, cl.loop.now
    cl.loop.run(until=t0 + 4 * interval_s)
    idle_span = cl.loop.now - t0
    idle_bytes = (cl.counters.gossip_bytes - b0) / nodes / idle_span
    idle_msgs = (cl.counters.gossip_messages - m0) / nodes / idle_span
    return idle_bytes, idle_msgs


def _change_trials(
    cl: SimCluster, interval_s: float, step: float, seed: int, trials: int, change_blocks: int
) -> list[list[float]]:
    """Changes at random nodes and random phases of their gossip rounds; per change, the sorted
    seconds until each other node's view held it (every view polled every ``step``)."""
    pick = random.Random(f"convergence/{seed}")
    out = []
    for trial in range(trials):
        cl.loop.run(until=cl.loop.now + pick.random() * interval_s)
        origin = cl.nodes[pick.randrange(cl.config.nodes)]
        first = 10**12 + trial * change_blocks
        t_change = cl.loop.now
        cl.feed(origin, CacheChanged(tuple(range(first, first + change_blocks)), ()))
        limit = max(60.0, 40 * interval_s)
        out.append(sorted(_time_to_see(cl, origin.idx, t_change, step, limit)))
    return out


def _convergence_stats(seen: list[list[float]], nodes: int, interval_s: float) -> dict[str, Any]:
    """Means over the changes of the median (nearest-rank p50) and last node's time; changes
    some node missed."""
    maxima = [times[-1] for times in seen if times]
    medians = [percentile(times, 50) or 0.0 for times in seen if times]
    return {
        "unconverged_trials": sum(1 for times in seen if len(times) < nodes - 1),
        "converge_p50_s": statistics.mean(medians) if medians else None,
        "converge_max_s": statistics.mean(maxima) if maxima else None,
        "converge_max_worst_s": max(maxima) if maxima else None,
        "converge_rounds_max": statistics.mean(maxima) / interval_s if maxima else None,
    }


def _time_to_see(
    cl: SimCluster, origin: int, t_change: float, step: float, limit: float
) -> list[float]:
    """Seconds after ``t_change`` at which each other node's view held ``origin``'s new
    version (polled every ``step``)."""
    target = summary_version(cl.nodes[origin].core)
    peer = cl.nodes[origin].node_id
    pending = {n.idx for n in cl.nodes if n.idx != origin}
    seen: list[float] = []

    def done() -> bool:
        for idx in list(pending):
            if (estimate_version(cl.nodes[idx].core, peer) or 0) >= target:
                pending.discard(idx)
                seen.append(cl.loop.now - t_change)
        return not pending

    _run_until(cl, step, limit, done)
    return seen


def _all_joined(cl: SimCluster) -> bool:
    want = cl.config.nodes - 1
    return all(routable_count(n.core) >= want for n in cl.nodes)


def _run_until(cl: SimCluster, step: float, limit: float, done: Callable[[], bool]) -> float | None:
    start = cl.loop.now
    while cl.loop.now - start < limit:
        if done():
            return cl.loop.now - start
        cl.loop.run(until=cl.loop.now + step)
    return None


# ------------------------------------------------------------------------------- breakeven
def breakeven_delay_s(
    cost: CostModel, prompt_tokens: int, shared: float, local_frac: float
) -> float:
    """One-way delay below which a forward to a node caching ``shared`` of the prompt beats
    local execution with ``local_frac`` of it cached (idle nodes, the cost model's times)."""
    remote_c = int(prompt_tokens * shared)
    local_c = int(prompt_tokens * local_frac)
    saving = cost.prefill_s(prompt_tokens - local_c, local_c) - cost.prefill_s(
        prompt_tokens - remote_c, remote_c
    )
    return max(0.0, (saving - cost.forward_overhead_s) / 2)


def breakeven_table(
    models: list[CostModel], lengths: list[int], shared: float = 0.85
) -> list[dict[str, Any]]:
    rows = []
    for m in models:
        for length in lengths:
            rows.append(
                {
                    "cost_model": m.name,
                    "prompt_tokens": length,
                    "shared": shared,
                    "breakeven_one_way_s_cold_local": breakeven_delay_s(m, length, shared, 0.0),
                    "breakeven_one_way_s_header_local": breakeven_delay_s(m, length, shared, 0.03),
                    "prefill_cold_s": m.prefill_s(length, 0),
                    "prefill_warm_s": m.prefill_s(
                        length - int(length * shared), int(length * shared)
                    ),
                }
            )
    return rows


# ------------------------------------------------------------------------------- dispatch
def main(args: argparse.Namespace) -> int:
    out = Path(args.out or f"sim-{args.experiment}")
    out.mkdir(parents=True, exist_ok=True)
    log = _log(args)
    if args.experiment == "convergence":
        rows = run_convergence(args, log)
    elif args.experiment == "breakeven":
        rows = run_breakeven(args, log)
    elif args.experiment == "scale":
        rows = run_scale(args, log)
    elif args.experiment == "pushback":
        rows = run_pushback(args, log)
    else:
        raise ValueError(f"unknown experiment {args.experiment!r}")
    path = out / f"{args.experiment}.json"
    path.write_text(json.dumps({"experiment": args.experiment, "rows": rows}, indent=2) + "\n")
    from radixmesh.sim import plots

    for png in plots.plot_experiment(args.experiment, rows, out):
        log(f"wrote {png}")
    print(f"wrote {path}")
    return 0


def run_convergence(args: argparse.Namespace, log: LogFn) -> list[dict[str, Any]]:
    modes = [m for m in split_csv(args.gossip_mode) if m != "auto"] or ["delta", "epidemic"]
    rows = []
    for n in (int(x) for x in split_csv(args.nodes)):
        for mode_text in modes:
            mode = GossipMode.parse(mode_text)
            interval = (
                1.0 if args.gossip_interval == "auto" else parse_duration(args.gossip_interval)
            )
            row = convergence(
                n,
                mode,
                interval,
                parse_duration(split_csv(args.net_delay)[0]),
                args.gossip_fanout,
                args.seed,
                seeds=args.seeds,
                trials=args.trials,
                announce_gap_s=args.gossip_announce,
            )
            log(
                f"N={n} {mode.value}: joined in {_s(row['join_s'])}, change seen by all in "
                f"{_s(row['converge_max_s'])} (median node {_s(row['converge_p50_s'])}), idle "
                f"{row['idle_bytes_per_node_s']:.0f} B/node/s; {row['wall_s']:.1f}s wall"
            )
            rows.append(row)
            _checkpoint(args, rows)
    return rows


def _checkpoint(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """Rows so far, so a long sweep cut short keeps what finished."""
    out = Path(args.out or f"sim-{args.experiment}")
    out.mkdir(parents=True, exist_ok=True)
    doc = {"experiment": args.experiment, "rows": rows, "partial": True}
    (out / f"{args.experiment}.json").write_text(json.dumps(doc, indent=2) + "\n")


def _s(v: float | None) -> str:
    return "never" if v is None else f"{v:.2f}s"


def run_breakeven(args: argparse.Namespace, log: LogFn) -> list[dict[str, Any]]:
    models = [costs.resolve(m) for m in split_csv(args.cost_model)]
    lengths = [256, 540, 1024, 2048, 3000, 4096, 8192, 16384]
    rows = breakeven_table(models, lengths)
    for r in rows:
        r["kind"] = "analytic"
        log(
            f"{r['cost_model']} L={r['prompt_tokens']}: a forward to a warm node beats a cold "
            f"local prefill below {r['breakeven_one_way_s_cold_local'] * 1e3:.1f} ms one-way"
        )
    for model in models:
        for scale in BREAKEVEN_SCALES:
            row = simulated_breakeven(args, model, scale)
            log(
                f"{model.name} ~{row['prompt_tokens']:.0f} tokens (simulated, paper vs none, "
                f"{args.nodes} nodes): routing pays below {_ms(row['simulated_breakeven_s'])}; "
                f"paper/none {row['ratios']}, cost/none {row['cost_ratios']}"
            )
            rows.append(row)
    return rows


BREAKEVEN_SCALES = (0.5, 1.0, 2.0, 4.0)  # synthetic prompt length multipliers
BREAKEVEN_DELAYS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)  # one-way, seconds


def _ms(v: float | None) -> str:
    return "never (within the sweep)" if v is None else f"{v * 1e3:.0f} ms one-way"


def simulated_breakeven(args: argparse.Namespace, model: CostModel, scale: float) -> dict[str, Any]:
    """``paper``/``none`` mean latency over a delay sweep; the crossing of 1 (log-interpolated)."""
    tokenize, tok_fp = tokenizer_for(args, int(split_csv(args.nodes)[0]))
    point = argparse.Namespace(**{**vars(args), "synthetic_scale": scale})
    reqs = requests_for(point, False, int(split_csv(args.nodes)[0]))
    prompt_tokens = mean_prompt_tokens(reqs, tokenize)

    def mean_latency(policy: Policy, delay: float) -> float:
        cfg = ClusterConfig(
            nodes=int(split_csv(args.nodes)[0]),
            cost=model,
            router=RouterConfig(policy=policy, context_scale=model.context_scale),
            tuned_priors=True,  # each hardware regime with priors that fit it
            gossip=GossipConfig.for_interval(0.5),
            network=NetworkConfig(delay_s=delay),
            cache_tokens=args.cache_tokens,
            seed=args.seed,
            tokenizer=tok_fp,
        )
        res = run_sim(SimSpec(policy.value, cfg, schedule="sequential"), reqs, tokenize)
        return float(res.summary["mean_latency_s"])

    base = mean_latency(Policy.NONE, BREAKEVEN_DELAYS[0])  # none never forwards
    ratios = {d: mean_latency(Policy.PAPER, d) / base for d in BREAKEVEN_DELAYS}
    cost_ratios = {d: mean_latency(Policy.COST, d) / base for d in BREAKEVEN_DELAYS}
    return {
        "kind": "simulated",
        "cost_model": model.name,
        "prompt_tokens": prompt_tokens,
        "synthetic_scale": scale,
        "requests": len(reqs),
        "ratios": {f"{d * 1e3:g}ms": round(r, 3) for d, r in ratios.items()},
        "simulated_breakeven_s": _crossing(ratios),
        "cost_ratios": {f"{d * 1e3:g}ms": round(r, 3) for d, r in cost_ratios.items()},
        "cost_breakeven_s": _crossing(cost_ratios),
    }


def _crossing(ratios: dict[float, float]) -> float | None:
    """First delay where the ratio crosses 1 upwards, interpolated in log(delay)."""
    pts = sorted(ratios.items())
    if pts and pts[0][1] >= 1.0:
        return None
    for (d0, r0), (d1, r1) in itertools.pairwise(pts):
        if r0 < 1.0 <= r1:
            f = (1.0 - r0) / (r1 - r0)
            return math.exp(math.log(d0) + f * (math.log(d1) - math.log(d0)))
    return None


def _sweep(args: argparse.Namespace, log: LogFn, **override: Any) -> list[dict[str, Any]]:
    """The ordinary ``radixmesh sim`` sweep at each N, requests scaled with N."""
    cost = costs.resolve(args.cost_model)
    policies = parse_policies(args.policy)
    delays = [parse_duration(d) for d in split_csv(args.net_delay)]
    many = {"nodes": True, "delay": len(delays) > 1, "interval": False, "skew": True}
    rows = []
    for n in (int(x) for x in split_csv(args.nodes)):
        for skew in split_csv(args.skew):
            per_node = args.requests_per_node
            reqs = max(args.requests, per_node * n) if per_node else args.requests
            point = argparse.Namespace(**{**vars(args), **override, "requests": reqs})
            for res in sweep_point(point, cost, policies, n, delays, skew, many):
                rows.append(res.summary)
                _checkpoint(args, rows)
                s = res.summary
                log(
                    f"{s['name']}: mean {s['mean_latency_s']:.3f}s p99 {s['p99_latency_s']:.3f}s "
                    f"hit {s['actual_hit_rate']:.1%} hotspot {s['hotspot_share']:.1%} "
                    f"({s['sim']['wall_s']:.0f}s wall)"
                )
    return rows


def run_scale(args: argparse.Namespace, log: LogFn) -> list[dict[str, Any]]:
    return _sweep(args, log)


def run_pushback(args: argparse.Namespace, log: LogFn) -> list[dict[str, Any]]:
    rows = []
    for label, threshold in (("on", args.pushback_threshold), ("off", PUSHBACK_OFF)):
        for row in _sweep(args, log, pushback_threshold=threshold):
            row["pushback"] = label
            row["name"] += f"/pushback-{label}"
            rows.append(row)
    return rows


PUSHBACK_OFF = 1_000_000  # a queue threshold never reached: push-back disabled
