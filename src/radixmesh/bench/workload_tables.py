"""``radixmesh bench --tables``: one Markdown table per workload x schedule of a bench folder
(per paired batch), paired ratios against ``none``, and the routing issue's targets for
``cost`` against the two centralized gateways and ``none``."""

from __future__ import annotations

from pathlib import Path

from radixmesh.bench.folder import Results

TABLE_POLICIES = ("none", "paper", "cost", "oracle", "sglang", "smg")


def workload_tables(out: Path) -> str:
    """One markdown table per workload × schedule (per paired batch) of a bench folder, with
    paired ratios against ``none`` and the issue's targets for ``cost`` against the two
    centralized gateways and ``none``."""
    res = Results.load(out)
    points: dict[str, list[dict[str, object]]] = {}
    for r in res.runs:
        key = str(r.get("lockstep") or r.get("batch") or r["name"].split("-", 1)[-1])
        points.setdefault(key, []).append(r)
    blocks = []
    for key, runs in points.items():
        runs.sort(key=lambda r: (TABLE_POLICIES.index(str(r["policy"]))
                                 if r["policy"] in TABLE_POLICIES else 99))  # fmt: skip
        blocks.append(_point_table(res, key, runs))
    return "\n\n".join(blocks) + "\n"


def _f(x: object, scale: float = 1.0, digits: int = 3) -> str:
    return "—" if not isinstance(x, int | float) else f"{x * scale:.{digits}f}"


def _point_table(res: Results, key: str, runs: list[dict[str, object]]) -> str:
    first = runs[0]
    cap = first.get("capacity") or {}
    head = f"#### {first.get('workload')} — {first.get('schedule_text')}  (`{key}`)"
    if isinstance(cap, dict) and cap.get("throughput_rps"):
        tput = ", ".join(f"{k.split('-', 1)[0]} {v:.2f}" for k, v in cap["throughput_rps"].items())
        head += (f"\n\nCapacity probe: {cap['probe_requests']} requests, "
                 f"{cap['probe_clients']} clients per cluster, all clusters at once; "
                 f"throughput (req/s) {tput}; basis {cap['basis']}.")  # fmt: skip
    cols = ("policy", "n", "err", "mean (s)", "p50 (s)", "p99 (s)", "/ none (paired, 95% CI)",
            "act. hit %", "ceiling %", "hotspot %", "fwd %")  # fmt: skip
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in runs:
        ratio = res.ratio_ci(r) if r["policy"] != "none" else None
        lines.append("| " + " | ".join([
            str(r["policy"]), str(r["requests"]), str(r.get("errors", 0)),
            _f(r.get("mean_latency_s")), _f(r.get("p50_latency_s")), _f(r.get("p99_latency_s")),
            "1" if r["policy"] == "none" else (ratio.text() if ratio else "—"),
            _f(r.get("actual_hit_rate"), 100, 1), _f(r.get("ideal_hit_rate"), 100, 1),
            _f(r.get("hotspot_share"), 100, 1), _f(r.get("forwarded_share"), 100, 1),
        ]) + " |")  # fmt: skip
    by = {str(r["policy"]): r for r in runs}
    cost = by.get("cost")
    if cost is not None:
        lines += ["", *_cost_targets(res, cost, by)]
    return "\n".join(lines)


def _cost_targets(
    res: Results, cost: dict[str, object], by: dict[str, dict[str, object]]
) -> list[str]:
    out = []
    for pol, label in (("sglang", "sglang-router"), ("smg", "SMG")):
        other = by.get(pol)
        if other is None:
            out.append(f"- `cost` mean and p99 ≤ {label}'s: n/a (not run)")
            continue
        ratio = res.ratio_ci(cost, other)
        c99, o99 = cost.get("p99_latency_s"), other.get("p99_latency_s")
        ok = (ratio is not None and ratio.value <= 1.0 and isinstance(c99, float)
              and isinstance(o99, float) and c99 <= o99)  # fmt: skip
        out.append(f"- `cost` mean and p99 ≤ {label}'s: **{'met' if ok else 'missed'}** — "
                   f"mean cost/{pol} {ratio.text() if ratio else '—'} (paired), "
                   f"p99 {_f(c99)} vs {_f(o99)} s")  # fmt: skip
    if "none" in by:
        r = res.ratio_ci(cost, by["none"])
        worse = r is not None and r.lo is not None and r.lo > 1.0
        verdict = "missed" if worse else "met"
        out.append(f"- `cost` never worse than `none` beyond noise: **{verdict}** — cost/none "
                   f"{r.text() if r else '—'}{' (interval above 1)' if worse else ''}")  # fmt: skip
    return out
