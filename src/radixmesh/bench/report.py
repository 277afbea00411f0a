"""``report.md`` and PNG figures from a benchmark folder (``summary.json`` + ``requests.jsonl``).

Tables follow the paper (Table 1: latency vs Δcomm and skew; Table 2: expected vs actual hit
rate; Table 3: hotspot share), each with the published numbers beside ours, then the issue's
targets with a plain met/missed verdict, and every run. A report shows what was run and nothing
else: a row whose configuration did not run is left out, a table or section with no rows too,
a target is listed only when its runs exist, and a figure is drawn only with at least two points
to show (see :mod:`radixmesh.bench.plots`). Ratios are *paired*: a run is compared
with the ``none`` run of the same workload (skew, cache budget, nodes, schedule) over the same
requests (the same seeded order, truncated to the shorter run), because absolute latencies on a
shared machine drift between runs; each ratio carries a bootstrap interval. Open-loop runs get
their own table: the schedule that ran, the CPU each cluster had, per-node served counts.

Figures (matplotlib, Agg): latency vs Δcomm per policy (Fig. 2), per-node share of two subjects'
requests over time under four configurations (Fig. 3; window 300, stride 30 over the request
stream), the specialization–eviction cycle under memory pressure (Fig. 4), hit rates per policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from radixmesh.bench import paper_numbers as P
from radixmesh.bench.folder import OPEN_LOOP, Results, Row
from radixmesh.bench.markdown import f3, get, pct, rtext, served_text, stall_text, table
from radixmesh.bench.targets import targets_table

# ----------------------------------------------------------------------------- tables
DELAYS = (("2ms", 2.0), ("200ms", 200.0), ("1s", 1000.0))


def table1(res: Results) -> str:
    rows = []
    cases = [(label, "uniform", ms) for label, ms in DELAYS] + [("skewed 2ms", "skewed", 2.0)]
    for label, skew, ms in cases:
        paper, cost = res.find("paper", skew, ms), res.find("cost", skew, ms)
        if paper is None and cost is None:
            continue
        pp, pc = (res.paired(r) if r else None for r in (paper, cost))
        none_mean = pc[1] if pc else (pp[1] if pp else None)
        pub_r, pub_n = P.TABLE1[label]
        rows.append([
            label, f3(pp[0] if pp else None), f3(pc[0] if pc else None),
            f3(none_mean),
            f"{rtext(res.ratio_ci(paper))}; {stall_text(res.ratio_without_stalls(paper))}",
            rtext(res.ratio_ci(cost)),
            stall_text(res.ratio_without_stalls(cost)),
            "/".join(str(p[2]) for p in (pp, pc) if p) or "—",
            f"{pub_r:.3f} / {pub_n:.3f} = {pub_r / pub_n:.2f}",
            f"≤ {P.TARGET_RATIO[label]:.2f}",
        ])  # fmt: skip
    head = ["Δcomm", "paper (s)", "cost (s)", "none (s, paired with cost)",
            "paper/none; without stalls (left out)",
            "cost/none", "cost/none without stalls (left out)", "paired n (paper/cost)",
            "published routed/none", "target cost/none"]  # fmt: skip
    return table(head, rows) if rows else ""


def table2(res: Results) -> str:
    rows = []
    for skew in ("uniform", "skewed"):
        for pol in ("none", "paper", "cost", "oracle"):
            r = res.find(pol, skew)
            if r is None:
                continue
            pub = P.TABLE2.get((skew, pol))
            rows.append([
                f"{skew}, {pol}", pct(get(r, "expected_hit_rate")),
                pct(get(r, "actual_hit_rate")), pct(get(r, "ideal_hit_rate")),
                f3(get(r, "mean_latency_s")),
                "—" if pub is None else f"{pub[0]:.1f} / {pub[1]:.1f} / {pub[2]:.3f}",
            ])  # fmt: skip
    head = ["configuration", "exp. hit (%)", "act. hit (%)", "ceiling (%)", "lat (s)",
            "published exp / act / lat"]  # fmt: skip
    return table(head, rows) if rows else ""


def table3(res: Results) -> str:
    cases: list[tuple[str, Row | None, Row | None]] = [
        ("uniform none", res.find("none"), None),
        ("skewed none", res.find("none", "skewed"), None),
    ]
    for label, ms in reversed(DELAYS):
        cases.append((f"comm {label}", res.find("paper", delay_ms=ms),
                      res.find("cost", delay_ms=ms)))  # fmt: skip
    for label, ms in (("20ms", 20.0), ("100ms", 100.0), ("2s", 2000.0), ("300s", 300000.0)):
        cases.append((f"poll {label}", res.find("paper", gossip_ms=ms),
                      res.find("cost", gossip_ms=ms)))  # fmt: skip
    cases.append(("skewed 2ms", res.find("paper", "skewed"), res.find("cost", "skewed")))
    rows = [[label, pct(get(a, "hotspot_share")), pct(get(b, "hotspot_share")),
             f"{P.TABLE3[label]:.1f}"] for label, a, b in cases
            if a is not None or b is not None]  # fmt: skip
    head = ["configuration", "ours: paper policy (none rows: none) (%)", "ours: cost policy (%)",
            "published (%)"]  # fmt: skip
    return table(head, rows) if rows else ""


def pressure_table(res: Results) -> str:
    if res.pressure is None:
        return ""
    rows = []
    for pol in ("none", "paper", "cost", "oracle"):
        r = res.find(pol, cache=res.pressure)
        if r is None:
            continue
        ratio = rtext(res.ratio_ci(r)) if pol != "none" else "1"
        rows.append([pol, f3(get(r, "mean_latency_s")), ratio,
                     pct(get(r, "actual_hit_rate")), pct(get(r, "hotspot_share"))])  # fmt: skip
    head = ["policy", "mean (s)", "/ none (paired, 95% CI)", "act. hit (%)", "hotspot (%)"]
    return f"Cache budget {res.pressure:,} tokens per node.\n\n" + table(head, rows)


def compare_table(res: Results) -> str:
    """Every policy at the default point (uniform, 2 ms, 500 ms, abundant, sequential)."""
    rows = []
    for r in res.runs:
        if r.get("group") not in ("t1", "baselines", "sglang", "k4", "k16", "open"):
            continue
        if r["net_delay_ms"] != 2.0 or r["cache_tokens"] != res.abundant or r["skew"] != "uniform":
            continue
        rows.append([r["policy"], schedule_text(r), str(r["requests"]),
                     f3(r["mean_latency_s"]), f3(r["p50_latency_s"]), f3(r["p99_latency_s"]),
                     rtext(res.ratio_ci(r)), pct(r["actual_hit_rate"]), pct(r["hotspot_share"]),
                     pct(r["forwarded_share"])])  # fmt: skip
    head = ["policy", "schedule", "n", "mean (s)", "p50 (s)", "p99 (s)", "/ none (paired, 95% CI)",
            "act. hit (%)", "hotspot (%)", "forwarded (%)"]  # fmt: skip
    return table(head, rows) if rows else ""


def schedule_text(run: Row) -> str:
    """What ran, in words (older summaries: rebuilt from their fields)."""
    if run.get("schedule_text"):
        return str(run["schedule_text"])
    if run.get("arrival_rate"):
        return f"open loop, Poisson {run['arrival_rate']:g} req/s"
    k = run.get("concurrency") or 1
    return f"closed loop, {k} clients" if k > 1 else "sequential"


def cpu_share(run: Row) -> float | None:
    """The cores each cluster had: the machine's, shared by the clusters up at once."""
    cores, k = run.get("cpu_cores"), run.get("clusters_at_once") or 1
    return None if not cores else min(cores / k, run["nodes"] * (run.get("threads_per_node") or 1))


def capacity_text(run: Row) -> str:
    share = cpu_share(run)
    if share is None:
        return "—"
    busy = run.get("busy_share")
    load = "" if busy is None else f"; engines used {100 * busy * run['nodes'] / share:.0f} %"
    return f"{share:.2f} cores ({run['cpu_cores']} / {run.get('clusters_at_once') or 1}){load}"


def drops_text(run: Row) -> str:
    d = run.get("dropped")
    if not isinstance(d, dict):
        return str(run.get("dropped_too_long") or 0)
    by = d.get("by_reason") or {}
    text = ", ".join(f"{k} {v}" for k, v in by.items()) or "0"
    return text + (f"; truncated {d['truncated']}" if d.get("truncated") else "")


TABLE2_NOTE = (
    "\n`none` claims no expected hits by design (its router consults no view); the paper's "
    "no-route column reports a prediction it never used. *Ceiling*: the hit rate if every "
    "request found every earlier prompt cached (one unbounded cache for the whole cluster) "
    "— no router can exceed it on the same request sequence; it grows with the number of "
    "requests (cold misses amortize).\n"
)

OPEN_LOOP_NOTE = (
    "Runs of one batch had their clusters up at once and received the same arrival schedule "
    "(request i at t_i to every cluster). *CPU per cluster*: the machine's cores shared by the "
    "clusters up at once (each node runs one engine thread), and the engines' total service "
    "time per second of the run as a share of it (wall-clock service time, so CPU contention "
    "counts as use: near or above 100 % the cluster was saturated). Intervals: 95 % circular "
    "block bootstrap over the paired requests (blocks of ⌈√n⌉ consecutive requests).\n\n"
)


def batch_order(run: Row) -> tuple[str, bool]:
    return str(run.get("batch")), run["policy"] != "none"


def open_loop_table(res: Results) -> str:
    """Open-loop runs, by batch: the schedule, the capacity each cluster had, ratios."""
    runs = [r for r in res.runs if r.get("schedule") in OPEN_LOOP]
    if not runs:
        return ""
    rows = [[r["policy"], schedule_text(r), capacity_text(r), str(r["requests"]),
             f3(r["mean_latency_s"]), f3(r["p99_latency_s"]),
             rtext(res.ratio_ci(r)) if r["policy"] != "none" else "1",
             pct(r["actual_hit_rate"]), pct(r["hotspot_share"]), served_text(r)]
            for r in sorted(runs, key=batch_order)]  # fmt: skip
    head = ["policy", "schedule", "CPU per cluster; engines' service time / it", "n", "mean (s)",
            "p99 (s)", "/ none (paired, 95% CI)", "act. hit (%)", "hotspot (%)",
            "served per node"]  # fmt: skip
    return table(head, rows)


def stranded_lines(res: Results) -> str:
    lines = [f"- `{r['name']}`: {', '.join(r['stranded_nodes'])} served nothing "
             f"({served_text(r)})" for r in res.runs if r.get("stranded")]  # fmt: skip
    return "\n".join(lines)


def all_runs_table(res: Results) -> str:
    rows = [[r["name"], schedule_text(r), str(r["requests"]), str(r["errors"]), drops_text(r),
             f3(r["mean_latency_s"]), f3(r["p99_latency_s"]), pct(r["expected_hit_rate"]),
             pct(r["actual_hit_rate"]), pct(r["hotspot_share"]), pct(r["forwarded_share"]),
             str(r["fallbacks"]), served_text(r)]
            for r in res.runs]  # fmt: skip
    head = ["run", "schedule", "n", "err", "dropped", "mean (s)", "p99 (s)", "exp hit %",
            "act hit %", "hotspot %", "fwd %", "fallbacks", "served per node"]  # fmt: skip
    text = table(head, rows)
    for r in res.skipped:
        text += f"\n\n- `{r['name']}`: {r['skipped']}"
    return text


# ----------------------------------------------------------------------------- targets
# ----------------------------------------------------------------------------- document
def backfill_ceilings(runs: Sequence[Row], mmlu_dir: str | None) -> None:
    """Compute ``ideal_hit_rate`` for runs summarized without it (the request sequence is
    rebuilt from the run's seeded workload parameters; MMLU runs need ``mmlu_dir``)."""
    from radixmesh.bench.prompts import ideal_hit_rate, make_fits, tokenizer_for
    from radixmesh.bench.spec import RunSpec
    from radixmesh.workload import WorkloadSpec, build

    cache: dict[tuple[Any, ...], float | None] = {}
    for r in runs:
        if r.get("ideal_hit_rate") is not None or r.get("skipped") or r["workload"] == "trace":
            continue
        if r["workload"] == "mmlu" and not mmlu_dir:
            continue
        key = (r["workload"], r["skew"], r.get("seed", 0), r["requests"], r["nodes"])
        if key not in cache:
            w = WorkloadSpec(requests=r["requests"], skewed=r["skew"] == "skewed",
                             seed=r.get("seed", 0), mmlu_dir=mmlu_dir)  # fmt: skip
            spec = RunSpec(name="ceiling", policy="none", workload=w, nodes=r["nodes"])
            reqs = build(w, spec.nodes, make_fits(spec))
            cache[key] = ideal_hit_rate(reqs, tokenizer_for(spec))
        r["ideal_hit_rate"] = cache[key]


def _after(note: str, body: str) -> str:
    return note + body if body else ""


def write_report(out: str | Path, mmlu_dir: str | None = None) -> Path:
    out = Path(out)
    res = Results.load(out)
    backfill_ceilings(res.runs, mmlu_dir)
    figs = figures(res, out)
    sections = [
        ("## Targets\n", targets_table(res), ""),
        ("## Table 1 — mean latency vs Δcomm and skew\n", table1(res), ""),
        (f"## Table 2 — expected vs actual hit rate (Δcomm 2 ms, Δpoll {res.poll_ms:g} ms)\n",
         table2(res), TABLE2_NOTE),
        ("## Table 3 — hotspot share (busiest node's share of requests)\n", table3(res), ""),
        ("## Memory pressure\n", pressure_table(res), ""),
        ("## All policies at Δcomm 2 ms (uniform)\n", compare_table(res), ""),
        ("## Open loop, paired in time\n", _after(OPEN_LOOP_NOTE, open_loop_table(res)), ""),
        ("## Nodes that served nothing\n", stranded_lines(res), ""),
        ("## Figures\n", "\n".join(f"![{name}]({name})" for name in figs), ""),
        ("## All runs\n", all_runs_table(res), ""),
    ]
    parts = [
        "# radixmesh benchmark report\n",
        f"Runs: {len(res.runs)} (+{len(res.skipped)} skipped). Ratios are paired with `none` "
        "over the same requests (the `none` run that ran beside it in time when there is one; "
        "otherwise marked *not paired in time*), with 95 % bootstrap intervals in brackets. "
        "`paper` = the paper's Algorithm 1 (argmax estimated prefix "
        "match); `cost` = radixmesh's cost-model router; `oracle` = exact, instantaneous cache "
        "knowledge with the same cost model.\n",
    ]
    for title, body, note in sections:
        if body:  # nothing ran for it: the section is left out
            parts += [title, body, *([note] if note else []), ""]
    parts.append("")
    path = out / "report.md"
    path.write_text("\n".join(parts))
    return path


def figures(res: Results, out: Path) -> list[str]:
    from radixmesh.bench import plots  # matplotlib only when figures are drawn

    made: list[str] = []
    for name, fn in (
        ("fig2_latency_vs_comm.png", plots.latency_vs_comm),
        ("fig3_share_over_time.png", plots.share_over_time),
        ("fig4_specialization_eviction.png", plots.specialization_eviction),
        ("fig_hit_rates.png", plots.hit_rates),
        ("fig_ttft_cdf.png", plots.ttft_cdf),
    ):
        if fn(res, out / name):
            made.append(name)
    return made
