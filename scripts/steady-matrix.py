#!/usr/bin/env python3
"""The routing regimes at 80 % of the engines' planned capacity, long enough for a steady state.

At 16 H100s' rates ``sim --experiment regimes``' 400 requests last ~0.3 virtual seconds, under
one gossip round (0.5 s): a cold start. This runs each (regime, workload) point for
``--requests`` (default 3,000; the first tenth left out, ~2 s, four gossip rounds) through
``radixmesh sim`` and prints one Markdown row per point and policy: TTFT mean / p99, TPOT, end
to end, goodput, hits. Simulated, every row::

    PYTHONPATH=src python scripts/steady-matrix.py --out runs/steady   # ~40 min of one core
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REGIMES = {
    "h100-16": ["--profiles", "h100-llama3-8b"],
    "mixed-16": ["--profiles", "h100-llama3-8b:4,a10g-llama3-8b:12"],
    "regions-16": ["--profiles", "h100-llama3-8b", "--regions", "us,eu,ap",
                   "--region-delays", "1,40,40;40,1,40;40,40,1"],
}
WORKLOADS = ("rag", "agentic", "chat", "hotprefix")


def run_point(out: Path, regime: str, workload: str, args: argparse.Namespace) -> Path:
    """One point's simulation (skipped when its summary exists); its folder."""
    folder = out / f"{regime}-{workload}"
    if not (folder / "summary.json").exists():
        cmd = [sys.executable, "-m", "radixmesh", "sim", "--nodes", "16", *REGIMES[regime],
               "--workload", workload, "--load", "0.8", "--schedule", args.schedule,
               "--requests", str(args.requests), "--exclude-warmup", str(args.requests // 10),
               "--net-delay", "2ms", "--seed", str(args.seed), "--policy", args.policy,
               "--no-records", "--quiet", "--out", str(folder)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return folder


def rows(folder: Path, regime: str, workload: str) -> list[str]:
    runs = json.loads((folder / "summary.json").read_text())["runs"]
    base = next((r for r in runs if r["name"] == "none"), None)
    out = []
    for r in runs:
        ratio = "" if base is None else f"{r['mean_ttft_s'] / base['mean_ttft_s']:.2f}"
        tpot = "-" if r["mean_tpot_s"] is None else f"{1e3 * r['mean_tpot_s']:.1f}"
        out.append(
            f"| {regime} | {workload} | {r['name']} | {1e3 * r['mean_ttft_s']:.1f} / "
            f"{1e3 * r['p99_ttft_s']:.1f} | {ratio} | {tpot} | "
            f"{1e3 * r['mean_latency_s']:.0f} | {100 * r['goodput']:.1f} % | "
            f"{100 * r['actual_hit_rate']:.1f} % |")
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("steady"))
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--schedule", default="poisson")
    p.add_argument("--policy", default="none,cost,cache_aware,llmd")
    p.add_argument("--regimes", default=",".join(REGIMES))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    args = p.parse_args(argv)
    print("| regime | workload | policy | TTFT mean / p99 ms | ÷ none | TPOT ms | e2e ms "
          "| goodput | hit |")
    print("|---|---|---|---|---|---|---|---|---|")
    for regime in args.regimes.split(","):
        for workload in args.workloads.split(","):
            folder = run_point(args.out, regime, workload, args)
            print("\n".join(rows(folder, regime, workload)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
