"""The report's targets: each of the issue's goals with what was measured and a met / missed
verdict, judged only where its runs exist (and where it can be met at all: a hotspot share
below 1/nodes, a hit rate above the sequence's ceiling are not judged). Ratios are paired with
``none`` (``folder.Results.ratio_ci``); the gateways' comparison is paired request by request."""

from __future__ import annotations

from typing import Any

from radixmesh.bench import paper_numbers as P
from radixmesh.bench.folder import Results, Row
from radixmesh.bench.markdown import f3, get, pct, rtext, table, verdict
from radixmesh.core.router import DELIBERATE
from radixmesh.results.run_summary import mean, percentile, placement_tags


def oracle_gain(res: Results, skew: str = "uniform") -> float | None:
    """(none − cost) / (none − oracle) in mean latency, over the requests all three served."""
    runs = [res.find(p, skew) for p in ("none", "cost", "oracle")]
    if any(r is None for r in runs):
        return None
    lat = [{x.id: x.latency_s for x in res.ok(r)} for r in runs if r is not None]
    common = set.intersection(*(set(d) for d in lat))
    if not common:
        return None
    none, cost, oracle = (sum(d[i] for i in common) for d in lat)
    return None if none <= oracle else (none - cost) / (none - oracle)


GoalRow = tuple[str, str, bool | None]  # (the goal, what was measured, met; None: not judged)


def targets(res: Results) -> list[GoalRow]:
    cost = res.find("cost")
    out = _ratio_targets(res) + _hotspot_targets(cost) + _copies_targets(res, cost)
    out += _hit_targets(cost)
    g = oracle_gain(res)
    out.append((f"cost captures ≥ {100 * P.TARGET_ORACLE_GAIN:.0f}% of oracle's gain (2 ms)",
                pct(g), None if g is None else g >= P.TARGET_ORACLE_GAIN))  # fmt: skip
    out += sglang_targets(res)
    return out


def _ratio_targets(res: Results) -> list[GoalRow]:
    """cost/none at each delay, and under memory pressure."""
    out: list[GoalRow] = []
    for label, skew, ms in [("2ms", "uniform", 2.0), ("skewed 2ms", "skewed", 2.0),
                            ("200ms", "uniform", 200.0), ("1s", "uniform", 1000.0)]:  # fmt: skip
        r = res.ratio_ci(res.find("cost", skew, ms))
        goal = P.TARGET_RATIO[label]
        out.append((f"cost/none ≤ {goal:.2f} ({label})", rtext(r),
                    None if r is None else r.value <= goal))  # fmt: skip
    if res.pressure is not None:
        r = res.ratio_ci(res.find("cost", cache=res.pressure))
        goal = P.TARGET_PRESSURE_RATIO
        out.append((f"cost/none ≤ {goal:.2f} under memory pressure", rtext(r),
                    None if r is None else r.value <= goal))  # fmt: skip
    return out


def _hotspot_targets(cost: Row | None) -> list[GoalRow]:
    out: list[GoalRow] = []
    hs, hit = get(cost, "hotspot_share"), get(cost, "actual_hit_rate")
    # A target is judged only where it can be met: a hotspot share below 1/nodes cannot be
    # (2 nodes: 50 % at best), nor a hit rate above this request sequence's ceiling.
    ceiling = get(cost, "ideal_hit_rate")
    if hs is not None and cost is not None and cost["nodes"] * P.TARGET_HOTSPOT >= 1:
        out.append((f"hotspot ≤ {100 * P.TARGET_HOTSPOT:.0f}% (cost, uniform 2 ms)", pct(hs),
                    hs <= P.TARGET_HOTSPOT))  # fmt: skip
        if hit is not None and ceiling is not None:
            gap = ceiling - hit
            out.append(("... with a hit rate within 3 points of the ceiling",
                        f"{pct(hit)} of {pct(ceiling)}", gap <= 0.03))  # fmt: skip
    return out


def _copies_targets(res: Results, cost: Row | None) -> list[GoalRow]:
    # The measured requests' own tags where the records carry them; else the nodes' counters,
    # which also count the warm-up prompts (one per node, sharing a short header: the first
    # is a first copy, the others often a second copy of that header — not MMLU traffic).
    placed: Any = {} if cost is None else placement_tags(res.ok(cost))
    whose = "tags of the measured requests"
    if not placed:
        placed, whose = get(cost, "placements"), "router's counters, warm-ups included"
    if not (isinstance(placed, dict) and placed):
        return []
    return [(f"0 accidental second cold copies (cost, uniform 2 ms; {whose})",
             f"second copies {placed.get('second_copy', 0):.0f}, deliberate replicas "
             f"{sum(placed.get(t.value, 0) for t in DELIBERATE):.0f} of "
             f"{sum(placed.values()):.0f} placed",
             placed.get("second_copy", 0) == 0)]  # fmt: skip


def _hit_targets(cost: Row | None) -> list[GoalRow]:
    hit, ceiling = get(cost, "actual_hit_rate"), get(cost, "ideal_hit_rate")
    if hit is None or not (ceiling is None or ceiling >= P.PAPER_ACTUAL_HIT_UNIFORM):
        return []
    shown = pct(hit) + ("" if ceiling is None else f" (ceiling for this sequence "
                                                   f"{pct(ceiling)})")
    return [(f"actual hit ≥ {100 * P.PAPER_ACTUAL_HIT_UNIFORM:.1f}% (cost, uniform "
             "2 ms)", shown, hit >= P.PAPER_ACTUAL_HIT_UNIFORM)]  # fmt: skip


GATEWAY_NAMES = {"sglang": "sglang-router", "smg": "SMG"}


def sglang_targets(res: Results) -> list[GoalRow]:
    """cost ≤ each centralized gateway, mean and p99, paired, at every client count run."""
    out: list[GoalRow] = []
    for gw, name in GATEWAY_NAMES.items():
        for k in (1, 4, 16):
            sg = res.find(gw, concurrency=k)
            cost = res.find_with(sg, "cost") if sg else None
            if sg is None or cost is None:
                out.append((f"cost ≤ {name} mean and p99 ({k} client(s))", "—", None))
                continue
            a, b = paired_stats(res, cost, sg)
            shown = f"mean {f3(a[0])} vs {f3(b[0])}, p99 {f3(a[1])} vs {f3(b[1])}"
            ok = a[0] <= b[0] and a[1] <= b[1]
            out.append((f"cost ≤ {name} mean and p99 ({k} client(s))", shown, ok))
    return out


def paired_stats(res: Results, a: Row, b: Row) -> tuple[tuple[float, float], tuple[float, float]]:
    la = {r.id: r.latency_s for r in res.ok(a)}
    lb = {r.id: r.latency_s for r in res.ok(b)}
    common = sorted(la.keys() & lb.keys())

    def stats(d: dict[str, float]) -> tuple[float, float]:
        vals = [d[i] for i in common]
        return (mean(vals) or 0.0, percentile(vals, 99) or 0.0)

    return stats(la), stats(lb)


def targets_table(res: Results) -> str:
    """The targets whose runs exist (one not run is not listed: it was not measured)."""
    rows = [[t, m, verdict(ok)] for t, m, ok in targets(res) if ok is not None]
    return table(["target", "measured", "verdict"], rows) if rows else ""
