#!/usr/bin/env python3
"""How far the entry nodes' predicted TTFT of the node that served each request was from the
TTFT the client measured: one Markdown row per run of a bench folder (median, p90 and mean
of |predicted - actual| / actual, and the mean signed error), from the run's records
(``requests.jsonl``) joined with its nodes' decision logs (``decisions/<run>.jsonl``) by
the entry node and its request number, the last ranking of each request (after any
refusal). Predictions are in the nodes' clock; they are divided by the run's time scale
as the records are.

    scripts/ttft-error.py RUN_DIR [--csv FILE] [--breakdown]

``--csv FILE``: run, predicted, actual, route, first per request. ``--breakdown``: one more
row per run and kind of request: served where it entered (``local``: the entry node's own
shadow, exact but for the profile's error) or forwarded (the entry's aged copy of the
peer's gossiped batch), and the first request of its prefix group against later ones.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from radixmesh.results.decisions import last_rankings, served_view
from radixmesh.results.run_summary import prediction_errors


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def pairs(folder: Path, run: str, scale: float) -> list[tuple[float, float, str, bool]]:
    """(predicted, actual, route, first of its group) TTFT of each served request of ``run``
    with a prediction, in the order sent."""
    rankings = last_rankings(folder, run)
    if not rankings:
        return []
    out = []
    seen: set[Any] = set()
    records = [r for r in _jsonl(folder / "requests.jsonl") if r.get("run") == run]
    for rec in sorted(records, key=lambda r: r.get("t_send") or 0.0):
        first = rec.get("group") not in seen
        seen.add(rec.get("group"))
        if rec.get("ttft_s") is None or rec.get("request") is None:
            continue
        served = served_view(rankings, rec)
        if served is None or served.get("predicted_ttft_s") is None:
            continue
        route = "local" if rec.get("route") == "local" else "forwarded"
        out.append((served["predicted_ttft_s"] / scale, rec["ttft_s"], route, first))
    return out


def _row(name: str, got: list[tuple[float, float, str, bool]]) -> str:
    e = prediction_errors([(p, a) for p, a, _, _ in got])
    if not e["n"]:
        return f"| {name} | 0 | | | | |"
    return (f"| {name} | {e['n']} | {e['abs_p50']:.1%} | {e['abs_p90']:.1%} "
            f"| {e['abs_mean']:.1%} | {e['signed_mean']:+.1%} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--csv", type=Path)
    ap.add_argument("--breakdown", action="store_true", help="rows by route and first-ness")
    args = ap.parse_args()
    runs = json.loads((args.folder / "summary.json").read_text())["runs"]
    print("| policy | requests | median abs err | p90 abs err | mean abs err | mean signed |")
    print("|---|---|---|---|---|---|")
    lines = ["run,predicted_s,actual_s,route,first"]
    for r in runs:
        got = pairs(args.folder, r["name"], float(r.get("time_scale") or 1.0))
        if not got:
            continue
        print(_row(r["policy"], got))
        if args.breakdown:
            for route in ("local", "forwarded"):
                print(_row(f"{r['policy']}: {route}", [g for g in got if g[2] == route]))
            print(_row(f"{r['policy']}: first of its group", [g for g in got if g[3]]))
            print(_row(f"{r['policy']}: later", [g for g in got if not g[3]]))
        lines += [f"{r['name']},{p:.6f},{a:.6f},{route},{int(first)}"
                  for p, a, route, first in got]
    if args.csv:
        args.csv.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
