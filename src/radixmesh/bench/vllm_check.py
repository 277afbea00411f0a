"""``make vllm-check``: two real vLLM CPU servers, two radixmesh nodes in front, one workload.

Theory of operation
-------------------
vLLM lives in its own virtual environment (``.venv-vllm``: it pins other versions than
radixmesh); this program runs in radixmesh's and only talks to it over HTTP and ZMQ::

    save_random_model_dir (Qwen2 "tiny", random weights, tokenizer.json)
    2 x  <vllm-python> -m vllm.entrypoints.openai.api_server --model DIR --block-size B
            --kv-events-config {zmq PUB tcp://*:P, replay ROUTER tcp://*:R}
            --enable-prompt-tokens-details --num-gpu-blocks-override K
    for policy in (cost, none), back to back:
        POST /reset_prefix_cache on both engines (VLLM_SERVER_DEV_MODE=1)
        2 x  radixmesh serve --engine vllm --engine-url ... --kv-events tcp://*:P
                --kv-replay tcp://*:R --tokenizer DIR --engine-block-size B --policy P
             (peers of each other: ``runtime.cluster.LocalCluster``)
        the same requests, one in flight at a time (``--concurrency``: more), entry node
        round-robin; with one in flight both engines' ``/metrics``
        (``vllm:prefix_cache_queries`` / ``_hits``) are read around each request, so the
        served engine's hit delta is that request's true cached-token count

Requests stream, so the response headers carry what radixmesh knew before the engine ran:
``x-radixmesh-cached-tokens`` is the serving node's KV-event index match at acceptance (any
policy), ``x-radixmesh-expected-cached-tokens`` the router's estimate it routed on (``none``
claims 0 by design). Both are compared per request with the engine's truth, the served
engine's ``/metrics`` hit delta (and that with the engine's own
``usage.prompt_tokens_details.cached_tokens``, which must agree). ``--capture DIR`` also
subscribes to the first engine's publisher itself and saves its first batches (and one replay
answer) as golden fixtures for the decoder tests. Figures are
printed and written to ``OUT/vllm_check.md`` and ``OUT/vllm_check.json``; records per request
to ``OUT/records-<policy>.jsonl``, both engines' timed event batches with every compared
request and its verdict to ``OUT/events-<policy>.msgpack`` (under a megabyte a run).
Every process it starts is stopped on exit (process
groups; the nodes die with this process too).

The parts: ``bench/vllm_server.py`` (the engine process, model directory),
``bench/vllm_replay.py`` (workload, streaming client, per-request agreement),
``bench/vllm_capture.py`` (the bench's own subscriber, fixtures); ``chaos/engines.py``,
``chaos/kv_socket.py``, ``bench/vllm_tenants.py`` and ``bench/llamacpp_check.py`` reuse them;
``bench/vllm_report.py`` writes the report.
``--concurrency 4,16`` runs every policy at each level on the same engines; every mismatch at
concurrency is classified (``bench/mismatch.py``) from the engines' own KV events, which the
bench subscribes to itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from radixmesh.bench.mismatch import classify_all, stream_of
from radixmesh.bench.vllm_capture import (
    Capture,
    pick_fixture_frames,
    save_fixtures,
    save_run_fixture,
    save_whole_run,
)
from radixmesh.bench.vllm_replay import (
    Agreement,
    _ms,
    _pct,
    build_workload,
    error_reasons,
    replay_run,
    warm_up,
)
from radixmesh.bench.vllm_report import markdown
from radixmesh.bench.vllm_rounds import paired_figures, round_orders
from radixmesh.bench.vllm_server import (
    READY_TIMEOUT_S,
    VllmServer,
    save_model_dir,
    vllm_parser,
    vllm_version,
    wait_subscribed,
)
from radixmesh.results.records import Record
from radixmesh.results.run_summary import summarize
from radixmesh.runtime.cluster import free_ports
from radixmesh.workload.request import Request


# ---------------------------------------------------------------------------- main
@contextlib.contextmanager
def engines_running(args: argparse.Namespace, model_dir: Path, out: Path
                    ) -> Iterator[list[VllmServer]]:
    ports = free_ports(6)
    cores = os.cpu_count() or 1
    engines = [VllmServer(f"vllm{i}", args.vllm_python, model_dir, ports[3 * i],
                          ports[3 * i + 1], ports[3 * i + 2], args.block_size, args.num_blocks,
                          out / f"vllm{i}.log", threads=args.engine_threads,
                          cpus=str(i % cores) if args.pin else None)
               for i in range(2)]
    try:
        for e in engines:
            e.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        for e in engines:
            e.wait_ready(deadline)
        yield engines
    finally:
        for e in engines:
            e.stop()


def node_options(policy: str, args: argparse.Namespace, model_dir: Path) -> dict[str, object]:
    return {"policy": policy, "log_level": "warning", "gossip_interval": args.gossip_interval,
            "engine": "vllm", "tokenizer": str(model_dir), "model": "tiny",
            "engine_block_size": args.block_size, "threads": 1}


def run_policy(policy: str, args: argparse.Namespace, model_dir: Path, out: Path,
               engines: Sequence[VllmServer], reqs: Sequence[Request]
               ) -> tuple[list[Record], Agreement]:
    from radixmesh.runtime.cluster import LocalCluster

    for e in engines:
        e.reset_prefix_cache()
    per_node = {i: {"engine_url": e.url, "kv_events": f"tcp://*:{e.events_port}",
                    "kv_replay": f"tcp://*:{e.replay_port}"} for i, e in enumerate(engines)}
    cluster = LocalCluster(2, node_options(policy, args, model_dir), per_node=per_node,
                           log_dir=out / f"nodes-{policy}", python=sys.executable)
    with cluster:
        wait_subscribed(cluster)
        node_engine = {nid: i for i, nid in enumerate(cluster.node_ids)}
        return asyncio.run(replay_run(policy, cluster.urls, cluster.node_ids, engines,
                                      node_engine, reqs, args.concurrency,
                                      prompt_ids(model_dir)))


def prompt_ids(model_dir: Path) -> Callable[[Request], list[int]]:
    """A request's prompt token ids as the node makes them (``runtime/app.py``)."""
    from radixmesh.engine.tokenizers import HFTokenizer

    tok = HFTokenizer(model_dir)

    def ids(req: Request) -> list[int]:
        if req.prompt is not None:
            return list(tok.encode(req.prompt))
        assert req.messages is not None
        return list(tok.apply_chat_template([{"role": m.role, "content": m.content}
                                             for m in req.messages]))
    return ids


def classify_run(agreement: Agreement, capture: Capture, block_size: int, since: float) -> None:
    """Every mismatch of one policy's run classified against the engines' own streams, from
    ``since`` on (the caches' reset before the run: its nodes start with empty indexes, and a
    reset need not publish AllBlocksCleared, so earlier batches would haunt the replay)."""
    mesh = _mesh_block(block_size)
    streams = [stream_of([f for f in t if f[0] >= since], mesh, block_size)
               for t in capture.timed]
    tally = classify_all(streams, agreement.seen)
    agreement.verdicts = [v.kind for v in tally.verdicts]
    agreement.mismatch = tally.to_json() | {
        "events": [len(st.events) for st in streams],
        "messages": [len(t) for t in capture.timed],
        "seq_gaps": [_seq_gaps(t) for t in capture.timed]}


def _mesh_block(engine_block_size: int) -> int:
    """The nodes' block size in front of engines of ``engine_block_size``."""
    from radixmesh.core.blocks import DEFAULT_BLOCK_SIZE
    from radixmesh.engine.http_engine import mesh_block_size

    return mesh_block_size(DEFAULT_BLOCK_SIZE, engine_block_size)


def _seq_gaps(timed: Sequence[tuple[float, Sequence[bytes]]]) -> int:
    """Messages the bench's own subscriber missed (seq jumps), which would blur its replay."""
    seqs = [int.from_bytes(f[1], "big") for _, f in timed if len(f) == 3]
    return sum(1 for a, b in itertools.pairwise(seqs) if b != a + 1)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = vllm_parser("radixmesh.bench.vllm_check", __doc__, "runs/vllm-check")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--scale", type=float, default=0.5, help="prompt length scale")
    ap.add_argument("--block-size", type=int, default=128, help="vLLM's (CPU: multiple of 32)")
    ap.add_argument("--num-blocks", type=int, default=48, help="KV blocks per engine")
    ap.add_argument("--engine-threads", type=int, default=1)
    ap.add_argument("--gossip-interval", default="0.1")
    ap.add_argument("--policies", default="cost,none")
    ap.add_argument("--concurrency", default="1",
                    help="requests in flight; a list (4,16) runs every policy at each")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=16,
                    help="the workload's first N requests sent straight to each engine, "
                    "untimed, before the first run (0: none)")
    ap.add_argument("--pin", action="store_true",
                    help="engine i on core i (taskset, VLLM_CPU_OMP_THREADS_BIND): each its own "
                    "compute, as in a deployment; the nodes and the bench float")
    ap.add_argument("--rounds", type=int, default=1,
                    help="alternate the policies N times (A B, B A, ...) and report their "
                    "paired latency ratio with a bootstrap interval (bench/vllm_rounds.py)")
    ap.add_argument("--capture", metavar="DIR", help="save raw event batches as fixtures")
    ap.add_argument("--capture-run", metavar="DIR",
                    help="save engine 0's timed batches and requests of each run with their "
                    "verdicts (the mismatch classifier's fixtures)")
    ap.add_argument("--capture-whole", action="store_true",
                    help="with --capture-run: every request and both engines' batches "
                    "(bench/evict_check.py's input; megabytes)")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = save_model_dir(out / "model", args.seed)
    reqs = build_workload(args.requests, args.groups, args.scale, args.seed)
    version = vllm_version(args.vllm_python)
    print(f"vllm {version}; {len(reqs)} requests; starting 2 engines (logs in {out})",
          flush=True)
    levels = [int(c) for c in str(args.concurrency).split(",")]
    orders = round_orders(args.policies.split(","), args.rounds)
    t_start = time.perf_counter()
    with engines_running(args, model_dir, out) as engines:
        print(f"engines ready in {time.perf_counter() - t_start:.0f} s", flush=True)
        if args.warmup:  # untimed; each run resets the caches anyway
            asyncio.run(warm_up(engines, reqs[:args.warmup], max(levels)))
        # both publishers, each in its own seq order, as the nodes see them (fixtures: #0)
        capture = Capture([f"tcp://127.0.0.1:{e.events_port}" for e in engines])
        try:
            policies = [run_one(level, policy, args, model_dir, out, engines, reqs, capture,
                                _run_name(policy, level, k, len(levels) > 1, args.rounds))
                        for level in levels for k, order in enumerate(orders)
                        for policy in order]
            if args.capture:
                _save_capture(args, capture, engines, version)
        finally:
            capture.close()
    result = _result(args, version, len(reqs), levels, orders, policies, argv)
    (out / "vllm_check.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    text = markdown(result)
    (out / "vllm_check.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


def _result(args: argparse.Namespace, version: str, requests: int, levels: list[int],
            orders: list[list[str]], policies: list[dict[str, Any]],
            argv: Sequence[str] | None) -> dict[str, Any]:
    """The run's ``vllm_check.json``: its setup, each policy's figures, the paired ratios."""
    return {"vllm_version": version, "date": time.strftime("%Y-%m-%d"),
            "model": "hidden 256, 4 layers, fp32", "block_size": args.block_size,
            "num_blocks": args.num_blocks, "requests": requests, "groups": args.groups,
            "concurrency": ",".join(map(str, levels)),
            "prompt_tokens_mean": summarize_prompt_mean(policies),
            "pinned": bool(args.pin), "rounds": args.rounds, "warmup": args.warmup,
            "paired": _paired(policies, levels, orders[0]) if args.rounds > 1 else [],
            "policies": [{k: v for k, v in p.items() if k != "records"} for p in policies],
            "command": " ".join(["python -m radixmesh.bench.vllm_check",
                                 *(argv or sys.argv[1:])])}


def _run_name(policy: str, level: int, round_no: int, several: bool, rounds: int) -> str:
    name = f"{policy}-c{level}" if several else policy
    return f"{name}-r{round_no}" if rounds > 1 else name


def _paired(runs: Sequence[dict[str, Any]], levels: Sequence[int], order: Sequence[str]
            ) -> list[dict[str, Any]]:
    """Per concurrency, the first policy against the second over the rounds."""
    a, b = order[0], order[1]
    out = []
    for level in levels:
        def rounds_of(policy: str) -> list[list[Record]]:
            return [r["records"] for r in runs
                    if r["base"] == policy and r["concurrency"] == level]  # noqa: B023
        pooled = {p: summarize([x for rs in rounds_of(p) for x in rs]) for p in (a, b)}
        out.append({"concurrency": level, "a": a, "b": b, "pooled": pooled,
                    "load_1min": [r["load_1min"] for r in runs if r["concurrency"] == level],
                    **paired_figures(rounds_of(a), rounds_of(b))})
    return out


def run_one(level: int, policy: str, args: argparse.Namespace, model_dir: Path, out: Path,
            engines: Sequence[VllmServer], reqs: Sequence[Request], capture: Capture,
            name: str) -> dict[str, Any]:
    """One policy at one concurrency: records, agreement, classified mismatches."""
    args.concurrency = level
    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    records, agreement = run_policy(policy, args, model_dir, out, engines, reqs)
    classify_run(agreement, capture, args.block_size, since=t0)
    # both engines' batches of this run and every request: any verdict can be re-judged
    # offline (``bench/evict_check.py`` reads the same file)
    save_whole_run(out / f"events-{name}.msgpack",
                   [[f for f in t if f[0] >= t0] for t in capture.timed], agreement,
                   _mesh_block(args.block_size), args.block_size)
    if args.capture_run:
        target = Path(args.capture_run) / f"run-{name}.msgpack"
        n = (save_whole_run(target, [[f for f in t if f[0] >= t0] for t in capture.timed],
                            agreement, _mesh_block(args.block_size), args.block_size)
             if args.capture_whole else
             save_run_fixture(target, [f for f in capture.timed[0] if f[0] >= t0], agreement,
                              _mesh_block(args.block_size), args.block_size))
        print(f"captured {n} requests of a {level}-in-flight run into {args.capture_run}",
              flush=True)
    with open(out / f"records-{name}.jsonl", "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r.to_json()) + "\n")
    summary = summarize(records)
    load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(f"{name}: {len(records)} requests in {time.perf_counter() - t0:.0f} s; "
          f"predicted==actual {agreement.equal}/{agreement.requests}; "
          f"hit rate {_pct(summary['actual_hit_rate'])}; "
          f"mean {_ms(summary['mean_latency_s'])}, p99 {_ms(summary['p99_latency_s'])}; "
          f"load {load[0]} -> {load[1]}", flush=True)
    return {"policy": name, "base": policy, "concurrency": level, "load_1min": load,
            "summary": summary, "agreement": agreement.to_json(),
            "errors": error_reasons(records), "records": records}


def _save_capture(args: argparse.Namespace, capture: Capture, engines: Sequence[VllmServer],
                  version: str) -> None:
    replay = capture.replay(f"tcp://127.0.0.1:{engines[0].replay_port}")
    live = pick_fixture_frames(capture.frames)
    save_fixtures(Path(args.capture), live, replay[:2] + replay[-1:],
                  {"vllm": version, "block_size": args.block_size,
                   "captured": time.strftime("%Y-%m-%d"),
                   "live_messages_seen": len(capture.frames)})
    print(f"captured {len(live)} live + {min(len(replay), 3)} replay messages into "
          f"{args.capture}", flush=True)


def summarize_prompt_mean(policies: Sequence[dict[str, Any]]) -> float:
    values = [p["summary"].get("prompt_tokens_mean") or 0.0 for p in policies]
    return sum(values) / len(values) if values else 0.0


if __name__ == "__main__":
    raise SystemExit(main())
