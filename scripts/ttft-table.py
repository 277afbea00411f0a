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


def regime(folders: list[str]) -> list[str]:
    """One table for a regime's folders: a row per policy; per workload its TTFT mean / p99
    (Poisson · bursty); then TPOT, hit rate and the busiest node's share under Poisson, one
    figure per workload (in the header's order), and the lowest goodput of the policy's runs."""
    cells: dict[str, dict[str, dict[str, dict]]] = {}  # policy -> workload -> schedule -> run
    for folder in folders:
        for r in json.loads((Path(folder) / "summary.json").read_text())["runs"]:
            if r.get("requests") and r.get("schedule") in SCHEDULES:
                work = r.get("workload_kind") or r["workload"]
                cells.setdefault(r["policy"], {}).setdefault(work, {})[r["schedule"]] = r
    works = list(dict.fromkeys(w for by in cells.values() for w in by))
    head = " | ".join(f"{w} TTFT mean / p99 ms" for w in works)
    order = " · ".join(works)
    out = [f"| policy | {head} | TPOT ms ({order}) | hit | busiest node | goodput (lowest) |",
           "|---|" + "---|" * (len(works) + 4)]
    for pol, by in cells.items():
        ttft = [" · ".join(f"{_ms(r.get('mean_ttft_s'))} / {_ms(r.get('p99_ttft_s'))}"
                           for k, r in sorted(by.get(w, {}).items(), key=lambda kv:
                                              SCHEDULES.index(kv[0])))
                for w in works]  # fmt: skip
        poisson = [by.get(w, {}).get("poisson", {}) for w in works]
        low = min((r.get("goodput") or 0.0) for runs in by.values() for r in runs.values())
        out.append(f"| {pol} | {' | '.join(ttft)} | "
                   f"{' · '.join(_ms(r.get('mean_tpot_s')) for r in poisson)} | "
                   f"{' · '.join(_pct0(r.get('actual_hit_rate')) for r in poisson)} | "
                   f"{' · '.join(_pct0(r.get('hotspot_share')) for r in poisson)} | "
                   f"{_pct(low)} |")  # fmt: skip
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
