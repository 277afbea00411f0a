"""Per-run summary statistics, in the issue's ``summary.json`` schema (plus a few extras).

Hit rates are token-weighted: cached prompt tokens / prompt tokens over successful requests.
``hotspot_share`` is the share of requests served by the busiest node (the paper's Table 3).
Percentiles use the nearest-rank method on successful requests.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from radixmesh.results.records import Record


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _ratio(num: int, den: int) -> float | None:
    return num / den if den > 0 else None


def hit_rates(ok: Sequence[Record]) -> tuple[float | None, float | None]:
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    expected = sum(min(r.expected_cached_tokens or 0, r.prompt_tokens or 0) for r in ok)
    actual = sum(r.cached_tokens or 0 for r in ok)
    return _ratio(expected, prompt), _ratio(actual, prompt)


def hotspot_share(ok: Sequence[Record]) -> float | None:
    counts = Counter(r.served_by for r in ok if r.served_by is not None)
    return _ratio(max(counts.values()), sum(counts.values())) if counts else None


def summarize(records: Sequence[Record]) -> dict[str, Any]:
    """Latency, hit-rate and balance figures of one run's records."""
    ok = [r for r in records if r.ok]
    lat = [r.latency_s for r in ok]
    expected, actual = hit_rates(ok)
    routes = Counter(r.route for r in ok)
    served = Counter(r.served_by for r in ok if r.served_by)
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "mean_latency_s": mean(lat),
        "p50_latency_s": percentile(lat, 50),
        "p99_latency_s": percentile(lat, 99),
        "expected_hit_rate": expected,
        "actual_hit_rate": actual,
        "hotspot_share": hotspot_share(ok),
        "forwarded_share": _ratio(routes["forwarded"], len(ok)),
        "fallbacks": routes["fallback"],
        "served_by": dict(sorted(served.items())),
        "prompt_tokens_mean": mean([float(r.prompt_tokens or 0) for r in ok]),
        "wall_s": max((r.t_done for r in records), default=0.0),
    }
