"""``radixmesh bench``: benchmark sweeps against fresh local clusters, with a report.

Examples::

    radixmesh bench --sweep quick --out runs/quick
    radixmesh bench --sweep paper --mmlu-dir DIR --out runs/paper
    radixmesh bench --policy none,cost,oracle --net-delay 2ms,200ms,1s --skew uniform,skewed \\
        --mmlu-dir DIR --requests 1000 --out runs/sweep
    radixmesh bench --policy none,cost,paper --rate 1 --requests 60 --synthetic-scale 0.25 \\
        --out runs/open            # paired open loop: 3 clusters up, one arrival schedule
    radixmesh bench --report-only --out runs/paper        # rebuild report.md + figures
    radixmesh bench --export-trace wl.jsonl --skew skewed  # write the workload, run nothing
    radixmesh bench --workload chat,rag,agentic,hotprefix --concurrency 4 --load 0.5 \
        --policy none,paper,cost,oracle,sglang,smg --batch-limit 6 --interleave \
        --requests 100 --synthetic-scale 0.3 --out runs/wl   # the routing issue's matrix
    radixmesh bench --tables --out runs/wl                 # one table per workload × schedule

Every list flag takes comma-separated values; the sweep is their cartesian product, except
the schedules: each ``--concurrency`` value (closed loop; 1 = the paper's one at a time), each
``--rate`` (open-loop Poisson, requests/s) and each ``--load`` (open-loop Poisson at that
fraction of the capacity measured first, in the same run) is one schedule, and the sweep runs
every schedule given (default: ``--concurrency 1`` when no rate or load is given). Open-loop
runs (``--rate``, ``--load``, or a trace whose lines carry ``t``) of the policies at one sweep
point run paired in time by default; ``--interleave`` pairs sequential and closed-loop points
too.

The node options (``--policy``, ``--net-delay``, ``--gossip-*``, ``--cache-tokens``, ``--nodes``,
``--preset``, ...) are ``radixmesh serve``'s, from radixmesh/options.py, as lists. Renamed in
this release (the old names warn): ``--policies`` -> ``--policy``, ``--comm-delay`` ->
``--net-delay``, ``--engine-preset`` -> ``--preset`` (the model preset, as in serve and chaos),
and ``--preset paper|quick`` (a named sweep) -> ``--sweep paper|quick``.

This module is the argument table (every flag with its help) and what the command does;
:mod:`radixmesh.bench.plan` turns the parsed flags into the list of runs.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from radixmesh.bench.plan import specs_from_args
from radixmesh.bench.prompts import TOO_LONG_ACTIONS, PromptTooLong
from radixmesh.bench.spec import ALL_POLICIES, RunSpec, check_policy
from radixmesh.bench.sweep import ABUNDANT_CACHE, SWEEPS
from radixmesh.core.config import GossipConfig
from radixmesh.core.units import parse_duration
from radixmesh.options import add_exclude_warmup, add_option, add_options
from radixmesh.workload import Schedule, trace
from radixmesh.workload.build import WORKLOADS, build_counted
from radixmesh.workload.lengths import OutputLengths
from radixmesh.workload.schedule import DEFAULT_CV, Entry

T = TypeVar("T")


def _list(parse: Callable[[str], T]) -> Callable[[str], list[T]]:
    def inner(text: str) -> list[T]:
        try:
            return [parse(p.strip()) for p in text.split(",") if p.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return inner


def _workload(text: str) -> str:
    if text not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, not {text!r}")
    return text


def _fraction(text: str) -> float:
    value = float(text.removesuffix("%")) / (100.0 if text.endswith("%") else 1.0)
    if not 0 < value <= 4:
        raise ValueError(f"load must be a fraction of capacity in (0, 4], not {text!r}")
    return value


def _skew(text: str) -> str:
    if text not in ("uniform", "skewed"):
        raise ValueError(f"skew must be uniform or skewed, not {text!r}")
    return text


def _arrivals(text: str) -> Schedule:
    kind = Schedule(text) if text in ("poisson", "bursty") else None
    if kind is None:
        raise ValueError(f"arrivals must be poisson or bursty, not {text!r}")
    return kind


def _lengths(text: str) -> str:
    try:
        if text:
            OutputLengths.parse(text)  # refused here, naming the flag
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:  # long: an argument table
    p.add_argument("--out", default="runs/bench", help="output folder (default runs/bench)")
    p.add_argument("--sweep", choices=sorted(SWEEPS), help="a named sweep (overrides lists)")
    p.add_argument(
        "--only",
        type=_list(str),
        help="with --sweep: run only these groups (see --dry-run), e.g. t1,skew,pressure",
    )
    g = p.add_argument_group("sweep (comma-separated lists; cartesian product)")
    add_option(g, "policy", ["none", "paper", "cost"], type=_list(check_policy),
               help=f"routing policies, from {', '.join(ALL_POLICIES)}")
    add_options(g, {"net_delay": [0.002], "gossip_interval": [0.5]}, sweep=True)
    add_option(g, "gossip_announce", GossipConfig().announce_gap_s)
    g.add_argument("--skew", type=_list(_skew), default=["uniform"], help="uniform,skewed")
    add_options(g, {"cache_tokens": [ABUNDANT_CACHE], "nodes": [4]}, sweep=True)
    n = p.add_argument_group("regions (as radixmesh sim's; bench/regions.py)")
    n.add_argument("--regions", default="",
                   help="region names, e.g. us,eu,ap: node i in region i mod R, clients enter "
                        "in every region, the gateways stand in the first")
    n.add_argument("--region-delays", default="",
                   help="one-way ms matrix, rows ';' (row = from), the diagonal inside a "
                        "region, e.g. '1,40,90;40,1,120;90,120,1' (replaces --net-delay)")
    g.add_argument(
        "--rate",
        type=_list(float),
        default=None,
        help="open-loop arrivals, requests/s (Poisson unless --arrivals; default: the "
        "paper's sequential; with "
        "--trace, replaces the trace's own times)",
    )
    g.add_argument(
        "--interleave",
        action="store_true",
        help="pair sequential and closed-loop points too: their policies' clusters run at once "
        "(sequential: request i to each in turn): paired ratios on a noisy machine",
    )
    g.add_argument(
        "--unpaired",
        action="store_true",
        help="run open-loop configurations one after another instead of paired in time",
    )
    g.add_argument(
        "--concurrency",
        type=_list(int),
        default=None,
        help="closed-loop clients (1 = the paper's one request at a time; the default when "
        "no --rate or --load is given)",
    )
    g.add_argument(
        "--load",
        type=_list(_fraction),
        default=None,
        help="open-loop Poisson at these fractions of the capacity, e.g. 0.5,0.8 or 50%%,80%%: "
        "measured first in the same run (a short saturating closed loop on the same clusters), "
        "or with --engine emulated the engines' planned capacity, as radixmesh sim plans it",
    )
    g.add_argument(
        "--arrivals",
        type=_list(_arrivals),
        default=[Schedule.POISSON],
        help="open-loop arrivals (--rate, --load): poisson, bursty (gamma gaps of coefficient "
        "of variation --arrival-cv), or both: poisson,bursty (bursty runs' names get -bursty)",
    )
    g.add_argument("--arrival-cv", type=float, default=DEFAULT_CV, metavar="CV",
                   help=f"bursty arrivals: the gaps' coefficient of variation (default "
                        f"{DEFAULT_CV:g}; 1 = Poisson, 2-4 bursty)")
    add_exclude_warmup(g)
    g.add_argument(
        "--batch-limit",
        type=int,
        default=4,
        help="clusters up at once when runs are paired (default 4; 6 pairs six policies)",
    )
    g.add_argument(
        "--probe-requests",
        type=int,
        default=48,
        help="requests per cluster of the --load capacity probe (default 48)",
    )
    g.add_argument(
        "--probe-clients",
        type=int,
        default=16,
        help="closed-loop clients of the --load capacity probe (default 16)",
    )
    w = p.add_argument_group("workload")
    w.add_argument(
        "--workload",
        type=_list(_workload),
        default=["mmlu"],
        help="mmlu (the paper's; synthetic MMLU shape without --mmlu-dir), chat (multi-turn, "
        "growing history, random entry), rag (Zipf-popular long documents), agentic (shared "
        "tool-use prompt, growing scratchpads), hotprefix (one hot few-shot prefix)",
    )
    w.add_argument(
        "--mmlu-dir",
        help="MMLU in the original release layout (else synthetic); the generated workloads "
        "take their text from it (else from seeded pseudo-words)",
    )
    w.add_argument("--trace", help="replay a JSONL trace instead of generating a workload")
    w.add_argument(
        "--requests", type=int, help="requests per configuration (default 1000; quick preset: 32)"
    )
    w.add_argument("--seed", type=int, default=0, help="workload and routing seed")
    w.add_argument(
        "--entry",
        type=Entry.parse,
        default=Entry.GIVEN,
        help="the node each request enters at: given (the workload's own: chat's random ones, "
        "a trace's; else round-robin) or random (seeded, every request; run names get "
        "-erandom)",
    )
    w.add_argument(
        "--too-long",
        choices=TOO_LONG_ACTIONS,
        default="drop",
        help="prompts that do not fit the engine's context: drop (counted per group), "
        "truncate (cut at the end) or fail before any cluster starts",
    )
    w.add_argument(
        "--synthetic-scale",
        type=float,
        default=None,
        help="prompt length multiplier of the synthetic and generated workloads (1.0 = MMLU-sized; "
        "default 1.0, 0.2 with --sweep quick)",
    )
    w.add_argument("--max-tokens", type=_lengths, default="", metavar="DIST",
                   help="output lengths instead of the workload's own: N, uniform:LO:HI, "
                        "lognormal:MEAN:SIGMA or exponential:MEAN (tokens; seeded per request; "
                        "optional :cap=N, default 32768)")
    w.add_argument("--think-time", type=parse_duration, default=0.0, metavar="S",
                   help="multi-turn sessions (chat, agentic): a session's next turn goes this "
                        "long on average (exponential, seeded) after the last answer (default 0)")
    w.add_argument("--synthetic-groups", type=int, default=None,
                   help="synthetic MMLU shape: prefix groups (default 57, as MMLU's subjects; "
                        "6 with --sweep quick)")
    w.add_argument(
        "--export-trace",
        metavar="FILE",
        help="write the (first configuration's) workload as JSONL and exit",
    )
    e = p.add_argument_group("engine")
    e.add_argument("--engine", choices=("builtin", "emulated"), default="builtin",
                   help="builtin: the built-in engine in each node; emulated: each node fronts "
                        "its own `radixmesh emulate` GPU engine (--profiles) as it fronts vLLM")
    e.add_argument("--profiles", default="",
                   help="emulated engines' step-time profiles with counts, e.g. "
                        "h100-llama3-8b:4,a10g-llama3-8b:12 (one bare name: every node)")
    e.add_argument("--time-scale", type=float, default=1.0, metavar="S",
                   help="emulated: every step, delay, interval and timeout S x longer, figures "
                        "divided back by S (a 2-core machine cannot run GPU-speed engines in "
                        "real time; default 1)")
    add_option(e, "preset", "mini", help="built-in model preset (paper | quick: the "
               "deprecated spelling of --sweep)")
    add_option(e, "model", None)
    add_options(e, {"threads": 1, "device": "cpu"})
    add_option(e, "dtype", "float32", choices=("float32", "bfloat16", "float16"))
    add_option(e, "gpu_memory_fraction", 0.0)
    p.add_argument("--report-only", action="store_true", help="rebuild the report from --out")
    p.add_argument(
        "--tables",
        action="store_true",
        help="print one markdown table per workload × schedule from --out, and exit",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep --out's earlier runs; skip configurations already complete there",
    )
    p.add_argument("--no-report", action="store_true", help="skip report.md and figures")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--dry-run", action="store_true", help="list the configurations and exit")


def export_trace(spec: RunSpec, path: str, too_long: str = "drop") -> int:
    from radixmesh.bench.prompts import make_admit

    reqs, drops = build_counted(spec.workload, spec.nodes, make_admit(spec, too_long))
    n = trace.save(reqs, path)
    print(f"wrote {n} requests to {path}; {drops.text()}")
    return 0


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.report_only:
        return _report(out, args.mmlu_dir)
    if getattr(args, "tables", False):
        from radixmesh.bench.workload_tables import workload_tables

        print(workload_tables(out))
        return 0
    try:
        specs = specs_from_args(args)  # bench/plan.py
    except (ValueError, FileNotFoundError) as exc:
        print(f"radixmesh bench: {exc}", file=sys.stderr)
        return 2
    if args.export_trace:
        return export_trace(specs[0], args.export_trace, args.too_long)
    if args.dry_run:
        for s in specs:
            print(s.name, f"requests={s.workload.requests}", f"group={s.group}",
                  f"paired={s.lockstep or '-'}")  # fmt: skip
        return 0
    return _sweep(args, out, specs)


def _sweep(args: argparse.Namespace, out: Path, specs: list[RunSpec]) -> int:
    """Run ``specs`` into ``out``, then the report; the exit status (130: interrupted, 1: a
    run failed, 2: nothing ran)."""
    from radixmesh.bench.after_run import run_failure
    from radixmesh.bench.runner import Runner

    stop_on_sigterm()
    try:
        runner = Runner(out, progress=not args.no_progress, log=_err, too_long=args.too_long,
                        batch_limit=args.batch_limit, probe_requests=args.probe_requests,
                        probe_clients=args.probe_clients)  # fmt: skip
    except ValueError as exc:
        print(f"radixmesh bench: {exc}", file=sys.stderr)
        return 2
    print(f"radixmesh bench: {len(specs)} configuration(s) → {out}", file=sys.stderr)
    try:
        results = runner.run_all(specs, skip_done=args.resume)
    except PromptTooLong as exc:
        print(f"radixmesh bench: {exc} (--too-long fail); nothing ran", file=sys.stderr)
        return 2
    interrupted = any(r.interrupted for r in results)
    if not args.no_report:
        _report(out, args.mmlu_dir)
    failures = [f for f in map(run_failure, results) if f]
    for failure in failures:
        print(f"radixmesh bench: run failed: {failure}", file=sys.stderr)
    return 130 if interrupted else (1 if failures else 0)


def _err(message: str) -> None:
    print(message, file=sys.stderr)


def stop_on_sigterm() -> None:
    """SIGTERM (and SIGINT even when inherited as ignored, e.g. under nohup) stop the sweep the
    way Ctrl-C does: finished records and summaries are kept, clusters are stopped."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _report(out: Path, mmlu_dir: str | None = None) -> int:
    from radixmesh.bench.report import write_report

    path = write_report(out, mmlu_dir)
    print(f"report: {path}")
    return 0


# ----------------------------------------------------------------------------- --tables
