"""Per-run summary statistics, in the issue's ``summary.json`` schema (plus a few extras).

Hit rates are token-weighted: cached prompt tokens / prompt tokens over successful requests.
``hotspot_share`` is the share of requests served by the busiest node (the paper's Table 3).
``served_per_node`` counts successful requests per node *including nodes that served none*;
such a node is ``stranded`` (e.g. a node that lost every early routing race never caches and
then never wins one). ``busy_share`` is the engines' total service time over nodes × wall time.
Percentiles use the nearest-rank method on successful requests.

Renamed keys (:data:`RENAMED_KEYS`): the writers use the new name; :func:`load_summary`, which
every reader of a ``summary.json`` goes through, gives old files' runs the new name too
(``comm_delay_ms`` became ``net_delay_ms`` with the ``--net-delay`` flag).

Where the records carry TTFT (streamed runs, the simulator on the scheduler), the summary adds
mean / p50 / p99 of TTFT and TPOT and ``goodput``: the share of *all* requests (failed ones
count against it) that succeeded within the SLO — TTFT ≤ ``slo.ttft_s`` and, for requests with
at least two output tokens, TPOT ≤ ``slo.tpot_s`` (DistServe's definition of goodput as the
requests that meet their latency objectives; default 1 s and 100 ms, the 8B profiles' SLO).
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixmesh.results.records import Record

Row = dict[str, Any]  # one run's entry of a summary.json, or a table row built from one

RENAMED_KEYS = {"comm_delay_ms": "net_delay_ms"}  # a run's old key -> its current name


def load_summary(path: Path) -> dict[str, Any]:
    """A ``summary.json`` with every run's keys current (old files' renamed keys renamed)."""
    doc: dict[str, Any] = json.loads(path.read_text())
    for run in doc.get("runs", []):
        for old, new in RENAMED_KEYS.items():
            if old in run:
                run.setdefault(new, run.pop(old))
    return doc


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (``q`` in [0, 100]) by the nearest-rank method; None for no values.

    Nearest rank: the ``ceil(q / 100 * n)``-th smallest of the ``n`` values (at least the
    first), i.e. the smallest value with at least ``q`` % of the values at or below it. It is
    always an observed value, never interpolated: numpy's default (``method="linear"``) and
    ``statistics.median`` on an even count can give numbers between two samples. This is the
    one percentile of the project; every p50 / p99 figure goes through it."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q!r}")
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def prediction_errors(pairs: Sequence[tuple[float, float]]) -> dict[str, float | None]:
    """How far predicted times were from the actual ones, over ``(predicted, actual)`` pairs
    with an actual time > 0: the median and p90 of ``|predicted - actual| / actual`` and the
    mean signed ``(predicted - actual) / actual`` (negative: predicted too soon). The one
    definition of the TTFT prediction error (``sim``'s summary, ``scripts/ttft-error.py``)."""
    rel = [(p - a) / a for p, a in pairs if a > 0]
    err = [abs(x) for x in rel]
    return {"n": len(rel), "abs_p50": percentile(err, 50), "abs_p90": percentile(err, 90),
            "abs_mean": mean(err), "signed_mean": mean(rel)}


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


def served_per_node(ok: Sequence[Record], node_ids: Sequence[str]) -> dict[str, int]:
    """Successful requests served by each node, zeros included."""
    counts = Counter(r.served_by for r in ok if r.served_by is not None)
    return {n: counts.get(n, 0) for n in node_ids} | {
        n: c for n, c in sorted(counts.items()) if n not in node_ids
    }


def node_figures(records: Sequence[Record], node_ids: Sequence[str]) -> dict[str, Any]:
    """Per-node served counts, the nodes that served nothing, and how busy the engines were."""
    ok = [r for r in records if r.ok]
    served = served_per_node(ok, node_ids)
    wall = max((r.t_done for r in records), default=0.0) - min(
        (r.t_send for r in records), default=0.0
    )
    service = sum(r.server_timing.get("service", 0.0) for r in ok)
    busy = service / (len(node_ids) * wall) if wall > 0 and node_ids else None
    stranded = [n for n, c in served.items() if c == 0] if ok else []
    return {"served_per_node": served, "stranded_nodes": stranded,
            "stranded": bool(stranded), "busy_share": busy}  # fmt: skip


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
        "request_placements": placement_tags(ok),
    } | token_latencies(records)


@dataclass(frozen=True, slots=True)
class Slo:
    """A latency objective per request: time to first token and time per output token."""

    ttft_s: float = 1.0
    tpot_s: float = 0.1

    def met(self, r: Record) -> bool:
        if not r.ok or r.ttft_s is None or r.ttft_s > self.ttft_s:
            return False
        return r.tpot_s is None or r.tpot_s <= self.tpot_s


def token_latencies(records: Sequence[Record], slo: Slo | None = None) -> dict[str, Any]:
    """TTFT / TPOT figures and goodput; {} when no record carries a TTFT."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    if not ttft:
        return {}
    slo = slo or Slo()
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    return {
        "mean_ttft_s": mean(ttft), "p50_ttft_s": percentile(ttft, 50),
        "p99_ttft_s": percentile(ttft, 99),
        "mean_tpot_s": mean(tpot), "p50_tpot_s": percentile(tpot, 50),
        "p99_tpot_s": percentile(tpot, 99),
        "goodput": _ratio(sum(slo.met(r) for r in records), len(records)),
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
    }  # fmt: skip


def placement_tags(records: Sequence[Record]) -> dict[str, int]:
    """How many of ``records`` carry each placement tag of the router (``Record.placement``,
    from ``x-radixmesh-placement``); {} when none is tagged (another policy, older records)."""
    return dict(sorted(Counter(r.placement for r in records if r.placement).items()))


def ratio_interval(
    pairs: Sequence[tuple[float, float]], level: float = 0.95, resamples: int = 2000, seed: int = 0
) -> tuple[float, float] | None:
    """Bootstrap interval of sum(a) / sum(b) over paired requests ``(a, b)`` in request order.

    Circular block bootstrap: blocks of ⌈√n⌉ consecutive requests are resampled, because
    neighbouring requests share a queue and a cache state (open loop especially), so they are
    not independent; a per-request bootstrap would state intervals that reruns miss."""
    n = len(pairs)
    if n < 2:
        return None
    block = _block(n)
    pa, pb = [0.0], [0.0]  # prefix sums over the pairs repeated once (circular blocks)
    for a, b in (*pairs, *pairs):
        pa.append(pa[-1] + a)
        pb.append(pb[-1] + b)
    ratios: list[float] = []
    for starts in _block_starts(n, resamples, seed):
        den = sum(pb[s + block] - pb[s] for s in starts)
        if den > 0:
            ratios.append(sum(pa[s + block] - pa[s] for s in starts) / den)
    return _central(ratios, level)


def quantile_ratio_interval(pairs: Sequence[tuple[float, float]], q: float,
                            level: float = 0.95, resamples: int = 2000, seed: int = 0
                            ) -> tuple[float, float] | None:
    """Bootstrap interval of ``percentile(A, q) / percentile(B, q)`` over paired requests,
    resampled in the same circular blocks as :func:`ratio_interval`."""
    n = len(pairs)
    if n < 2:
        return None
    block = _block(n)
    ratios: list[float] = []
    for starts in _block_starts(n, resamples, seed):
        picked = [pairs[(s + i) % n] for s in starts for i in range(block)]
        qa = percentile([p[0] for p in picked], q)
        qb = percentile([p[1] for p in picked], q)
        if qa is not None and qb:
            ratios.append(qa / qb)
    return _central(ratios, level)


def _block(n: int) -> int:
    """The circular block bootstrap's block: ⌈√n⌉ consecutive pairs."""
    return max(1, math.ceil(math.sqrt(n)))


def _block_starts(n: int, resamples: int, seed: int) -> Iterator[list[int]]:
    """Each resample's block starts: ⌈n / block⌉ of them, drawn from one seeded stream."""
    rng = random.Random(seed)
    for _ in range(resamples):
        yield [rng.randrange(n) for _ in range(math.ceil(n / _block(n)))]


def _central(ratios: list[float], level: float) -> tuple[float, float] | None:
    """The central ``level`` interval of the resampled ratios; None when there are none."""
    if not ratios:
        return None
    ratios.sort()
    tail = (1.0 - level) / 2.0
    return ratios[int(tail * (len(ratios) - 1))], ratios[math.ceil((1 - tail) * (len(ratios) - 1))]
