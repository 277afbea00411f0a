"""Sampling a request sequence from grouped questions: uniform or skewed.

Uniform (the paper's main workload): every question of every group in one seeded random
order, truncated to ``n``. Skewed (the paper's variant): ``hot_share`` of requests (80%) come
from a seeded choice of ``hot_fraction`` of the groups (20%, at least one); exact counts,
``round(hot_share * n)`` hot requests, drawn without replacement from the hot groups' questions
(recycled in a fresh order only when exhausted), the rest likewise from the cold groups.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import replace

from radixmesh.workload.request import Request


def uniform(groups: Mapping[str, Sequence[Request]], n: int | None, seed: int) -> list[Request]:
    pool = [r for name in sorted(groups) for r in groups[name]]
    random.Random(seed).shuffle(pool)
    return pool if n is None else _take(pool, n, random.Random(seed + 1))


def hot_groups(names: Sequence[str], hot_fraction: float, seed: int) -> list[str]:
    if not 0 < hot_fraction <= 1:
        raise ValueError("hot_fraction must be in (0, 1]")
    k = max(1, round(hot_fraction * len(names)))
    return sorted(random.Random(f"hot/{seed}").sample(sorted(names), k))


def skewed(
    groups: Mapping[str, Sequence[Request]],
    n: int,
    seed: int,
    hot_fraction: float = 0.2,
    hot_share: float = 0.8,
) -> list[Request]:
    if not 0 <= hot_share <= 1:
        raise ValueError("hot_share must be in [0, 1]")
    rng = random.Random(seed)
    hot = set(hot_groups(list(groups), hot_fraction, seed))
    hot_pool = [r for g in sorted(hot) for r in groups[g]]
    cold_pool = [r for g in sorted(groups) if g not in hot for r in groups[g]]
    n_hot = round(hot_share * n) if cold_pool else n
    picked = _take(hot_pool, n_hot, rng) + _take(cold_pool, n - n_hot, rng)
    rng.shuffle(picked)
    return picked


def _take(pool: Sequence[Request], n: int, rng: random.Random) -> list[Request]:
    """``n`` items without replacement; when the pool runs out, reuse it in a new order with
    ids suffixed ``#k`` so every request id stays unique."""
    if n <= 0:
        return []
    if not pool:
        raise ValueError("cannot draw requests from an empty pool")
    out: list[Request] = []
    rnd = 0
    while len(out) < n:
        order = list(pool)
        rng.shuffle(order)
        need = n - len(out)
        batch = order[:need]
        out.extend(batch if rnd == 0 else [replace(r, id=f"{r.id}#{rnd}") for r in batch])
        rnd += 1
    return out
