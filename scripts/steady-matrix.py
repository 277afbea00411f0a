#!/usr/bin/env python3
"""The routing regimes at 80 % of the engines' planned capacity, long enough for a steady state.

At 16 H100s' rates ``sim --experiment regimes``' 400 requests last ~0.3 virtual seconds, under
one gossip round (0.5 s): a cold start. This runs each (regime, workload) point for
``--requests`` (default 3,000; the first tenth left out, ~2 s, four gossip rounds) through
``radixmesh sim`` and prints one Markdown row per point and policy: TTFT mean / p99, TPOT, end
to end, goodput, hits. Simulated, every row::

    PYTHONPATH=src python scripts/steady-matrix.py --out runs/steady   # ~40 min of one core

``--loads 0.8,1.5,2,3,4`` runs every point at each load (multiples of the planned capacity,
``sim.sweep.capacity_rate``: what ``none``'s even spread sustains with 85 % of a prompt
cached, so a mesh that caches more, or pools faster engines, sustains several times it; each
load as long in virtual time as the 0.8 point, ``--requests`` x load / 0.8: past capacity a
fixed count measured only the queues' first second, 3,000 agentic requests at 3x on 16 H100s
82 % goodput, 12,000 5 %) and then prints each policy's *sustained load*: the load at which
fewer than ``--attain`` (90 %) of the requests first meet the SLO, interpolated linearly
between the loads run (DistServe's goodput as a rate), and its ratio to the gateway's
(``cache_aware``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REGIMES = {
    "h100-16": ["--profiles", "h100-llama3-8b"],
    "mixed-16": ["--profiles", "h100-llama3-8b:4,a10g-llama3-8b:12"],
    "regions-16": ["--profiles", "h100-llama3-8b", "--regions", "us,eu,ap",
                   "--region-delays", "1,40,40;40,1,40;40,40,1"],
}
WORKLOADS = ("rag", "agentic", "chat", "hotprefix")


def run_point(out: Path, regime: str, workload: str, load: float,
              args: argparse.Namespace) -> Path:
    """One point's simulation (skipped when its summary exists); its folder. A load ``L``
    runs ``--requests`` x L / 0.8 requests: as long in virtual time as the 0.8 point."""
    requests = round(args.requests * load / 0.8)
    folder = out / (f"{regime}-{workload}" if load == 0.8 else f"{regime}-{workload}-x{load:g}")
    if not (folder / "summary.json").exists():
        cmd = [sys.executable, "-m", "radixmesh", "sim", "--nodes", "16", *REGIMES[regime],
               "--workload", workload, "--load", f"{load:g}", "--schedule", args.schedule,
               "--requests", str(requests), "--exclude-warmup", str(requests // 10),
               "--net-delay", "2ms", "--seed", str(args.seed), "--policy", args.policy,
               "--no-records", "--quiet", "--out", str(folder)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return folder


def runs_of(folder: Path) -> list[dict[str, Any]]:
    """One point's runs, as its summary.json holds them."""
    return list(json.loads((folder / "summary.json").read_text())["runs"])


def rows(runs: list[dict[str, Any]], regime: str, workload: str, load: float) -> list[str]:
    base = next((r for r in runs if r["name"] == "none"), None)
    out = []
    for r in runs:
        ratio = "" if base is None else f"{r['mean_ttft_s'] / base['mean_ttft_s']:.2f}"
        tpot = "-" if r["mean_tpot_s"] is None else f"{1e3 * r['mean_tpot_s']:.1f}"
        out.append(
            f"| {regime} | {workload} | {load:g} | {r['name']} | {1e3 * r['mean_ttft_s']:.1f} / "
            f"{1e3 * r['p99_ttft_s']:.1f} | {ratio} | {tpot} | "
            f"{1e3 * r['mean_latency_s']:.0f} | {100 * r['goodput']:.1f} % | "
            f"{100 * r['actual_hit_rate']:.1f} % |")
    return out


def sustained(curve: list[tuple[float, float]], attain: float) -> float | None:
    """The load at which goodput first falls below ``attain``, interpolated linearly between
    the loads run (``curve``: (load, goodput), loads ascending): None when the lowest load
    misses it already, the highest load when none misses it (a lower bound)."""
    if not curve or curve[0][1] < attain:
        return None
    for (lo, g_lo), (hi, g_hi) in itertools.pairwise(curve):
        if g_hi < attain:
            return lo + (hi - lo) * (g_lo - attain) / (g_lo - g_hi)
    return curve[-1][0]


def sustained_table(curves: dict[tuple[str, str], dict[str, list[tuple[float, float]]]],
                    attain: float) -> list[str]:
    """One row per (regime, workload): each policy's sustained load and its ratio to the
    gateway's."""
    out = [f"\n| regime | workload | policy | sustained load (goodput >= {100 * attain:.0f} %, "
           "x planned capacity) | ÷ cache_aware |", "|---|---|---|---|---|"]
    for (regime, workload), pol in curves.items():
        gate = sustained(pol.get("cache_aware", []), attain)
        for name, curve in pol.items():
            s = sustained(curve, attain)
            never_missed = s is not None and s == curve[-1][0]  # a lower bound
            shown = "-" if s is None else f"{'>= ' if never_missed else ''}{s:.2f}"
            ratio = "-" if s is None or not gate else f"{s / gate:.2f}"
            out.append(f"| {regime} | {workload} | {name} | {shown} | {ratio} |")
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
    p.add_argument("--loads", default="0.8", help="comma-separated multiples of the planned "
                   "capacity (default 0.8); more than one adds the sustained-load table")
    p.add_argument("--attain", type=float, default=0.9, help="the sustained load's goodput")
    args = p.parse_args(argv)
    loads = sorted(float(x) for x in args.loads.split(","))
    print("| regime | workload | load | policy | TTFT mean / p99 ms | ÷ none | TPOT ms | e2e ms "
          "| goodput | hit |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    curves: dict[tuple[str, str], dict[str, list[tuple[float, float]]]] = {}
    for regime in args.regimes.split(","):
        for workload in args.workloads.split(","):
            for load in loads:
                runs = runs_of(run_point(args.out, regime, workload, load, args))
                print("\n".join(rows(runs, regime, workload, load)), flush=True)
                for r in runs:
                    curves.setdefault((regime, workload), {}).setdefault(r["name"], []).append(
                        (load, float(r["goodput"] or 0.0)))
    if len(loads) > 1:
        print("\n".join(sustained_table(curves, args.attain)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
