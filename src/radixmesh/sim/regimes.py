"""``radixmesh sim --experiment regimes``: issue #52's routing matrix, simulated, in one command.

Theory of operation
-------------------
Four regimes, each a mesh of batching engines on cited step-time profiles (``--profiles``, the
bench's syntax: each node's engine runs the core scheduler with its profile's step times and KV
pool, ``sim/engine.py``):

* ``h100-16``: 16 x ``h100-llama3-8b``;
* ``mixed-16``: 4 x ``h100-llama3-8b`` + 12 x ``a10g-llama3-8b`` (~4x apart in prefill speed);
* ``regions-16``: 16 x ``h100-llama3-8b`` dealt round-robin to regions us, eu, ap, 40 ms apart
  one way (1 ms inside a region);
* ``h100-1024``: 1,024 x ``h100-llama3-8b``, a reduced grid (``SCALE_GRID``: RAG and agentic at
  80 %, Poisson): ``SCALE_REQUESTS`` = 12 requests per node, the first 4 per node a warm-up
  left out of the figures (``SCALE_WARMUP``, as ``--exclude-warmup``), so the figures are not
  of a cold start (each node has served a few requests and reported its load once). At 80 %
  of 1,024 H100s that is ~0.15 virtual seconds: less than one epidemic gossip round (1 s), so
  peers' load is known from forwards' answers and refusals more than from gossip; several
  gossip rounds would take ~100 times the requests (hours of one core per run, as batching
  engines at 1,024 nodes cost ~10 ms of one core per request).

Each regime runs the grid workloads {chat, RAG, agentic, hot prefix} (workload/generated.py;
sessions send their next turn once the last is answered) x loads {50 %, 80 %} of the capacity
the sweep estimates (``sweep.batched_rate``: what a batching engine sustains within the TPOT SLO)
x arrivals {Poisson, bursty: gamma gaps of CV 3} x policies {none, cost, llmd (llm-d's default
scorer weights), cache_aware (one centralized gateway with sglang-router's cache-aware policy
in front of ``none`` nodes, ``sim/gateway.py``)}; ``--policy`` (other than its default) and
``--workload`` narrow the grid. ``smg`` (SMG 1.13's choice, ``sim/gateway.py``) may be
named too; it is left out of the default grid: it misses the real SMG on agentic (its spill
margin's formula is a guess, ``sim/gateway.py``).
Every run of one (regime, workload, load, arrivals) point replays the same timed requests.

Written to ``--out`` (default ``sim-regimes``): ``summary.json`` (every run's summary) and
``regimes.md``: one table per regime, a row per (workload, load, arrivals, policy) with TTFT
mean / p99, TPOT mean, goodput (TTFT <= 1 s and TPOT <= 100 ms), hit rate and the mean and p99
TTFT ratios to ``none`` of the same point, then a condensed table (one row per regime and
policy: geometric means of those ratios, mean goodput and hit rate over the regime's points).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from radixmesh.results.run_summary import Row
from radixmesh.sim.sweep import cluster_cost, profile_costs, sweep_point

POLICIES = "none,cost,llmd,cache_aware"
WORKLOADS = ("chat", "rag", "agentic", "hotprefix")
LOADS = (0.5, 0.8)
ARRIVALS = ("poisson", "bursty")
REQUESTS = 400  # per run at 16 nodes
SCALE_REQUESTS = 12 * 1024  # per run at 1,024 nodes (12 per node)
SCALE_WARMUP = (4 * 1024, 0.0)  # its warm-up left out of the figures (--exclude-warmup 4096)
SCALE_GRID = (("rag", "agentic"), (0.8,), ("poisson",))
H100, A10G = "h100-llama3-8b", "a10g-llama3-8b"


@dataclass(frozen=True, slots=True)
class Regime:
    name: str
    nodes: int
    profiles: str
    regions: str = ""
    region_delays: str = ""
    requests: int = REQUESTS
    warmup: tuple[int, float] = (0, 0.0)  # left out of the figures (--exclude-warmup's value)
    grid: tuple[Sequence[str], Sequence[float], Sequence[str]] = (WORKLOADS, LOADS, ARRIVALS)


REGIMES = (
    Regime("h100-16", 16, H100),
    Regime("mixed-16", 16, f"{H100}:4,{A10G}:12"),
    Regime("regions-16", 16, H100, "us,eu,ap", "1,40,40;40,1,40;40,40,1"),
    Regime("h100-1024", 1024, H100, requests=SCALE_REQUESTS, warmup=SCALE_WARMUP,
           grid=SCALE_GRID),
)


def main(args: argparse.Namespace) -> int:
    wanted = [r for r in REGIMES if not args.regimes or r.name in args.regimes.split(",")]
    if not wanted:
        raise ValueError(f"--regimes: choose from {', '.join(r.name for r in REGIMES)}")
    out = Path(args.out or "sim-regimes")
    out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    for regime in wanted:
        rows += run_regime(args, regime, functools.partial(_save, out, done=tuple(rows)))
    text = markdown(rows)
    (out / "regimes.md").write_text(text)
    print(text)
    print(f"wrote {out / 'regimes.md'}, {out / 'summary.json'}", file=sys.stderr)
    return 0


def run_regime(
    args: argparse.Namespace, regime: Regime, saved: Callable[[list[Row]], None]
) -> list[Row]:
    """Every point of ``regime``'s grid, all policies each; ``saved`` after every point."""
    rows: list[Row] = []
    workloads, loads, arrivals = regime.grid
    if args.workload != "mmlu":  # --workload KIND narrows the grid to it
        workloads = [w for w in workloads if w == args.workload]
    for workload, load, arrival in itertools.product(workloads, loads, arrivals):
        point = _point_args(args, regime, workload, load, arrival)
        costs = profile_costs(regime.profiles, regime.nodes)
        many = {"nodes": False, "delay": False, "interval": False, "skew": False}
        results = sweep_point(point, cluster_cost(point, costs), point.policy.split(","),
                              regime.nodes, [0.001], "uniform", many)  # fmt: skip
        summaries = [r.summary for r in results]
        none = next((s for s in summaries if s["policy"] == "none"), {})
        rows += [_row(regime, workload, load, arrival, s, none) for s in summaries]
        saved(rows)
        if not args.quiet:
            print(f"[regimes] {regime.name} {workload} {load:g} {arrival}: done", file=sys.stderr)
    return rows


def _point_args(
    args: argparse.Namespace, regime: Regime, workload: str, load: float, arrival: str
) -> argparse.Namespace:
    """The CLI's flags with this point's regime, workload, load and arrivals."""
    return argparse.Namespace(**{
        **vars(args),
        "profiles": regime.profiles, "regions": regime.regions,
        "region_delays": regime.region_delays, "workload": workload, "load": load,
        "rate": None, "schedule": arrival, "requests": regime.requests,
        "exclude_warmup": args.exclude_warmup or regime.warmup,
        "policy": args.policy if args.policy != "cost" else POLICIES,  # cost: the CLI default
        "tokenizer": "bytes", "max_context": None, "quiet": True,
    })  # fmt: skip


def _row(regime: Regime, workload: str, load: float, arrival: str, s: Row, none: Row) -> Row:
    return {
        "regime": regime.name, "nodes": regime.nodes, "profiles": regime.profiles,
        "workload": workload, "load": load, "arrivals": arrival, "policy": s["policy"],
        "requests": s["requests"], "errors": s["errors"],
        "mean_ttft_s": s.get("mean_ttft_s"), "p99_ttft_s": s.get("p99_ttft_s"),
        "mean_tpot_s": s.get("mean_tpot_s"), "goodput": s.get("goodput"),
        "hit_rate": s.get("actual_hit_rate"), "forwarded": s.get("forwarded_share"),
        "mean_ratio": _div(s.get("mean_ttft_s"), none.get("mean_ttft_s")),
        "p99_ratio": _div(s.get("p99_ttft_s"), none.get("p99_ttft_s")),
        "arrival_rate": s.get("arrival_rate"),
    }  # fmt: skip


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _save(out: Path, rows: list[Row], done: Sequence[Row]) -> None:
    (out / "summary.json").write_text(json.dumps({"rows": [*done, *rows]}, indent=2) + "\n")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def markdown(rows: list[Row]) -> str:
    """One full table per regime, then the condensed table (see the module docstring)."""
    parts = []
    for regime in dict.fromkeys(r["regime"] for r in rows):
        mine = [r for r in rows if r["regime"] == regime]
        parts.append(f"### {regime} (simulated)\n\n" + _full_table(mine))
    parts.append("### All regimes, condensed (simulated)\n\n" + condensed(rows))
    return "\n".join(parts)


def _full_table(rows: list[Row]) -> str:
    lines = [
        "| workload | load | arrivals | policy | TTFT mean ms | TTFT p99 ms | TPOT ms | "
        "goodput % | hit % | mean / none | p99 / none |",
        "|" + " --- |" * 11,
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['load']:g} | {r['arrivals']} | {r['policy']} | "
            f"{_ms(r['mean_ttft_s'])} | {_ms(r['p99_ttft_s'])} | {_ms(r['mean_tpot_s'])} | "
            f"{_pct(r['goodput'])} | {_pct(r['hit_rate'])} | {_x(r['mean_ratio'])} | "
            f"{_x(r['p99_ratio'])} |"
        )
    return "\n".join(lines) + "\n"


def condensed(rows: list[Row]) -> str:
    """One row per (regime, policy): geometric-mean TTFT ratios to ``none`` over the regime's
    points (and their worst), mean goodput and hit rate."""
    lines = [
        "| regime | policy | points | mean TTFT / none (geo, worst) | p99 TTFT / none (geo, "
        "worst) | goodput % | hit % |",
        "|" + " --- |" * 7,
    ]
    keys = dict.fromkeys((r["regime"], r["policy"]) for r in rows)
    for regime, policy in keys:
        mine = [r for r in rows if r["regime"] == regime and r["policy"] == policy]
        lines.append(
            f"| {regime} | {policy} | {len(mine)} | {_geo(mine, 'mean_ratio')} | "
            f"{_geo(mine, 'p99_ratio')} | {_pct(_avg(mine, 'goodput'))} | "
            f"{_pct(_avg(mine, 'hit_rate'))} |"
        )
    return "\n".join(lines) + "\n"


def _geo(rows: list[Row], key: str) -> str:
    vals = [r[key] for r in rows if r[key]]
    if not vals:
        return "-"
    geo = math.exp(sum(math.log(v) for v in vals) / len(vals))
    return f"{geo:.2f} ({max(vals):.2f})"


def _avg(rows: list[Row], key: str) -> float | None:
    vals = [r[key] for r in rows if r[key] is not None]
    return sum(vals) / len(vals) if vals else None
