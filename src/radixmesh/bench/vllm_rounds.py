"""``vllm_check --rounds N``: the policies alternated over repeated rounds on the same engines,
judged by their paired latency ratio with a bootstrap interval.

Theory of operation
-------------------
Run back to back, the second policy meets another machine than the first: the box's load
drifts (other work shares its cores), the engines warm up, their compile caches fill. With
``--rounds N`` every policy runs the whole workload N times, round ``k`` in the given order
for even ``k`` and reversed for odd ``k`` (A B, B A, A B, ...: a drift that favours whoever
runs second favours each policy equally), each run on reset caches with a fresh pair of
nodes, exactly as a single run.

Each request then has one latency per policy per round; :func:`pairs` pairs policy A's with
B's (same request, same round; a request that failed under either is left out) in round and
request order. The mean ratio is ``sum(A) / sum(B)`` over the pairs with
``results.run_summary.ratio_interval``'s circular block bootstrap (neighbouring requests share a
queue and a cache state); the p99 ratio uses the same block resampling
(``results.run_summary.quantile_ratio_interval``). Issue #52's reading: "A <= B" when the point
estimate is <= 1.00 and the interval's upper bound < 1.05.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixmesh.results.records import Record
from radixmesh.results.run_summary import percentile, quantile_ratio_interval, ratio_interval


def round_orders(policies: Sequence[str], rounds: int) -> list[list[str]]:
    """The policies' order in each round: as given, then reversed, alternately."""
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    return [list(policies) if k % 2 == 0 else list(reversed(policies)) for k in range(rounds)]


def pairs(a: Sequence[Sequence[Record]], b: Sequence[Sequence[Record]]
          ) -> list[tuple[float, float]]:
    """``(latency under A, latency under B)`` per request and round, both ok, in round and
    request order (``a[k]``, ``b[k]``: the records of round ``k``)."""
    out: list[tuple[float, float]] = []
    for ra, rb in zip(a, b, strict=True):
        other = {r.seq: r for r in rb if r.ok}
        out.extend((r.latency_s, other[r.seq].latency_s)
                   for r in sorted(ra, key=lambda r: r.seq) if r.ok and r.seq in other)
    return out


def paired_figures(a: Sequence[Sequence[Record]], b: Sequence[Sequence[Record]]
                   ) -> dict[str, Any]:
    """A against B over the rounds: the mean and p99 latency ratios with 95 % intervals."""
    ab = pairs(a, b)
    if not ab:
        return {"pairs": 0}
    mean_ratio = sum(x for x, _ in ab) / max(sum(y for _, y in ab), 1e-12)
    pa, pb = percentile([x for x, _ in ab], 99), percentile([y for _, y in ab], 99)
    return {"pairs": len(ab), "mean_ratio": mean_ratio, "mean_interval": ratio_interval(ab),
            "p99_ratio": None if pa is None or not pb else pa / pb,
            "p99_interval": quantile_ratio_interval(ab, 99)}


def paired_line(name_a: str, name_b: str, fig: dict[str, Any]) -> str:
    """One markdown line of :func:`paired_figures`."""
    if not fig.get("pairs"):
        return f"- paired {name_a} / {name_b}: no request succeeded under both"

    def ci(v: tuple[float, float] | None) -> str:
        return "n/a" if v is None else f"[{v[0]:.2f}, {v[1]:.2f}]"

    p99 = "n/a" if fig["p99_ratio"] is None else f"{fig['p99_ratio']:.2f}"
    return (f"- paired {name_a} / {name_b} over {fig['pairs']} requests: mean "
            f"{fig['mean_ratio']:.2f}× (95 % {ci(fig['mean_interval'])}), p99 {p99}× "
            f"(95 % {ci(fig['p99_interval'])})")
