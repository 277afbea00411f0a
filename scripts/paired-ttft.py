#!/usr/bin/env python3
"""Paired TTFT ratio of two policies in one `radixmesh bench` output, with its 95 % interval.

    python scripts/paired-ttft.py RUN cost smg [--workload rag]

Requests are paired by id (``bench.folder.Results.pairs``: every cluster of a batch got the
same arrival schedule), warm-up requests left out; the intervals are the circular block
bootstrap of ``results.run_summary``. Prints the mean ratio and the p99 ratio with their
intervals, and the end-to-end mean ratio with its interval.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from radixmesh.bench.folder import Results, Row
from radixmesh.results.run_summary import percentile, quantile_ratio_interval, ratio_interval


def run_of(res: Results, policy: str, workload: str | None) -> Row:
    """The folder's run of ``policy`` (of ``workload``, when the folder has several)."""
    for r in res.runs:
        if r["policy"] == policy and (workload is None or f"-w{workload}-" in r["name"]):
            return r
    raise SystemExit(f"no {policy} run" + ("" if workload is None else f" of {workload}"))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", type=Path)
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--workload")
    args = p.parse_args(argv)
    res = Results.load(args.run)
    a, b = run_of(res, args.a, args.workload), run_of(res, args.b, args.workload)
    ttft, e2e = res.pairs(a, b, "ttft_s"), res.pairs(a, b)
    if len(ttft) < 2:
        print("fewer than two paired requests", file=sys.stderr)
        return 1
    mean = sum(x for x, _ in ttft) / sum(y for _, y in ttft)
    p99 = percentile([x for x, _ in ttft], 99) / percentile([y for _, y in ttft], 99)
    lo, hi = ratio_interval(ttft) or (mean, mean)
    plo, phi = quantile_ratio_interval(ttft, 99) or (p99, p99)
    e2e_mean = sum(x for x, _ in e2e) / sum(y for _, y in e2e)
    e2e_lo, e2e_hi = ratio_interval(e2e) or (e2e_mean, e2e_mean)
    print(f"{args.a} / {args.b}, {len(ttft)} paired requests: TTFT mean {mean:.2f}x "
          f"[{lo:.2f}, {hi:.2f}], p99 {p99:.2f}x [{plo:.2f}, {phi:.2f}]; end to end "
          f"{e2e_mean:.2f}x [{e2e_lo:.2f}, {e2e_hi:.2f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
