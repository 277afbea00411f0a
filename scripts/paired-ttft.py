#!/usr/bin/env python3
"""Paired TTFT ratio of two policies in one `radixmesh bench` output, with its 95 % interval.

    python scripts/paired-ttft.py RUN cost smg [--workload rag]

Requests are paired by their position in the workload (every cluster of a batch got the same
arrival schedule); warm-up requests are left out; the interval is the circular block bootstrap
of ``results.run_summary.ratio_interval``. Prints the mean ratio with its interval, the p99
ratio with its interval, and the end-to-end mean ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from radixmesh.results.run_summary import (
    percentile,
    quantile_ratio_interval,
    ratio_interval,
)


def paired(records: list[dict], a: str, b: str, workload: str | None, field: str
           ) -> list[tuple[float, float]]:
    def by(policy: str) -> dict[int, float]:
        return {r["seq"]: r[field] for r in records
                if r["run"].startswith(policy + "-") and not r.get("warmup")
                and r.get(field) is not None
                and (workload is None or f"-w{workload}-" in r["run"])}
    first, second = by(a), by(b)
    return [(first[k], second[k]) for k in sorted(set(first) & set(second))]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", type=Path)
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--workload")
    args = p.parse_args(argv)
    lines = (args.run / "requests.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    ttft = paired(records, args.a, args.b, args.workload, "ttft_s")
    e2e = paired(records, args.a, args.b, args.workload, "latency_s")
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
