#!/usr/bin/env python3
"""Draw one regime's TTFT CDFs: one panel per workload × arrival schedule, one curve per
policy, from the bench folders given (their requests.jsonl, warm-up left out) into one PNG.

    scripts/ttft-cdf.py docs/img/ttft_cdf_h100x16.png runs/X [runs/Y ...] [--title T]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from radixmesh.bench import plots
from radixmesh.bench.folder import Results


def merged(folders: list[Path]) -> Results:
    """The runs and records of several folders as one (run names differ by workload)."""
    loaded = [Results.load(f) for f in folders]
    names = [r["name"] for res in loaded for r in res.runs]
    if len(names) != len(set(names)):
        raise ValueError("folders: the same run name twice; give one folder per workload")
    return Results([r for res in loaded for r in res.runs],
                   {k: v for res in loaded for k, v in res.records.items()})  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("png", type=Path)
    p.add_argument("folders", type=Path, nargs="+")
    p.add_argument("--title", default="")
    a = p.parse_args()
    if not plots.ttft_cdf(merged(a.folders), a.png, a.title):
        raise SystemExit("no open-loop runs with TTFTs of two policies in those folders")
    print(a.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
