"""``radixmesh chaos``: inject faults into a fresh local cluster and print what they cost.

    radixmesh chaos --quick --json     CI-sized: every fault once, ~1-2 minutes
    radixmesh chaos                    the full version: more requests, more loss levels
    radixmesh chaos --soak 10m         open-loop load with periodic kill -9 + restart
    radixmesh chaos --operate join --hosts 4,16      join time on emulated hosts (root)
    radixmesh chaos --operate rolling                rolling restart at 50 % of capacity
    radixmesh chaos --operate overload               2x capacity for 60 s (admission)

JSON (``--json``): ``{"faults": [{"fault", "requests", "failures", "lost", "passed", "notes",
"checks", "figures"}], "config": {...}}``; with ``--soak``: ``{"soak": {...}}``. Exit status 1
if any non-timing check failed (a client-visible failure, a wrong answer, a view that never
converged, ...), 0 otherwise; timing criteria are reported but do not fail the run (this is
often a shared, noisy machine).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from radixmesh.chaos.env import SERVE_OPTIONS, ChaosConfig, ChaosEnv
from radixmesh.chaos.faults import FaultPlan
from radixmesh.chaos.report import FaultResult, to_markdown
from radixmesh.chaos.soak import SoakConfig, run_soak
from radixmesh.chaos.suite import run_all
from radixmesh.core.units import parse_duration
from radixmesh.options import add_option, add_options
from radixmesh.progress import timed

_SERVE_FLAGS = ("preset", "policy", "gossip_interval", "forward_timeout")  # chaos's own flags
FAULTS = ("auth", "kill", "hang", "stream", "loss", "partition", "slow", "wrongkey", "sidechannel")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="CI-sized run of every fault")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--soak", metavar="DURATION",
                        help="run the soak for this long (e.g. 10m, 180s) instead of the faults")
    parser.add_argument("--rate", type=float, default=3.0, help="soak: requests per second")
    parser.add_argument("--kill-every", default="45s", help="soak: one kill+restart per ...")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {FAULTS}")
    add_options(parser, {"nodes": ChaosConfig().nodes,
                         **{k: SERVE_OPTIONS[k] for k in _SERVE_FLAGS}})
    add_option(parser, "seed", SERVE_OPTIONS["seed"],
               help="seed of the engines' weights, the prompts and the soak (default 0)")
    parser.add_argument("--no-key", action="store_true",
                        help="run without a cluster key (peer authentication off)")
    parser.add_argument("--log-dir", help="keep node logs here (default: a temp dir)")
    parser.add_argument("--out", help="also write the JSON report to this file")
    parser.add_argument("--operate", choices=("join", "rolling", "overload"),
                        help="an operating figure (chaos/operate.py, chaos/join.py) instead "
                        "of the faults")
    parser.add_argument("--hosts", default="4,16", help="join: emulated host counts")
    parser.add_argument("--trials", type=int, default=3, help="join: joins per host count")
    parser.add_argument("--load", type=float, default=None,
                        help="rolling / overload: open-loop rate as a multiple of the measured "
                        "capacity (default 0.5 / 2)")
    parser.add_argument("--duration", default="60s", help="overload: how long arrivals go on")
    parser.add_argument("--max-tokens", type=int, default=16, help="rolling / overload")
    parser.add_argument("--serve", action="append", default=[], metavar="KEY=VALUE",
                        help="rolling / overload: extra `radixmesh serve` option for every "
                        "node, e.g. --serve max_queue_wait=2s (repeatable)")


def _config(args: argparse.Namespace) -> ChaosConfig:
    serve = tuple((k, getattr(args, k)) for k in (*_SERVE_FLAGS, "seed"))
    return ChaosConfig(nodes=args.nodes, keyed=not args.no_key, log_dir=args.log_dir,
                       serve=serve)


def _faults(args: argparse.Namespace, cfg: ChaosConfig) -> tuple[dict[str, object], bool]:
    only = tuple(x.strip() for x in args.only.split(",") if x.strip())
    unknown = [x for x in only if x not in FAULTS]
    if unknown:
        raise ValueError(f"unknown faults {unknown}; choose from {FAULTS}")
    plan = FaultPlan.quick() if args.quick else FaultPlan.full()
    t0 = time.monotonic()
    with ChaosEnv(cfg) as env:
        startup = time.monotonic() - t0
        results = run_all(env, plan, only)
    doc: dict[str, object] = {
        "faults": [r.to_json() for r in results],
        "config": {**cfg.to_json(), "plan": asdict(plan)},
        "startup_s": round(startup, 1),
        "elapsed_s": round(time.monotonic() - t0, 1),
    }
    if not args.json:
        _print_table(results)
    return doc, all(r.functional_ok for r in results)


def _print_table(results: list[FaultResult]) -> None:
    print(to_markdown(results))
    timing = [(r.fault, c) for r in results for c in r.failed_checks()
              if any(x["what"] == c and x["timing"] for x in r.checks)]
    for fault, what in timing:
        print(f"note: timing criterion missed in '{fault}': {what}", file=sys.stderr)


def _soak(args: argparse.Namespace, cfg: ChaosConfig) -> tuple[dict[str, object], bool]:
    soak = SoakConfig(duration_s=parse_duration(args.soak), rate=args.rate,
                      kill_every_s=parse_duration(args.kill_every), seed=args.seed)
    with ChaosEnv(cfg) as env, timed(soak.duration_s, "soak"):
        report = run_soak(env, soak)
    doc: dict[str, object] = {"soak": report, "config": {**cfg.to_json(), "soak": asdict(soak)}}
    if not args.json:
        keys = ("duration_s", "rate", "requests", "errors", "lost_or_wrong", "p50_s", "p99_s",
                "max_s", "ttft_p50_s", "ttft_p99_s", "kills", "restarts", "locked_tokens_at_end",
                "nodes_down_at_end", "chaos_error", "passed")
        for k in keys:
            print(f"{k:>22}: {report[k]}")
        for sample in report["rss_mb"]:  # type: ignore[attr-defined]
            print(f"{'rss_mb, cache tokens':>22}: {sample}")
    return doc, bool(report["passed"])


def _operate(args: argparse.Namespace) -> tuple[dict[str, object], bool]:
    from radixmesh.chaos import join, operate

    if args.operate == "join":
        counts = [int(x) for x in args.hosts.split(",") if x.strip()]
        runs = [join.run_join(join.JoinScenario(hosts=h, preset=args.preset,
                                              trials=args.trials), args.log_dir)
                for h in counts]
        return {"join": runs}, True
    extra: dict[str, object] = {}
    for item in args.serve:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--serve wants KEY=VALUE, got {item!r}")
        extra[key.strip()] = value.strip()
    default_load = 0.5 if args.operate == "rolling" else 2.0
    cfg = operate.OperateConfig(
        nodes=args.nodes, preset=args.preset, max_tokens=args.max_tokens, seed=args.seed,
        load=default_load if args.load is None else args.load,
        duration_s=parse_duration(args.duration), extra=tuple(extra.items()))
    if args.operate == "rolling":
        report = operate.run_rolling(cfg, args.log_dir)
        ok = report["failed"] == 0 and report["wrong_or_lost"] == 0
    else:
        report = operate.run_overload(cfg, args.log_dir)
        ok = report["lost"] == 0 and report["wrong_answers"] == 0
    if not args.json:
        for key, value in report.items():
            if key != "config":
                print(f"{key:>28}: {value}")
    return {args.operate: report}, ok


def run(args: argparse.Namespace) -> int:
    try:
        if args.operate:
            doc, ok = _operate(args)
            if args.json:
                print(json.dumps(doc, indent=2, default=str))
            if args.out:
                with open(args.out, "w", encoding="utf-8") as fh:
                    fh.write(json.dumps(doc, indent=2, default=str) + "\n")
            return 0 if ok else 1
        cfg = _config(args)
        doc, ok = _soak(args, cfg) if args.soak else _faults(args, cfg)
    except ValueError as exc:
        print(f"radixmesh chaos: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(doc, indent=2, default=str)
    if args.json:
        print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    return 0 if ok else 1
