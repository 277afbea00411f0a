#!/usr/bin/env python3
"""How well a node's prefill speed estimate (``core/estimators.py`` ``PrefillFit``) prices a
cold prompt after the scenarios the real cluster showed; prints figures, asserts nothing.

A node's true prefill time is 30 ms + 100 us a work unit, each measurement off by lognormal
noise (``--noise``, 15 %). Scenarios, 40 seeds each:
- steady: 60 prefills of mixed sizes (50, 50, 50, 1,500, 3,000 units);
- burst then hits: those 60, then 40 of mixed sizes on a CPU contended 2.3x, then 25 cache
  hits (40-60 units) at full speed (the hot prefix at Poisson 50 % right after the
  benchmark's capacity probe: least squares, the design before ``10d5db0``, kept the burst's
  rate and priced a cold prompt 2.40x its time here);
- first 8: the first 8 prefills of the steady mix, from the default prior (4 ms + 80 us).
For each: the median and the 5th-95th percentile of the estimate's price of a 3,000-unit
(cold) prefill over its true time, and the median for a 50-unit one (a hit).

    PYTHONPATH=src python scripts/prefill-fit-check.py [--noise 0.15]
"""
from __future__ import annotations

import argparse
import random
import statistics

from radixmesh.core.estimators import CostPriors, PrefillFit

OVERHEAD, RATE = 0.03, 1e-4


def true_s(work: float) -> float:
    return OVERHEAD + RATE * work


def scenario(seed: int, noise: float, calm: int, burst: int, hits: int) -> tuple[float, float]:
    rng = random.Random(seed)
    priors = CostPriors()
    fit = PrefillFit(priors.prefill_overhead_s, priors.prefill_s_per_token)
    steps = ([(rng.choice([50, 50, 50, 1500, 3000]), 1.0) for _ in range(calm)]
             + [(rng.choice([50, 1500, 2000, 3000]), 2.3) for _ in range(burst)]
             + [(rng.choice([40, 50, 60]), 1.0) for _ in range(hits)])
    for work, slowdown in steps:
        fit.observe(work, slowdown * true_s(work) * rng.lognormvariate(0, noise))
    price = lambda work: fit.overhead + fit.rate * work  # noqa: E731
    return price(3000) / true_s(3000), price(50) / true_s(50)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--noise", type=float, default=0.15)
    args = ap.parse_args()
    print(f"{'scenario':18s} {'cold: median [p5, p95]':>26s} {'hit: median':>12s}")
    for name, calm, burst, hits in (("steady", 60, 0, 0), ("burst then hits", 60, 40, 25),
                                    ("first 8", 8, 0, 0)):
        res = [scenario(s, args.noise, calm, burst, hits) for s in range(40)]
        cold = sorted(r[0] for r in res)
        hit = statistics.median(r[1] for r in res)
        print(f"{name:18s} {statistics.median(cold):>10.3f} [{cold[2]:.2f}, {cold[-3]:.2f}]"
              f"{'':5s}{hit:>12.3f}")


if __name__ == "__main__":
    main()
