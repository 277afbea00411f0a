"""The side-channel harness's statistics (bench/sidechannel.py) on samples with known answers."""

from __future__ import annotations

import random
from collections import Counter

from radixmesh.bench.sidechannel import homogeneity_p, mann_whitney_p, median_diff_ci


def test_mann_whitney_separates_a_shift_and_not_one_distribution() -> None:
    rng = random.Random(1)
    a = [rng.gauss(0.03, 0.005) for _ in range(200)]
    b = [rng.gauss(0.12, 0.005) for _ in range(200)]
    same = [rng.gauss(0.03, 0.005) for _ in range(200)]
    assert mann_whitney_p(a, b) < 1e-30
    assert mann_whitney_p(a, same) > 0.01
    assert mann_whitney_p([1.0] * 30, [1.0] * 30) == 1.0  # all tied


def test_median_difference_and_its_interval() -> None:
    rng = random.Random(2)
    a = [rng.gauss(0.05, 0.002) for _ in range(300)]
    b = [x + 0.010 for x in a]
    diff, low, high = median_diff_ci(a, b)
    assert abs(diff + 0.010) < 1e-12 and low < diff < high < 0
    diff, low, high = median_diff_ci(a, [rng.gauss(0.05, 0.002) for _ in range(300)])
    assert low < 0 < high and abs(diff) < 0.001


def test_homogeneity_of_a_field() -> None:
    assert homogeneity_p(Counter({"0": 200}), Counter({"0": 200})) == 1.0
    assert homogeneity_p(Counter({"2016": 200}), Counter({"16": 200})) < 0.001
    assert homogeneity_p(Counter({"n1": 100, "n2": 100}), Counter({"n1": 98, "n2": 102})) > 0.5
