"""``radixmesh bench``: benchmark sweeps against fresh local clusters, with a report.

Examples::

    radixmesh bench --preset quick --out runs/quick
    radixmesh bench --preset paper --mmlu-dir DIR --out runs/paper
    radixmesh bench --policies none,cost,oracle --comm-delay 2ms,200ms,1s --skew uniform,skewed \\
        --mmlu-dir DIR --requests 1000 --out runs/sweep
    radixmesh bench --policies none,cost,paper --rate 1 --requests 60 --synthetic-scale 0.25 \\
        --out runs/open            # paired open loop: 3 clusters up, one arrival schedule
    radixmesh bench --report-only --out runs/paper        # rebuild report.md + figures
    radixmesh bench --export-trace wl.jsonl --skew skewed  # write the workload, run nothing

Every list flag takes comma-separated values; the sweep is their cartesian product. Open-loop
runs (``--rate``, or a trace whose lines carry ``t``) of the policies at one sweep point run
paired in time by default; ``--interleave`` pairs sequential and closed-loop points too.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from radixmesh.bench.prompts import TOO_LONG_ACTIONS, PromptTooLong
from radixmesh.bench.spec import ALL_POLICIES, RunSpec, check_policy
from radixmesh.bench.sweep import ABUNDANT_CACHE, PRESETS, SweepAxes, expand, paired
from radixmesh.runtime.config import parse_duration
from radixmesh.workload import Schedule, WorkloadSpec, trace
from radixmesh.workload.build import build_counted

T = TypeVar("T")


def _list(parse: Callable[[str], T]) -> Callable[[str], list[T]]:
    def inner(text: str) -> list[T]:
        try:
            return [parse(p.strip()) for p in text.split(",") if p.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return inner


def _skew(text: str) -> str:
    if text not in ("uniform", "skewed"):
        raise ValueError(f"skew must be uniform or skewed, not {text!r}")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/bench", help="output folder (default runs/bench)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a named sweep (overrides lists)")
    g = p.add_argument_group("sweep (comma-separated lists; cartesian product)")
    g.add_argument(
        "--policies",
        type=_list(check_policy),
        default=["none", "paper", "cost"],
        help=f"from {', '.join(ALL_POLICIES)}",
    )
    g.add_argument(
        "--comm-delay",
        type=_list(parse_duration),
        default=[0.002],
        help="emulated one-way peer delay, e.g. 2ms,200ms,1s (node --net-delay)",
    )
    g.add_argument(
        "--gossip-interval",
        type=_list(parse_duration),
        default=[0.5],
        help="anti-entropy period Δpoll, e.g. 20ms,100ms,500ms,2s,300s",
    )
    g.add_argument("--skew", type=_list(_skew), default=["uniform"], help="uniform,skewed")
    g.add_argument(
        "--cache-tokens",
        type=_list(int),
        default=[ABUNDANT_CACHE],
        help="KV budget per node, tokens",
    )
    g.add_argument("--nodes", type=_list(int), default=[4])
    g.add_argument(
        "--rate",
        type=_list(float),
        default=None,
        help="open-loop Poisson arrivals, requests/s (default: the paper's sequential; with "
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
        default=[1],
        help="closed-loop clients (1 = the paper's one request at a time)",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--mmlu-dir", help="MMLU in the original release layout (else synthetic)")
    w.add_argument("--trace", help="replay a JSONL trace instead of generating a workload")
    w.add_argument(
        "--requests", type=int, help="requests per configuration (default 1000; quick preset: 32)"
    )
    w.add_argument("--seed", type=int, default=0)
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
        default=1.0,
        help="synthetic prompt length multiplier (1.0 = MMLU-sized)",
    )
    w.add_argument("--synthetic-groups", type=int, default=57)
    w.add_argument(
        "--export-trace",
        metavar="FILE",
        help="write the (first configuration's) workload as JSONL and exit",
    )
    e = p.add_argument_group("engine")
    e.add_argument("--engine-preset", default="tiny", help="built-in model preset")
    e.add_argument("--model", help="local model directory instead of a preset")
    e.add_argument("--threads", type=int, default=1, help="torch threads per node")
    p.add_argument("--report-only", action="store_true", help="rebuild the report from --out")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep --out's earlier runs; skip configurations already complete there",
    )
    p.add_argument("--no-report", action="store_true", help="skip report.md and figures")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="list the configurations and exit")


def base_spec(args: argparse.Namespace) -> RunSpec:
    quick = args.preset == "quick"
    rate = args.rate[0] if args.rate else None
    w = WorkloadSpec(
        rate=rate,
        schedule=Schedule.POISSON if rate else Schedule.SEQUENTIAL,
        requests=args.requests or (32 if quick else 1000),
        seed=args.seed,
        mmlu_dir=args.mmlu_dir,
        trace=args.trace,
        synthetic_scale=args.synthetic_scale or (0.2 if quick else 1.0),
        synthetic_groups=args.synthetic_groups or (6 if quick else 57),
    )
    return RunSpec(
        name="base",
        policy="none",
        workload=w,
        nodes=args.nodes[0],
        comm_delay_s=args.comm_delay[0],
        gossip_interval_s=args.gossip_interval[0],
        cache_tokens=args.cache_tokens[0],
        concurrency=args.concurrency[0],
        preset=args.engine_preset,
        model=args.model,
        threads=args.threads,
        seed=args.seed,
    )


def specs_from_args(args: argparse.Namespace) -> list[RunSpec]:
    base = base_spec(args)
    if args.preset:
        return PRESETS[args.preset](base)
    axes = SweepAxes(
        policies=args.policies,
        comm_delays_s=args.comm_delay,
        gossip_intervals_s=args.gossip_interval,
        skews=args.skew,
        cache_tokens=args.cache_tokens,
        nodes=args.nodes,
        rates=args.rate or [None],
        concurrency=args.concurrency,
    )
    specs = expand(axes, base)
    open_loop = bool(args.rate) or trace_has_times(args.trace)
    if args.interleave or (open_loop and not args.unpaired):
        specs = paired(specs)
    return specs


def trace_has_times(path: str | None) -> bool:
    return bool(path) and any(r.t is not None for r in trace.load(path or ""))


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
    try:
        specs = specs_from_args(args)
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
    from radixmesh.bench.runner import Runner

    stop_on_sigterm()
    runner = Runner(out, progress=not args.no_progress, log=_err, too_long=args.too_long)
    print(f"radixmesh bench: {len(specs)} configuration(s) → {out}", file=sys.stderr)
    try:
        results = runner.run_all(specs, skip_done=args.resume)
    except PromptTooLong as exc:
        print(f"radixmesh bench: {exc} (--too-long fail); nothing ran", file=sys.stderr)
        return 2
    interrupted = any(r.interrupted for r in results)
    if not args.no_report:
        _report(out, args.mmlu_dir)
    return 130 if interrupted else 0


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
