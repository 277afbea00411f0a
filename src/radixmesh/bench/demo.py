"""``radixmesh demo``: 4 local nodes, ~300 requests, routing policies side by side.

Starts a fresh 4-node cluster of the built-in ``mini`` engine (random weights, the shipped BPE
tokenizer, 32k context, continuous batching, one torch thread per node) for each of ``none`` (no
routing), ``paper`` (the paper's longest estimated prefix match) and ``cost`` (radixmesh's
cost-model router); replays the same MMLU-shaped workload against them with the paper's
schedule (round-robin entry node, one request at a time); prints a comparison table and writes
a report of what ran (tables + figures).
The synthetic prompts are scaled to a quarter of MMLU's length so the demo fits in about three
minutes on a 2-core machine; ``--mmlu-dir`` uses the real questions instead.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from radixmesh.bench.folder import Ratio, Results
from radixmesh.bench.spec import RunSpec, check_policy
from radixmesh.bench.sweep import run_name
from radixmesh.core.units import parse_duration
from radixmesh.options import add_option
from radixmesh.workload import WorkloadSpec


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/demo", help="report folder (default runs/demo)")
    p.add_argument("--requests", type=int, default=300,
                   help="requests replayed against each policy's cluster (default 300)")
    p.add_argument("--nodes", type=int, default=4, help="nodes per cluster (default 4)")
    add_option(p, "policy", "none,paper,cost", raw=True,  # old name --policies (options.py)
               help="comma-separated routing policies to compare (default none,paper,cost)")
    p.add_argument("--mmlu-dir", help="use MMLU (original release layout) instead of synthetic")
    p.add_argument("--skewed", action="store_true", help="80%% of requests from 20%% of groups")
    p.add_argument("--scale", type=float, default=0.25, help="synthetic prompt length scale")
    add_option(p, "net_delay", 0.002)  # old name --comm-delay (options.py)
    p.add_argument("--gossip-interval", type=parse_duration, default=0.2, metavar="DURATION",
                   help="gossip interval Δpoll, e.g. 200ms (default 200ms)")
    p.add_argument("--cache-tokens", type=int, default=100_000, help="KV budget per node")
    p.add_argument("--threads", type=int, default=1, help="torch threads per node")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the workload and the engines' random weights (default 0)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars (they are off anyway when stderr is not a terminal)")


def specs(args: argparse.Namespace) -> list[RunSpec]:
    w = WorkloadSpec(requests=args.requests, skewed=args.skewed, seed=args.seed,
                     mmlu_dir=args.mmlu_dir, synthetic_scale=args.scale)  # fmt: skip
    base = RunSpec(name="demo", policy="none", workload=w, nodes=args.nodes,
                   net_delay_s=args.net_delay, gossip_interval_s=args.gossip_interval,
                   cache_tokens=args.cache_tokens, threads=args.threads, seed=args.seed,
                   group="t1")  # fmt: skip
    out = []
    for pol in args.policy.split(","):
        spec = replace(base, policy=check_policy(pol.strip()))
        out.append(replace(spec, name=run_name(spec)))
    return out


def comparison(rows: list[dict[str, object]], res: Results) -> str:
    """The demo's table; ``vs none``: paired mean-latency ratio with its 95 % interval."""
    head = (f"{'policy':<13}{'mean':>8}{'p50':>8}{'p99':>8}{'vs none [95% CI]':>24}"
            f"{'exp hit':>9}{'act hit':>9}{'hotspot':>9}{'fwd':>7}{'err':>5}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = res.ratio_ci(r) if r["policy"] != "none" else None
        shown = "1.00x" if r["policy"] == "none" else _x(ratio)
        lines.append(
            f"{r['policy']!s:<13}{_ms(r['mean_latency_s'])}{_ms(r['p50_latency_s'])}"
            f"{_ms(r['p99_latency_s'])}{shown:>24}{_pct(r['expected_hit_rate'])}"
            f"{_pct(r['actual_hit_rate'])}{_pct(r['hotspot_share'])}"
            f"{_pct(r['forwarded_share'], 7)}{r['errors']!s:>5}"
        )
    return "\n".join(lines)


def _ms(x: object) -> str:
    return f"{'—':>8}" if not isinstance(x, float) else f"{x * 1000:>6.0f}ms"


def _pct(x: object, width: int = 9) -> str:
    return f"{'—':>{width}}" if not isinstance(x, float) else f"{100 * x:>{width - 1}.1f}%"


def _x(x: Ratio | None) -> str:
    if x is None:
        return "—"
    ci = "" if x.lo is None or x.hi is None else f" [{x.lo:.2f}, {x.hi:.2f}]"
    return f"{x.value:.2f}x{ci}"


def run(args: argparse.Namespace) -> int:
    from radixmesh.bench.report import write_report
    from radixmesh.bench.runner import Runner

    out = Path(args.out)
    try:
        plan = specs(args)
    except ValueError as exc:
        print(f"radixmesh demo: {exc}", file=sys.stderr)
        return 2
    src = f"MMLU ({args.mmlu_dir})" if args.mmlu_dir else f"synthetic MMLU-shaped x{args.scale}"
    print(f"radixmesh demo: {args.nodes} nodes (mini engine), {args.requests} requests of "
          f"{src}, policies {', '.join(s.policy for s in plan)}", file=sys.stderr)  # fmt: skip
    runner = Runner(out, progress=not args.no_progress, log=lambda m: print(m, file=sys.stderr))
    results = runner.run_all(plan)
    summary = runner.write_summary()
    names = {s.name for s in plan}
    rows = [r for r in summary["runs"] if r["name"] in names and not r.get("skipped")]
    res = Results.load(out)
    print()
    print(comparison(rows, res))
    report = write_report(out)
    print(f"\nreport: {report}  (figures beside it)")
    return 130 if any(r.interrupted for r in results) else 0
