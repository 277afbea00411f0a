#!/usr/bin/env python3
"""How far the entry nodes' predicted TTFT of the node that served each request was from the
TTFT the client measured: one Markdown row per run of a bench folder (median, p90 and mean
of |predicted - actual| / actual, and the mean signed error), from the run's records
(``requests.jsonl``) joined with its nodes' decision logs (``decisions/<run>.jsonl``) by
the entry node and its request number, the last ranking of each request (after any
refusal). Predictions are in the nodes' clock; they are divided by the run's time scale
as the records are.

    scripts/ttft-error.py RUN_DIR [--csv FILE]   # FILE: run, predicted, actual per request
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def pairs(folder: Path, run: str, scale: float) -> list[tuple[float, float]]:
    """(predicted, actual) TTFT of each served request of ``run`` with a prediction."""
    path = folder / "decisions" / f"{run}.jsonl"
    if not path.exists():
        return []
    last: dict[tuple[str, int], dict[str, Any]] = {}
    for d in _jsonl(path):
        if d.get("kind") == "route":
            last[(d["node"], d["request"])] = d  # in order: a re-ranking replaces the first
    out = []
    for rec in _jsonl(folder / "requests.jsonl"):
        if rec.get("run") != run or rec.get("ttft_s") is None or rec.get("request") is None:
            continue
        d = last.get((rec["entry_node"], rec["request"]))
        if d is None:
            continue
        served = next((c for c in d["considered"] if c["node_id"] == rec["served_by"]), None)
        if served is None or served.get("predicted_ttft_s") is None:
            continue
        out.append((served["predicted_ttft_s"] / scale, rec["ttft_s"]))
    return out


def _q(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--csv", type=Path)
    args = ap.parse_args()
    runs = json.loads((args.folder / "summary.json").read_text())["runs"]
    print("| policy | requests | median abs err | p90 abs err | mean abs err | mean signed |")
    print("|---|---|---|---|---|---|")
    lines = ["run,predicted_s,actual_s"]
    for r in runs:
        got = pairs(args.folder, r["name"], float(r.get("time_scale") or 1.0))
        if not got:
            continue
        rel = [(p - a) / a for p, a in got if a > 0]
        err = [abs(x) for x in rel]
        print(f"| {r['policy']} | {len(rel)} | {_q(err, 0.5):.1%} | {_q(err, 0.9):.1%} "
              f"| {statistics.fmean(err):.1%} | {statistics.fmean(rel):+.1%} |")
        lines += [f"{r['name']},{p:.6f},{a:.6f}" for p, a in got]
    if args.csv:
        args.csv.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
