#!/usr/bin/env python3
"""Compare two runs of scripts/router-sim-panel.sh (each possibly several seeds, concatenated):
per case, the geometric mean over its repetitions of b's mean and p99 latency over a's, then
over all cases. Lines pair up by case name and order of appearance.

    scripts/panel-compare.py a.txt b.txt
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from pathlib import Path


def rows(path: str) -> dict[str, list[tuple[float, float]]]:
    """Case name -> (mean s, p99 s) per repetition, in file order."""
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        name, rest = line[:28].strip(), line[28:].split()
        if len(rest) < 3 or not name:
            continue
        try:
            out[name].append((float(rest[1]), float(rest[2])))
        except ValueError:
            continue
    return out


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    a, b = rows(argv[1]), rows(argv[2])
    every_mean: list[float] = []
    every_p99: list[float] = []
    print(f"{'case':28} {'n':>3} {'mean b/a':>9} {'p99 b/a':>8}")
    for case, ra in a.items():
        pairs = list(zip(ra, b.get(case, []), strict=False))
        means = [y[0] / x[0] for x, y in pairs if x[0] > 0 and y[0] > 0]
        p99s = [y[1] / x[1] for x, y in pairs if x[1] > 0 and y[1] > 0]
        if not means or not p99s:
            continue
        every_mean += means
        every_p99 += p99s
        print(f"{case:28} {len(means):>3} {geomean(means):>9.3f} {geomean(p99s):>8.3f}")
    if every_mean:
        print(f"{'every case':28} {len(every_mean):>3} {geomean(every_mean):>9.3f} "
              f"{geomean(every_p99):>8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
