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
    radixmesh bench --workload chat,rag,agentic,hotprefix --concurrency 4 --load 0.5 \
        --policies none,paper,cost,oracle,sglang,smg --batch-limit 6 --interleave \
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

Why one file over 400 lines: most of it is the argument table (every flag with its help) and
the one function that turns the flags into run specs; split, the flags would sit apart from
how they combine.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from radixmesh.bench.prompts import TOO_LONG_ACTIONS, PromptTooLong
from radixmesh.bench.spec import ALL_POLICIES, RunSpec, check_policy
from radixmesh.bench.sweep import ABUNDANT_CACHE, PRESETS, SweepAxes, expand, paired
from radixmesh.core.config import GossipConfig
from radixmesh.core.units import parse_duration, parse_optional_duration
from radixmesh.workload import Schedule, WorkloadSpec, trace
from radixmesh.workload.build import WORKLOADS, build_counted
from radixmesh.workload.schedule import Entry

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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/bench", help="output folder (default runs/bench)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a named sweep (overrides lists)")
    p.add_argument(
        "--only",
        type=_list(str),
        help="with --preset: run only these groups (see --dry-run), e.g. t1,skew,pressure",
    )
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
    g.add_argument(
        "--gossip-announce",
        type=parse_optional_duration,
        default=GossipConfig().announce_gap_s,
        help="a node's cache change brings its next gossip round forward to this long after "
        "the last one (node --gossip-announce); 'off': rounds only every Δpoll, as the paper "
        "polls",
    )
    g.add_argument("--skew", type=_list(_skew), default=["uniform"], help="uniform,skewed")
    g.add_argument(
        "--cache-tokens",
        type=_list(int),
        default=[ABUNDANT_CACHE],
        help="KV budget per node, tokens",
    )
    g.add_argument("--nodes", type=_list(int), default=[4], help="nodes per cluster, e.g. 4,8")
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
        default=None,
        help="closed-loop clients (1 = the paper's one request at a time; the default when "
        "no --rate or --load is given)",
    )
    g.add_argument(
        "--load",
        type=_list(_fraction),
        default=None,
        help="open-loop Poisson at these fractions of the capacity measured first in the same "
        "run (a short saturating closed loop on the same clusters), e.g. 0.5,0.8 or 50%%,80%%",
    )
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
        default=1.0,
        help="prompt length multiplier of the synthetic and generated workloads (1.0 = MMLU-sized)",
    )
    w.add_argument("--synthetic-groups", type=int, default=57,
                   help="synthetic MMLU shape: prefix groups (MMLU has 57 subjects)")
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
    e.add_argument("--engine-preset", default="mini", help="built-in model preset")
    e.add_argument("--model", help="local model directory instead of a preset")
    e.add_argument("--threads", type=int, default=1, help="torch threads per node")
    e.add_argument("--device", default="cpu", help="torch device of the nodes' engines: cpu, cuda")
    e.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="engine weights and KV cache")
    e.add_argument("--gpu-memory-fraction", type=float, default=0.0,
                   help="cuda: each node process's share of the GPU's memory (0 = no cap)")
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


def base_spec(args: argparse.Namespace) -> RunSpec:
    quick = args.preset == "quick"
    rate = args.rate[0] if args.rate else None
    workloads = getattr(args, "workload", None) or ["mmlu"]
    w = WorkloadSpec(
        kind=workloads[0],
        rate=rate,
        schedule=Schedule.POISSON if rate else Schedule.SEQUENTIAL,
        requests=args.requests or (32 if quick else 1000),
        seed=args.seed,
        mmlu_dir=args.mmlu_dir,
        trace=args.trace,
        synthetic_scale=args.synthetic_scale or (0.2 if quick else 1.0),
        synthetic_groups=args.synthetic_groups or (6 if quick else 57),
        entry=getattr(args, "entry", Entry.GIVEN),
    )
    return RunSpec(
        name="base",
        policy="none",
        workload=w,
        nodes=args.nodes[0],
        comm_delay_s=args.comm_delay[0],
        gossip_interval_s=args.gossip_interval[0],
        gossip_announce_s=args.gossip_announce,
        cache_tokens=args.cache_tokens[0],
        concurrency=(args.concurrency or [1])[0],
        preset=args.engine_preset,
        model=args.model,
        threads=args.threads,
        device=args.device,
        dtype=args.dtype,
        gpu_memory_fraction=args.gpu_memory_fraction,
        seed=args.seed,
        engine=args.engine,
        profiles=args.profiles,
        time_scale=args.time_scale,
    )


def specs_from_args(args: argparse.Namespace) -> list[RunSpec]:
    base = base_spec(args)
    if args.preset:
        runs = PRESETS[args.preset](base)
        if args.only:
            known = {r.group for r in runs}
            if unknown := set(args.only) - known:
                raise ValueError(f"--only: no group {', '.join(sorted(unknown))} in preset "
                                 f"{args.preset} (groups: {', '.join(sorted(known))})")
            runs = [r for r in runs if r.group in args.only]
        return [_tagged(r, _entry_tag(base)) for r in runs]
    loads = getattr(args, "load", None) or []
    closed = args.concurrency or ([] if (args.rate or loads) else [1])
    open_loop = bool(args.rate) or bool(loads) or trace_has_times(args.trace)
    pair = args.interleave or (open_loop and not args.unpaired)
    specs: list[RunSpec] = []
    for kind in getattr(args, "workload", None) or ["mmlu"]:
        b = replace(base, workload=replace(base.workload, kind=kind))
        tag = ("" if kind == "mmlu" else f"-w{kind}") + _entry_tag(base)
        points: list[tuple[list[float | None], list[int], float | None]] = []
        if closed:
            points.append(([None], closed, None))
        if args.rate:
            points.append((list(args.rate), [1], None))
        points += [([None], [1], load) for load in loads]
        for rates, conc, load in points:
            axes = SweepAxes(
                policies=args.policies, comm_delays_s=args.comm_delay,
                gossip_intervals_s=args.gossip_interval, skews=args.skew,
                cache_tokens=args.cache_tokens, nodes=args.nodes, rates=rates, concurrency=conc,
            )  # fmt: skip
            got = expand(axes, b)
            if pair:
                got = paired(got)
            suffix = tag
            if load is not None:
                suffix += f"-L{load:g}"
                timed = Schedule.POISSON
                got = [replace(s, workload=replace(s.workload, load=load, schedule=timed))
                       for s in got]  # fmt: skip
            specs += [_tagged(s, suffix) for s in got]
    return specs


def _entry_tag(spec: RunSpec) -> str:
    return "" if spec.workload.entry is Entry.GIVEN else f"-e{spec.workload.entry.value}"


def _tagged(spec: RunSpec, suffix: str) -> RunSpec:
    """``spec`` with ``suffix`` on its name and lockstep key (workload kind, load fraction:
    axes the sweep's run names do not carry)."""
    if not suffix:
        return spec
    return replace(spec, name=spec.name + suffix,
                   lockstep=spec.lockstep + suffix if spec.lockstep else "")  # fmt: skip


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
    if getattr(args, "tables", False):
        from radixmesh.bench.workload_tables import workload_tables

        print(workload_tables(out))
        return 0
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
