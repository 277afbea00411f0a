"""``radixmesh bench``'s plan: from the parsed flags to the list of runs (:class:`RunSpec`).

Theory of operation
-------------------
:func:`base_spec` is the one run the flags describe when every list flag takes its first
value. A named ``--sweep`` (bench/sweep.py's ``SWEEPS``) expands that base into its groups
(``--only`` keeps some). Otherwise the sweep is the cartesian product of the list flags
(:class:`~radixmesh.bench.sweep.SweepAxes`), once per workload and per schedule
(:func:`_points`: the closed loops, then each ``--rate`` and each ``--load`` under each kind of
arrivals); open-loop points of the policies run paired in time unless ``--unpaired``, and
``--interleave`` pairs the others too. Run names get tags for the axes the sweep's names do not
carry (workload kind, load fraction, bursty arrivals, random entries, regions).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from radixmesh.bench.spec import RunSpec
from radixmesh.bench.sweep import SWEEPS, SweepAxes, expand, paired
from radixmesh.options import warn_renamed
from radixmesh.workload import Schedule, WorkloadSpec, trace
from radixmesh.workload.schedule import DEFAULT_CV, Entry


def _sweep_of(args: argparse.Namespace) -> str | None:
    """``--sweep``; ``--preset paper|quick`` is its old spelling (warned, once)."""
    if args.preset in SWEEPS:
        warn_renamed(f"--preset {args.preset}", f"--sweep {args.preset}")
        from radixmesh.engine.presets import DEFAULT_PRESET  # torch: only on this old path

        args.sweep, args.preset = args.preset, DEFAULT_PRESET
    return getattr(args, "sweep", None)


def base_spec(args: argparse.Namespace) -> RunSpec:
    quick = _sweep_of(args) == "quick"
    warm = getattr(args, "exclude_warmup", None) or (0, 0.0)
    return RunSpec(
        name="base",
        policy="none",
        workload=_workload_spec(args, quick),
        nodes=args.nodes[0],
        net_delay_s=args.net_delay[0],
        gossip_interval_s=args.gossip_interval[0],
        gossip_announce_s=args.gossip_announce,
        cache_tokens=args.cache_tokens[0],
        concurrency=(args.concurrency or [1])[0],
        preset=args.preset,
        model=args.model,
        threads=args.threads,
        device=args.device,
        dtype=args.dtype,
        gpu_memory_fraction=args.gpu_memory_fraction,
        seed=args.seed,
        engine=args.engine,
        profiles=args.profiles,
        time_scale=args.time_scale,
        regions=getattr(args, "regions", ""),
        region_delays=getattr(args, "region_delays", ""),
        warmup_requests=warm[0],
        warmup_s=warm[1],
    )


def _workload_spec(args: argparse.Namespace, quick: bool) -> WorkloadSpec:
    rate = args.rate[0] if args.rate else None
    workloads = getattr(args, "workload", None) or ["mmlu"]
    return WorkloadSpec(
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
        arrival_cv=getattr(args, "arrival_cv", DEFAULT_CV),
        max_tokens=getattr(args, "max_tokens", ""),
        think_s=getattr(args, "think_time", 0.0),
    )


def specs_from_args(args: argparse.Namespace) -> list[RunSpec]:
    base = base_spec(args)
    if args.sweep:
        runs = SWEEPS[args.sweep](base)
        if args.only:
            known = {r.group for r in runs}
            if unknown := set(args.only) - known:
                raise ValueError(f"--only: no group {', '.join(sorted(unknown))} in sweep "
                                 f"{args.sweep} (groups: {', '.join(sorted(known))})")
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
        for rates, conc, load, kind in _points(args, closed, loads):
            axes = SweepAxes(
                policies=args.policy, net_delays_s=args.net_delay,
                gossip_intervals_s=args.gossip_interval, skews=args.skew,
                cache_tokens=args.cache_tokens, nodes=args.nodes, rates=rates, concurrency=conc,
            )  # fmt: skip
            got = expand(axes, b)
            if pair:
                got = paired(got)
            suffix = tag
            if load is not None:
                suffix += f"-L{load:g}"
                got = [replace(s, workload=replace(s.workload, load=load, schedule=kind))
                       for s in got]  # fmt: skip
            elif kind is Schedule.BURSTY and rates != [None]:
                got = [replace(s, workload=replace(s.workload, schedule=kind)) for s in got]
            if kind is Schedule.BURSTY and (load is not None or rates != [None]):
                suffix += "-bursty"
            specs += [_tagged(s, suffix) for s in got]
    return specs


Point = tuple[list[float | None], list[int], float | None, Schedule]  # rates, clients, load


def _points(args: argparse.Namespace, closed: list[int], loads: list[float]) -> list[Point]:
    """The schedules of the sweep: closed loops, then each rate and each load under each
    kind of arrivals."""
    points: list[Point] = [([None], closed, None, Schedule.POISSON)] if closed else []
    kinds = getattr(args, "arrivals", None) or [Schedule.POISSON]
    if args.rate:
        points += [(list(args.rate), [1], None, kind) for kind in kinds]
    return points + [([None], [1], load, kind) for load in loads for kind in kinds]


def _entry_tag(spec: RunSpec) -> str:
    """Run-name tags of the axes every run of the sweep shares: random entries, regions."""
    tag = "" if spec.workload.entry is Entry.GIVEN else f"-e{spec.workload.entry.value}"
    regions = spec.region_map
    return tag + ("" if regions is None else "-R" + "+".join(regions.names))


def _tagged(spec: RunSpec, suffix: str) -> RunSpec:
    """``spec`` with ``suffix`` on its name and lockstep key (workload kind, load fraction:
    axes the sweep's run names do not carry)."""
    if not suffix:
        return spec
    return replace(spec, name=spec.name + suffix,
                   lockstep=spec.lockstep + suffix if spec.lockstep else "")  # fmt: skip


def trace_has_times(path: str | None) -> bool:
    return bool(path) and any(r.t is not None for r in trace.load(path or ""))
