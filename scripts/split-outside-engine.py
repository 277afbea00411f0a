#!/usr/bin/env python3
"""Where `cost`'s latency differs from another policy's, request by request: in the engine or
outside it (HTTP, the forward or the gateway's hop, the emulated link).

    scripts/split-outside-engine.py runs/X/requests.jsonl [--against sglang,smg,none]

For each workload (``-w<name>`` at the end of a run name; a run without one is ``-``), the
requests of ``cost`` are paired by ``id`` with the other policy's. Printed per pair of
policies: the total latency difference, the part spent in the serving engines (queue +
service, ``server_timing``), and the difference outside the engine, split by whether `cost`
forwarded the request (mean and median per request, ms) or ran it where it entered.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from typing import Any


def outside(r: dict[str, Any]) -> float:
    timing = r["server_timing"]
    return float(r["latency_s"] - timing["queue"] - timing["service"])


def engine(r: dict[str, Any]) -> float:
    timing = r["server_timing"]
    return float(timing["queue"] + timing["service"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("requests", help="a run's requests.jsonl")
    parser.add_argument("--against", default="sglang,smg,none")
    args = parser.parse_args()
    runs: dict[tuple[str, str], dict[str, dict[str, Any]]] = defaultdict(dict)
    with open(args.requests, encoding="utf-8") as fh:
        for line in fh:
            r = json.loads(line)
            if r.get("status") != 200 or not r.get("server_timing"):
                continue
            name = r["run"]
            workload = name.rsplit("-w", 1)[1] if "-w" in name else "-"
            runs[(workload, r["policy"])][r["id"]] = r
    for workload in sorted({w for w, _ in runs}):
        mine = runs.get((workload, "cost"), {})
        for other in args.against.split(","):
            theirs = runs.get((workload, other), {})
            ids = [i for i in mine if i in theirs]
            if not ids:
                continue
            fwd = [1e3 * (outside(mine[i]) - outside(theirs[i])) for i in ids
                   if mine[i]["route"] != "local"]
            loc = [1e3 * (outside(mine[i]) - outside(theirs[i])) for i in ids
                   if mine[i]["route"] == "local"]
            total = sum(mine[i]["latency_s"] - theirs[i]["latency_s"] for i in ids)
            eng = sum(engine(mine[i]) - engine(theirs[i]) for i in ids)

            def stat(xs: list[float]) -> str:
                if not xs:
                    return "n=0"
                return f"n={len(xs)} mean {statistics.mean(xs):+.2f} median " \
                       f"{statistics.median(xs):+.2f} ms"

            print(f"{workload} cost vs {other} ({len(ids)} pairs): total {total:+.3f} s, "
                  f"engine {eng:+.3f} s; outside the engine: forwarded {stat(fwd)}; "
                  f"local {stat(loc)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
