"""``make vllm-kv-faults``: a real vLLM's KV-event stream broken on purpose, and a node that
must keep its index exact.

Theory of operation
-------------------
One vLLM CPU server (``bench/vllm_server.py``; its replay socket keeps ``--buffer-steps``
batches), the fault proxy (``chaos/kv_proxy.py``) on its PUB stream, one node
(``--engine vllm``) subscribed to the proxy and replaying from vLLM's own replay socket::

    vLLM PUB ──▶ KvProxy (faults) ──▶ node SUB        vLLM ROUTER ◀── node DEALER (replay)
    vLLM PUB ──▶ the bench's own subscriber (the reference stream, no faults)

Phases, each ``--requests`` streaming requests one in flight (so the engine's
``usage.prompt_tokens_details.cached_tokens`` is each request's truth ``A``), each sent once
the node has handled every batch the proxy forwarded (so a mismatch is the faults', not the
subscriber's few milliseconds behind)::

    clean       no fault
    drop        each batch lost with probability p
    duplicate   each batch sent twice back to back with probability p
    reorder     each batch held back behind the next with probability p
    stale       each batch sent again 3 batches later with probability p
    restart     the proxy's socket closed for --pause s before every 4th request
    burst       --buffer-steps + 4 batches in a row lost: beyond what the replay holds
                (this phase sends that many requests more)

After each phase the faults stop and clean requests go until the node has every batch (a
loss shows only at the next batch). Per request the node's prediction ``P``
(``x-radixmesh-cached-tokens``) against ``A``: a mismatch is ``unseen`` when at the moment
it was sent the engine had published a batch the proxy had not forwarded (lost, held or
late: the node could not know yet), ``beyond_buffer`` in the burst phase when ``P < A`` (the
replay could not cover the gap, the index was dropped and under-reports until the blocks
are stored again), ``timing`` when ``bench/mismatch.py``'s rule, applied to the bench's own
fault-free subscription, finds the engine's cache changed between acceptance and scheduling
or the node's subscriber a batch behind (the same race ``make vllm-concurrency`` classifies),
else an **index error**. At each phase's end the node's index size
(``/mesh``) is compared with the reference index replayed from the bench's own subscriber.
Written to ``OUT/vllm_kv_faults.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from radixmesh.bench.mismatch import Seen, stream_of
from radixmesh.bench.mismatch import classify as classify_timing
from radixmesh.bench.vllm_capture import Capture
from radixmesh.bench.vllm_check import _mesh_block, node_options, prompt_ids
from radixmesh.bench.vllm_replay import build_workload, send_stream
from radixmesh.bench.vllm_server import (
    READY_TIMEOUT_S,
    VllmServer,
    save_model_dir,
    vllm_parser,
    vllm_version,
    wait_subscribed,
)
from radixmesh.chaos.kv_proxy import KvProxy, ProxyFaults
from radixmesh.results.records import Record
from radixmesh.runtime.cluster import LocalCluster, free_ports
from radixmesh.workload.request import Request

PHASES = ("clean", "drop", "duplicate", "reorder", "stale", "restart", "burst")
KV_COUNTERS = ("gaps", "replays", "duplicates", "resets", "replay_failures", "malformed")


def classify(phase: str, predicted: int, actual: int, hidden: bool,
             timing: str | None = None) -> str:
    """One request's verdict (module docstring); ``timing``: ``bench/mismatch.py``'s verdict
    on the fault-free reference stream, for a mismatch no fault explains."""
    if predicted == actual:
        return "match"
    if hidden:
        return "unseen"
    if phase == "burst" and predicted < actual:
        return "beyond_buffer"
    if timing in ("evicted", "inserted", "lagged"):
        return "timing"
    return "index_error"


class Run:
    """The engine, proxy, node and reference subscriber of one run."""

    def __init__(self, engine: VllmServer, proxy: KvProxy, cluster: LocalCluster,
                 capture: Capture, args: argparse.Namespace) -> None:
        self.engine, self.proxy, self.cluster, self.capture = engine, proxy, cluster, capture
        self.args = args
        self.url = cluster.urls[0]
        self.prompts = prompt_ids(engine.model_dir)

    def kv_state(self) -> dict[str, Any]:
        return self.cluster.mesh(0).get("kv_events") or {}

    def start_phase(self, phase: str, i: int) -> None:
        p = self.args.p
        faults = {"drop": ProxyFaults(drop=p), "duplicate": ProxyFaults(duplicate=p),
                  "reorder": ProxyFaults(reorder=p, hold_s=0.5), "stale": ProxyFaults(stale=p)}
        if i == 0:
            self.proxy.set_faults(faults.get(phase, ProxyFaults()))
            if phase == "burst":
                self.proxy.burst(self.args.buffer_steps + 4)
        if phase == "restart" and i % 4 == 0:
            self.proxy.restart(self.args.pause)
            time.sleep(self.args.pause)  # the requests go while the socket is down

    async def one(self, http: httpx.AsyncClient, phase: str, req: Request) -> dict[str, Any]:
        rec = Record(run="kv-faults", policy="cost", seq=0, id=req.id, group=req.group,
                     entry=0, entry_node=self.cluster.node_ids[0], t_send=0.0)
        await self.caught_up()
        t_mono = time.monotonic()
        marks: dict[str, float] = {}
        actual = await send_stream(http, self.url, req, rec, time.perf_counter(), marks)
        if not rec.ok or actual is None:
            return {"phase": phase, "id": req.id, "error": rec.error or "no usage"}
        predicted = rec.cached_tokens or 0
        hidden = self.proxy.log.hidden_at(t_mono)
        timing = None
        if predicted != actual and not hidden:  # what the engine's own stream says of it
            end = marks["sent"] + rec.latency_s
            timing = classify_timing(self.reference(), Seen(
                req.id, tuple(self.prompts(req)), predicted, actual, marks["sent"],
                marks.get("headers", end), marks.get("first", end))).kind
        return {"phase": phase, "id": req.id, "predicted": predicted, "actual": actual,
                "hidden": hidden, "timing": timing,
                "class": classify(phase, predicted, actual, hidden, timing)}

    def reference(self) -> Any:
        """The engine's own stream so far, from the bench's fault-free subscriber."""
        return stream_of(list(self.capture.timed[0]), _mesh_block(self.args.block_size),
                         self.args.block_size)

    def node_next_seq(self) -> int | None:
        pubs = self.kv_state().get("publishers") or [{}]
        value = pubs[0].get("next_seq")
        return value if isinstance(value, int) else None

    async def caught_up(self, timeout: float = 2.0) -> None:
        """Until the node has handled every batch the proxy sent it (its tracker past the
        highest seq forwarded): the subscriber's few milliseconds are not what this run
        measures (``make vllm-concurrency`` classifies that race)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            sent = max((s for _, s in self.proxy.log.forwarded), default=-1)
            if (self.node_next_seq() or 0) > sent:
                return
            await asyncio.sleep(0.01)

    async def flush(self, http: httpx.AsyncClient, clean: Sequence[Request]) -> int:
        """Clean requests until the node has every batch the engine published; how many."""
        self.proxy.set_faults(ProxyFaults())
        for n, req in enumerate(clean, 1):
            await self.one(http, "flush", req)
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                high = max((s for _, s in self.proxy.log.received), default=-1)
                if self.node_next_seq() == high + 1:
                    return n
                await asyncio.sleep(0.05)
        return -1

    def reference_blocks(self) -> int:
        """Blocks in an index replayed from the bench's own, fault-free subscription."""
        stream = self.reference()
        index = stream.fresh_index()
        for ev in stream.events:
            index.apply_event(ev)
        return len(index)

    async def phase(self, http: httpx.AsyncClient, phase: str, reqs: Sequence[Request],
                    clean: Sequence[Request]) -> dict[str, Any]:
        before = dict(self.kv_state().get("counters") or {})
        since = time.monotonic()
        rows = []
        for i, req in enumerate(reqs):
            self.start_phase(phase, i)
            rows.append(await self.one(http, phase, req))
        flushed = await self.flush(http, clean)
        await asyncio.sleep(0.5)  # the reference subscriber's last batches
        state = self.kv_state()
        after = state.get("counters") or {}
        classes = [r.get("class", "error") for r in rows]
        return {"phase": phase, "requests": len(rows),
                **{c: classes.count(c) for c in
                   ("match", "unseen", "beyond_buffer", "timing", "index_error", "error")},
                "proxy": {k: v for k, v in self.proxy.log.counts(since).items() if v},
                "node": {k: after.get(k, 0) - before.get(k, 0) for k in KV_COUNTERS},
                "flush_requests": flushed,
                "index_blocks": (state.get("index") or {}).get("blocks"),
                "reference_blocks": self.reference_blocks(),
                "mismatches": [r for r in rows if r.get("class") not in ("match", None)][:10]}


async def run_phases(run: Run, phases: Sequence[str], n: int, seed: int
                     ) -> list[dict[str, Any]]:
    burst = n + run.args.buffer_steps + 4  # the burst eats a batch per request, then n more
    pool = build_workload(n * len(phases) + burst, 8, run.args.scale, seed)
    clean = build_workload(8, 8, run.args.scale, seed + 1)
    out = []
    start = 0
    async with httpx.AsyncClient(timeout=300.0, trust_env=False) as http:
        for phase in phases:
            size = burst if phase == "burst" else n
            out.append(await run.phase(http, phase, pool[start:start + size], clean))
            start += size
            print(json.dumps({x: y for x, y in out[-1].items() if x != "mismatches"}),
                  flush=True)
    return out


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"vLLM {doc['vllm']} CPU, one engine (replay buffer {doc['buffer_steps']} "
             f"batches), fault proxy on its KV-event stream, one node; {doc['requests']} "
             f"requests per phase, one in flight; fault probability {doc['p']}; "
             f"{doc['date']}.", "",
             "| phase | proxy did | node saw | index == engine | unseen | beyond buffer | "
             "timing | index errors | index blocks (node / reference) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["phases"]:
        proxy = ", ".join(f"{k} {v}" for k, v in r["proxy"].items()) or "—"
        node = ", ".join(f"{k} {v}" for k, v in r["node"].items() if v) or "—"
        lines.append(f"| {r['phase']} | {proxy} | {node} | {r['match']}/{r['requests']} | "
                     f"{r['unseen']} | {r['beyond_buffer']} | {r['timing']} | "
                     f"{r['index_error']} | "
                     f"{r['index_blocks']} / {r['reference_blocks']} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = vllm_parser("radixmesh.chaos.kv_socket", __doc__, "runs/vllm-kv-faults")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--requests", type=int, default=16, help="per phase")
    ap.add_argument("--p", type=float, default=0.3, help="probability of each phase's fault")
    ap.add_argument("--pause", type=float, default=1.0, help="restart: socket down this long")
    ap.add_argument("--buffer-steps", type=int, default=16, help="vLLM's replay buffer")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--num-blocks", type=int, default=48)
    ap.add_argument("--scale", type=float, default=0.5)
    ap.add_argument("--gossip-interval", default="0.1")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if bad := [x for x in args.phases.split(",") if x not in PHASES]:
        ap.error(f"unknown phases {bad}; choose from {PHASES}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = save_model_dir(out / "model", args.seed)
    http_port, events, replay, proxy_port = free_ports(4)
    engine = VllmServer("vllm0", args.vllm_python, model_dir, http_port, events, replay,
                        args.block_size, args.num_blocks, out / "vllm0.log",
                        buffer_steps=args.buffer_steps)
    proxy = KvProxy(f"tcp://127.0.0.1:{events}", proxy_port, seed=args.seed)
    per_node = {0: {"engine_url": engine.url, "kv_events": f"tcp://*:{proxy_port}",
                    "kv_replay": f"tcp://*:{replay}"}}
    capture: Capture | None = None
    try:
        engine.start()
        engine.wait_ready(time.monotonic() + READY_TIMEOUT_S)
        proxy.start()
        capture = Capture([f"tcp://127.0.0.1:{events}"])
        cluster = LocalCluster(1, node_options("cost", args, model_dir), per_node=per_node,
                               log_dir=out / "nodes", python=sys.executable)
        with cluster:
            wait_subscribed(cluster)
            run = Run(engine, proxy, cluster, capture, args)
            phases = asyncio.run(run_phases(run, args.phases.split(","), args.requests,
                                            args.seed))
    finally:  # every process it started goes, whatever happened
        if capture is not None:
            capture.close()
        proxy.close()
        engine.stop()
    doc = {"vllm": vllm_version(args.vllm_python), "date": time.strftime("%Y-%m-%d %H:%M"),
           "buffer_steps": args.buffer_steps, "requests": args.requests, "p": args.p,
           "phases": phases, "command": " ".join(["python -m radixmesh.chaos.kv_socket",
                                                  *(argv or sys.argv[1:])])}
    (out / "vllm_kv_faults.json").write_text(json.dumps(doc, indent=2), encoding="utf-8")
    text = markdown(doc)
    (out / "vllm_kv_faults.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
