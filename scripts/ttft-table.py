#!/usr/bin/env python3
"""Print one Markdown row per run of a bench folder: TTFT mean / p99, TPOT, goodput, hit rate,
forwarded share, the busiest node's share and the emulated engines' lag (docs/benchmarks.md);
one table per workload × arrival schedule of each folder.

    scripts/ttft-table.py runs/X [runs/Y ...]
    scripts/ttft-table.py --regime runs/X [runs/Y ...]   # one compact table for a regime
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{1000 * v:.1f}"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.1f} %"


def _pct0(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.0f} %"


SCHEDULES = ("poisson", "bursty")


def groups(folder: Path) -> dict[str, list[dict]]:
    """The folder's runs by workload and arrival schedule (one table each), in run order."""
    out: dict[str, list[dict]] = {}
    for r in json.loads((folder / "summary.json").read_text())["runs"]:
        if r.get("requests"):
            key = f"{r.get('workload_kind') or r['workload']}, {r.get('schedule') or 'closed'}"
            out.setdefault(key, []).append(r)
    return out


def rows(runs: list[dict]) -> list[str]:
    base = next((r for r in runs if r["policy"] == "none"), None)
    out = []
    for r in runs:
        ratio = "—"
        if base and base.get("mean_ttft_s") and r.get("mean_ttft_s"):
            ratio = f"{r['mean_ttft_s'] / base['mean_ttft_s']:.2f}"
        lag = (r.get("engine_lag") or {}).get("share")
        out.append(" | ".join([
            "", r["policy"], str(r["requests"] - r["errors"]), _ms(r.get("mean_ttft_s")), ratio,
            _ms(r.get("p99_ttft_s")), _ms(r.get("mean_tpot_s")), _pct(r.get("goodput")),
            _pct(r.get("actual_hit_rate")), _pct(r.get("forwarded_share")),
            _pct(r.get("hotspot_share")), _pct(lag), ""]).strip())
    return out


def _pair(runs: dict[str, dict], field: str, fmt: Callable[[float | None], str]) -> str:
    return " · ".join(fmt(runs[k].get(field)) for k in SCHEDULES if k in runs)


def regime(folders: list[str]) -> list[str]:
    """One table for a regime's folders: a row per workload and policy, Poisson · bursty in
    each cell (TTFT mean / p99 ms, TPOT ms, goodput, hit rate, busiest node's share)."""
    cells: dict[tuple[str, str], dict[str, dict]] = {}
    for folder in folders:
        for r in json.loads((Path(folder) / "summary.json").read_text())["runs"]:
            if r.get("requests"):
                key = (r.get("workload_kind") or r["workload"], r["policy"])
                cells.setdefault(key, {})[r.get("schedule") or "closed"] = r
    out = ["| workload | policy | TTFT mean / p99 ms: Poisson · bursty | TPOT ms | goodput | "
           "hit | busiest node | worst lag |", "|---|---|---|---|---|---|---|---|"]
    for (work, pol), runs in cells.items():
        ttft = " · ".join(f"{_ms(r.get('mean_ttft_s'))} / {_ms(r.get('p99_ttft_s'))}"
                          for k, r in runs.items() if k in SCHEDULES)  # fmt: skip
        lag = max(((r.get("engine_lag") or {}).get("share") or 0.0) for r in runs.values())
        out.append(f"| {work} | {pol} | {ttft} | {_pair(runs, 'mean_tpot_s', _ms)} | "
                   f"{_pair(runs, 'goodput', _pct0)} | {_pair(runs, 'actual_hit_rate', _pct0)} | "
                   f"{_pair(runs, 'hotspot_share', _pct0)} | {_pct(lag)} |")  # fmt: skip
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["--regime"]:
        print("\n".join(regime(argv[1:])))
        return 0
    for folder in argv:
        for key, runs in groups(Path(folder)).items():
            print(f"\n{folder}: {key} ({runs[0].get('schedule_text', '')})\n")
            print("| policy | ok | TTFT mean ms | ÷ none | TTFT p99 ms | TPOT mean ms | goodput | "
                  "hit | fwd | busiest node | engine lag |")
            print("|---|---|---|---|---|---|---|---|---|---|---|")
            for line in rows(runs):
                print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
