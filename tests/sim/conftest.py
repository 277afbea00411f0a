"""Small, hand-made MMLU-shaped workloads for the simulator tests (no generator start-up)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from radixmesh.workload.request import Request


def make_requests(n: int, groups: int = 4, seed: int = 0, prefix_words: int = 120) -> list[Request]:
    """``n`` prompts from ``groups`` families sharing a long prefix, like MMLU subjects."""
    rng = random.Random(seed)
    prefixes = [
        f"Subject {g}: " + " ".join(f"w{g}x{rng.randrange(10**6)}" for _ in range(prefix_words))
        for g in range(groups)
    ]
    out = []
    for i in range(n):
        g = rng.randrange(groups)
        question = " ".join(f"q{rng.randrange(10**6)}" for _ in range(12))
        out.append(Request(id=f"r{i}", prompt=f"{prefixes[g]}\n{question}\nAnswer:", group=f"g{g}"))
    return out


@pytest.fixture
def requests_small() -> list[Request]:
    return make_requests(60)


@pytest.fixture
def make_reqs() -> Callable[..., list[Request]]:
    return make_requests
