"""``radixmesh sim``: simulate a mesh of N nodes — the same NodeCore — on a virtual clock.

Sweeps like ``radixmesh bench`` (comma-separated policies, delays, gossip intervals, skews) and
writes the same ``summary.json`` / ``requests.jsonl`` into ``--out DIR``. The node options
(``--policy``, ``--net-delay``, ``--gossip-*``, ...) are ``radixmesh serve``'s, from
radixmesh/options.py; renamed in this release (the old names warn): ``--comm-delay`` ->
``--net-delay``, ``--jitter`` -> ``--net-jitter``, ``--loss`` -> ``--net-loss``, ``--fanout`` ->
``--gossip-fanout``, ``--load-bound -1`` -> ``--load-bound off``.

Defaults are chosen to scale: open-loop Poisson arrivals at half the cluster's estimated
capacity (``--load 0.5``), and ``--gossip-mode auto`` = delta (every peer each round, the
paper's dissemination) up to 32 nodes and epidemic (fanout 3) above, with Δpoll 0.5 s up to 32
nodes and 1 s above — all-to-all rounds at 1,024 nodes would be a million messages per virtual
second. Experiments for docs/scale.md: ``--experiment convergence|scale|pushback|breakeven``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from radixmesh.core.config import GossipConfig
from radixmesh.core.router import RouterConfig
from radixmesh.core.units import parse_duration
from radixmesh.options import (
    add_exclude_warmup,
    add_option,
    add_options,
    parse_optional_fraction,
    warn_renamed,
)
from radixmesh.sim import costs
from radixmesh.sim.runner import SimResult
from radixmesh.sim.sweep import AUTO_EPIDEMIC_ABOVE, parse_policies, split_csv, sweep_point
from radixmesh.workload.build import WORKLOADS
from radixmesh.workload.schedule import Entry


def add_arguments(p: argparse.ArgumentParser) -> None:  # long: an argument table
    g = p.add_argument_group("cluster")
    add_option(g, "nodes", "4", raw=True, help="node count(s), comma-separated (default 4)")
    add_option(
        g,
        "policy",
        "cost",
        raw=True,
        help="routing policies, comma-separated: none, paper, cost, random, round_robin, "
        "least_loaded, llmd (llm-d's default scorer profile), cache_aware (a centralized "
        "gateway with sglang-router 0.3.2's policy in front of none nodes) or smg (one with "
        "SMG 1.13's: spill gate, lowest expected wait)",
    )
    g.add_argument(
        "--profiles",
        default="",
        help="mixed hardware, the bench's syntax: NAME:COUNT,... step-time profiles dealt to "
        "the nodes in order, e.g. h100-llama3-8b:4,a10g-llama3-8b:12 (replaces --cost-model)",
    )
    g.add_argument(
        "--cost-model",
        default="cpu-tiny",
        help="a step-time profile (`radixmesh profile list`, or a .toml file; run at batch 1 "
        "until the simulator batches), a JSON file from `radixmesh calibrate`, or a preset: "
        + ", ".join(
            f"{n} (deprecated: illustrative, not measured)" if n in costs.DEPRECATED else n
            for n in costs.PRESETS
        )
        + " (default cpu-tiny)",
    )
    add_option(g, "cache_tokens", 65_536)
    g.add_argument(
        "--service-noise",
        type=float,
        default=None,
        help="sigma of a mean-1 log-normal factor on each request's time (default 0; with "
        "--validate: the scatter of the fit)",
    )
    g.add_argument(
        "--shared-cores",
        type=float,
        default=None,
        metavar="C",
        help="the nodes' engines share one machine of C cores (processor sharing: with n "
        "requests running, each at min(1, C/n) speed), as 4 nodes on one GPU or the bench's "
        "clusters on one CPU box do (default: every node has its own hardware)",
    )
    g.add_argument(
        "--tuned-priors",
        action="store_true",
        help="router priors from the cost model (default: the runtime's defaults, as `serve`)",
    )
    add_option(g, "pushback_threshold", 8)
    add_option(g, "load_bound", RouterConfig().load_bound, type=_load_bound)
    add_option(g, "forward_timeout", "2s", raw=True)
    g.add_argument("--seeds", type=int, default=3, help="seed nodes each node joins through")
    g = p.add_argument_group("gossip")
    add_option(
        g,
        "gossip_interval",
        "auto",
        raw=True,
        help="Δpoll value(s), comma-separated, e.g. 500ms,2s (auto: 0.5s, 1s above "
        f"{AUTO_EPIDEMIC_ABOVE} nodes)",
    )
    add_option(
        g,
        "gossip_mode",
        "auto",
        raw=True,
        help=f"delta | snapshot | epidemic | auto (epidemic above {AUTO_EPIDEMIC_ABOVE} nodes)",
    )
    add_options(g, {"gossip_fanout": 3, "gossip_announce": GossipConfig().announce_gap_s})
    g = p.add_argument_group("network")
    add_option(g, "net_delay", "2ms", raw=True, help="one-way delay(s), comma-separated")
    add_option(g, "net_jitter", "0ms", raw=True)
    add_option(g, "net_loss", 0.0)
    g.add_argument("--regions", default="", help="region names, e.g. us,eu,ap (round-robin)")
    g.add_argument(
        "--region-delays",
        default="",
        help="one-way ms matrix, rows ';', e.g. '1,40,90;40,1,120;90,120,1'",
    )
    g.add_argument(
        "--partition",
        action="append",
        default=[],
        help="START-END:NODES, e.g. 10s-20s:0-1 (repeatable)",
    )
    g.add_argument(
        "--crash",
        action="append",
        default=[],
        help="NODE@CRASH[:RESTART], e.g. 2@5s:8s (repeatable; times after warm-up)",
    )
    g = p.add_argument_group("workload")
    g.add_argument("--requests", type=int, default=1000, help="requests per run")
    g.add_argument(
        "--requests-per-node",
        type=int,
        default=None,
        help="experiments: at least this many requests per node",
    )
    g.add_argument("--skew", default="uniform", help="uniform, skewed or uniform,skewed")
    g.add_argument(
        "--workload",
        default="mmlu",
        choices=list(WORKLOADS),
        help="mmlu (MMLU with --mmlu-dir, else synthetic questions) or a generated workload: "
        "chat, rag, agentic, hotprefix (workload/generated.py; a session's next turn is sent "
        "once its last one is answered)",
    )
    g.add_argument("--mmlu-dir", default=None, help="MMLU release directory (else synthetic)")
    g.add_argument("--trace", default=None, help="replay a JSONL trace")
    g.add_argument(
        "--entry",
        type=Entry.parse,
        default=Entry.GIVEN,
        help="given (a trace's entries, else round-robin) or random (seeded, every request)",
    )
    g.add_argument(
        "--tokenizer",
        default="auto",
        choices=["auto", "bytes", "words"],
        help="bytes: the built-in engine's (token counts match a real cluster); "
        "words: BPE-like counts (~550 tokens per MMLU prompt) for scale runs; "
        f"auto: bytes up to {AUTO_EPIDEMIC_ABOVE} nodes, words above",
    )
    g.add_argument("--synthetic-groups", type=int, default=57, help="synthetic groups")
    g.add_argument("--synthetic-scale", type=float, default=1.0, help="synthetic prompt length x")
    g.add_argument(
        "--schedule",
        default="poisson",
        choices=["poisson", "bursty", "sequential"],
        help="open-loop Poisson (default), open-loop bursty (gamma gaps, --arrival-cv) or the "
        "paper's closed loop",
    )
    g.add_argument(
        "--arrival-cv",
        type=float,
        default=3.0,
        help="bursty: the gaps' coefficient of variation (1 = Poisson; default 3)",
    )
    g.add_argument(
        "--concurrency",
        default="1",
        help="sequential schedule: closed-loop clients, or 'nodes' for one per node",
    )
    g.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second")
    g.add_argument("--load", type=float, default=0.5,
                   help="without --rate: arrivals = LOAD x estimated cluster capacity")
    g.add_argument("--max-tokens", type=int, default=None, help="override output tokens")
    g.add_argument(
        "--max-context", type=int, default=None,
        help="drop prompts that do not fit this context (as bench does for its engine; "
        "--validate: 4096, the tiny preset's)",
    )
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=int, default=0,
                   help="random seed of the workload and the simulation (default 0)")
    g.add_argument("--warmup", default=None, help="virtual warm-up before requests")
    add_exclude_warmup(g)
    g.add_argument("--out", default=None, help="directory for summary.json, requests.jsonl")
    g.add_argument("--no-records", action="store_true", help="skip requests.jsonl")
    g.add_argument(
        "--decisions", action="store_true",
        help="each record carries the node that served it as its entry node's router saw it "
        "(`considered`: the decision log's fields; what scripts/ttft-learn.py fits)",
    )
    g.add_argument("--quiet", action="store_true", help="no progress on stderr")
    g.add_argument(
        "--validate",
        metavar="BENCH_DIR",
        default=None,
        help="replay a `radixmesh bench` output's configurations (give the same workload "
        "flags) and compare; --cost-model fit (default here) fits it to that run. An "
        "--engine emulated run is replayed from its own records (send times, entries) on its "
        "profiles (sim/replay.py)",
    )
    g.add_argument(
        "--forward-overhead", default="3ms", help="with --validate: HTTP work of one forward"
    )
    g.add_argument("--trials", type=int, default=5, help="convergence: changes measured")
    g.add_argument(
        "--experiment",
        default=None,
        choices=["convergence", "scale", "pushback", "breakeven", "regimes"],
        help="run an experiment of docs/scale.md instead of a sweep; regimes: issue #52's "
        "simulated matrix (sim/regimes.py; --policy narrows its four policies, --regimes its "
        "regimes)",
    )
    g.add_argument(
        "--regimes",
        default="",
        help="--experiment regimes: which, comma-separated (default all: h100-16, mixed-16, "
        "regions-16, h100-1024)",
    )


def _load_bound(text: str) -> float | None:
    """--load-bound X or 'off'; a negative number was the old spelling of 'off' (warned)."""
    try:
        if float(text) < 0:
            warn_renamed(f"--load-bound {text}", "--load-bound off", "value")
            return None
    except ValueError:
        pass
    try:
        return parse_optional_fraction(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


# ----------------------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"radixmesh sim: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.shared_cores is not None and (args.experiment or args.validate):
        raise ValueError("--shared-cores is for a sweep (not --experiment or --validate)")
    if args.experiment == "regimes":
        from radixmesh.sim import regimes

        return regimes.main(args)
    if args.experiment:
        from radixmesh.sim import experiments

        return experiments.main(args)
    if args.validate:
        return _run_validate(args)
    if args.requests_per_node:
        raise ValueError("--requests-per-node is for --experiment scale|pushback")
    if args.shared_cores is not None and not args.shared_cores > 0:
        raise ValueError("--shared-cores must be > 0")
    return _run_sweep(args)


def _run_validate(args: argparse.Namespace) -> int:
    from radixmesh.sim import replay, validate

    if replay.is_emulated(Path(args.validate)):  # replays the run's own trace
        return replay.main(args)
    if args.cost_model == "cpu-tiny":  # the default: fit to the real run instead
        args.cost_model = "fit"
    if args.max_context is None:  # the bench drops prompts beyond the tiny preset's
        args.max_context = 4096
    return validate.main(args)


def _run_sweep(args: argparse.Namespace) -> int:
    cost = costs.resolve(args.cost_model)
    policies = parse_policies(args.policy)
    node_counts = [int(n) for n in split_csv(args.nodes)]
    delays = [parse_duration(d) for d in split_csv(args.net_delay)]
    skews = _parse_skews(args.skew)
    many = {
        "nodes": len(node_counts) > 1,
        "delay": len(delays) > 1,
        "interval": len(split_csv(args.gossip_interval)) > 1,
        "skew": len(skews) > 1,
    }
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    points = (  # lazy: each point's results are written before the next point runs
        sweep_point(args, cost, policies, nodes, delays, skew, many)
        for nodes, skew in itertools.product(node_counts, skews)
    )
    summaries = _collect(points, out, records=not args.no_records)
    _print_table(summaries)
    if out is not None:
        print(f"wrote {out / 'summary.json'}")
    return 0


def _parse_skews(text: str) -> list[str]:
    skews = split_csv(text)
    for s in skews:
        if s not in ("uniform", "skewed"):
            raise ValueError(f"--skew takes uniform and/or skewed, not {s!r}")
    return skews


def _collect(
    points: Iterable[list[SimResult]], out: Path | None, records: bool
) -> list[dict[str, Any]]:
    """Run the sweep's points, rewriting ``summary.json`` and appending ``requests.jsonl``
    (unless ``records`` is off) after every run, so a sweep cut short keeps what finished."""
    records_fh = None if out is None or not records else (out / "requests.jsonl").open("w")
    summaries: list[dict[str, Any]] = []
    try:
        for results in points:
            for res in results:
                summaries.append(res.summary)
                if records_fh is not None:
                    res.write_records(records_fh)
                if out is not None:
                    _write_summary(out, summaries)
    finally:
        if records_fh is not None:
            records_fh.close()
    return summaries


def _write_summary(out: Path, summaries: list[dict[str, Any]]) -> None:
    tmp = out / "summary.json.tmp"
    tmp.write_text(
        json.dumps(
            {
                "runs": summaries,
                "generated_by": "radixmesh sim",
                "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            },
            indent=2,
        )
        + "\n"
    )
    tmp.replace(out / "summary.json")


def _fmt(v: Any, pct: bool = False) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.1f}%" if pct else f"{v:.3f}"


def _print_table(summaries: list[dict[str, Any]]) -> None:
    head = (
        f"{'run':<28} {'mean s':>8} {'p99 s':>8} {'exp hit':>8} {'act hit':>8} "
        f"{'hotspot':>8} {'fwd':>7} {'errors':>6} {'gossip B/node/s':>15}"
    )
    print(head)
    for s in summaries:
        print(
            f"{s['name']:<28} {_fmt(s['mean_latency_s']):>8} {_fmt(s['p99_latency_s']):>8} "
            f"{_fmt(s['expected_hit_rate'], True):>8} {_fmt(s['actual_hit_rate'], True):>8} "
            f"{_fmt(s['hotspot_share'], True):>8} {_fmt(s['forwarded_share'], True):>7} "
            f"{s['errors']:>6} {s['sim']['gossip_bytes_per_node_s']:>15,.0f}"
        )
