"""``make vllm-chaos``: faults of a real vLLM engine under load, behind two radixmesh nodes.

Theory of operation
-------------------
The set-up of ``make vllm-check`` (``bench/vllm_check.py``: two vLLM CPU servers with KV
events, two nodes in front with ``--engine vllm``, policy ``cost``), and a closed-loop load of
streaming requests (entry round-robin) running in a thread for the whole run. Engine 1 (behind
node ``n1``) takes one fault after the other, each while the load runs::

    kill      SIGKILL of its process group, restarted on the same ports
    stop      SIGSTOP for --hold seconds, then SIGCONT
    seed      restarted with PYTHONHASHSEED and --prefix-caching-hash-algo sha256_cbor: other
              engine hashes for the same tokens (the node's index keys on tokens: rebuilt)
    blocksize restarted with --block-size 64 (the node was told 128): refused with the
              error as the reason, then restarted as it was

The load's client waits out a 429 (``Retry-After``, at most 5 s, 5 times) as the OpenAI SDK
does: with one engine gone the mesh has half its capacity, and its admission control sheds
load with 429s rather than queue without bound. Per fault: client requests that failed
(after those retries), split by whether a token had already reached the
client (those may end with an error event: they were streaming from the dead engine) or not
(target 0: retried on the peer); ``detect_s`` from the fault to ``n1``'s ``/mesh`` saying the
engine is down (polled every 50 ms); ``back_s`` from the engine answering again to ``n1``
taking it back; ``routed_s`` from then to the first request served by ``n1``'s engine;
after ``seed``, the index-vs-engine agreement of the requests ``n1`` served. Written to
``OUT/vllm_chaos.json`` and ``.md``; every process it starts is stopped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from radixmesh.bench.client import request_body
from radixmesh.bench.vllm_check import node_options
from radixmesh.bench.vllm_replay import build_workload
from radixmesh.bench.vllm_server import (
    READY_TIMEOUT_S,
    VllmServer,
    save_model_dir,
    wait_subscribed,
)
from radixmesh.core.headers import HEADER_CACHED, HEADER_SERVED_BY
from radixmesh.runtime.cluster import LocalCluster, free_ports
from radixmesh.runtime.metrics import parse_samples
from radixmesh.workload.request import Request

FAULTS = ("kill", "stop", "seed", "blocksize")
POLL_S = 0.05
MAX_RETRIES = 5  # a client's retries of a 429, each after min(Retry-After, MAX_WAIT_S)
MAX_WAIT_S = 5.0


@dataclass(slots=True)
class Sent:
    """One client request of the load."""

    t_sent: float
    t_end: float = 0.0
    served_by: str | None = None
    tokens: int = 0  # content chunks that reached the client
    error: str | None = None
    predicted: int | None = None  # x-radixmesh-cached-tokens
    cached: int | None = None  # the engine's usage cached_tokens
    retries: int = 0  # 429s answered by waiting Retry-After (as the OpenAI SDK does)


@dataclass(slots=True)
class ClosedLoopLoad:
    """Closed-loop streaming requests in a thread until ``stop``."""

    urls: Sequence[str]
    reqs: Sequence[Request]
    concurrency: int
    sent: list[Sent] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)

    def since(self, t: float) -> list[Sent]:
        return [s for s in list(self.sent) if s.t_sent >= t and s.t_end]

    async def _run(self) -> None:
        counter = iter(range(10**9))
        async with httpx.AsyncClient(timeout=120.0, trust_env=False) as http:
            async def worker() -> None:
                while not self._stop.is_set():
                    i = next(counter)
                    await self._one(http, self.urls[i % len(self.urls)],
                                    self.reqs[i % len(self.reqs)])
            await asyncio.gather(*(worker() for _ in range(self.concurrency)))

    async def _one(self, http: httpx.AsyncClient, url: str, req: Request) -> None:
        s = Sent(time.monotonic())
        self.sent.append(s)
        while True:
            wait = await self._try(http, url, req, s)
            if wait is None or s.retries >= MAX_RETRIES or self._stop.is_set():
                break
            s.retries += 1
            s.error = None
            await asyncio.sleep(wait)
        s.t_end = time.monotonic()

    async def _try(self, http: httpx.AsyncClient, url: str, req: Request, s: Sent
                   ) -> float | None:
        """One attempt; the seconds to wait before the next one after a 429 (else None)."""
        path, body = request_body(req, "tiny", stream=True)
        try:
            async with http.stream("POST", url + path, json=body) as resp:
                s.served_by = resp.headers.get(HEADER_SERVED_BY)
                s.predicted = int(resp.headers.get(HEADER_CACHED, "0") or 0)
                if resp.status_code != 200:
                    s.error = f"HTTP {resp.status_code}"
                    if resp.status_code == 429:
                        retry = float(resp.headers.get("retry-after", "1") or 1)
                        return min(max(retry, 0.1), MAX_WAIT_S)
                async for line in resp.aiter_lines():
                    _chunk(line, s)
        except (httpx.HTTPError, ValueError) as exc:
            s.error = s.error or type(exc).__name__
        return None


def _chunk(line: str, s: Sent) -> None:
    data = line[5:].strip() if line.startswith("data:") else ""
    if not data or data == "[DONE]":
        return
    chunk = json.loads(data)
    if "error" in chunk:
        s.error = str(chunk["error"])[:200]
    if any(c.get("text") for c in chunk.get("choices") or []):
        s.tokens += 1
    details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
    if isinstance(details.get("cached_tokens"), int):
        s.cached = details["cached_tokens"]


# ---------------------------------------------------------------------------- one fault
def _wait(cond: Callable[[], bool], timeout: float) -> float | None:
    """Seconds until ``cond`` held (None: not within ``timeout``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if cond():
                return time.monotonic() - t0
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(POLL_S)
    return None


def _health(cluster: LocalCluster, i: int) -> dict[str, Any]:
    return cluster.mesh(i).get("engine_health") or {}


# why requests were refused while a fault ran: each node's counters, the change over the fault
_WHY = ("forwards_refused", "admission_full", "pushback_started", "engine_retries", "rejected")


def _counters(cluster: LocalCluster) -> dict[str, float]:
    """Every node's refusal counters now (``_WHY``), as ``node:name``."""
    out: dict[str, float] = {}
    for i, node in enumerate(cluster.node_ids):
        with contextlib.suppress(httpx.HTTPError):
            for name, value in parse_samples(cluster.get(i, "/metrics").text).items():
                short = name.removeprefix("radixmesh_core_").removeprefix("radixmesh_")
                if short.startswith(_WHY):
                    out[f"{node}:{short.removesuffix('_total')}"] = value
    return out


def _restart(engine: VllmServer, extra_env: dict[str, str] | None = None,
             block_size: int | None = None, hash_algo: str | None = None) -> float:
    """Stop ``engine`` if it runs, start it again (other settings if given); its start time."""
    engine.stop()
    engine.extra_env = extra_env or {}
    if block_size:  # the same KV tokens (vLLM refuses a cache shorter than --max-model-len)
        engine.num_blocks = engine.num_blocks * engine.block_size // block_size
        engine.block_size = block_size
    engine.extra_args = ("--prefix-caching-hash-algo", hash_algo) if hash_algo else ()
    engine.start()
    engine.wait_ready(time.monotonic() + READY_TIMEOUT_S)
    return time.monotonic()


def run_fault(name: str, cluster: LocalCluster, engines: Sequence[VllmServer], load: ClosedLoopLoad,
              args: argparse.Namespace) -> dict[str, Any]:
    eng, t0 = engines[1], time.monotonic()
    out: dict[str, Any] = {"fault": name}
    before = _counters(cluster)
    assert eng.proc is not None
    if name == "kill":
        os.killpg(eng.proc.pid, signal.SIGKILL)
    elif name == "stop":
        os.killpg(eng.proc.pid, signal.SIGSTOP)
    elif name == "seed":
        eng.stop()
    elif name == "blocksize":
        t_up = _restart(eng, block_size=64)
        out["refused_after_s"] = _wait(lambda: str(_health(cluster, 1).get("reason", ""))
                                       .startswith("refused"), 120)
        out["refusal"] = _health(cluster, 1).get("reason")
    out["detect_s"] = out.get("refused_after_s") or _wait(
        lambda: not _health(cluster, 1).get("up", True), 30)
    if name == "stop":
        time.sleep(args.hold)
        os.killpg(eng.proc.pid, signal.SIGCONT)
        t_up = time.monotonic()
    elif name in ("kill", "blocksize"):
        t_up = _restart(eng, block_size=args.block_size)
    else:
        t_up = _restart(eng, {"PYTHONHASHSEED": "12345"}, hash_algo="sha256_cbor")
    out["back_s"] = _wait(lambda: _health(cluster, 1).get("up") is True, 120)
    out["routed_s"] = _wait(lambda: any(s.served_by == cluster.node_ids[1]
                                        for s in load.since(t_up)), 120)
    time.sleep(args.settle)
    out |= _tally(load.since(t0), cluster.node_ids[1])
    after = _counters(cluster)
    out["refusals"] = {k: v - before.get(k, 0.0) for k, v in sorted(after.items())
                       if v != before.get(k, 0.0)}
    out["window_s"] = round(time.monotonic() - t0, 1)
    return out


def _tally(sent: Sequence[Sent], node: str) -> dict[str, Any]:
    failed = [s for s in sent if s.error]
    mine = [s for s in sent if s.served_by == node and not s.error and s.cached is not None]
    return {"requests": len(sent), "failed_before_a_token": sum(not s.tokens for s in failed),
            "failed_while_streaming": sum(bool(s.tokens) for s in failed),
            "errors": sorted({s.error or "" for s in failed})[:5],
            "retried_429": sum(s.retries for s in sent),
            "served_by_engine_node": len(mine),
            "index_equals_engine": sum(s.predicted == s.cached for s in mine)}


# ---------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m radixmesh.chaos.engines",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    ap.add_argument("--out", default="runs/vllm-chaos")
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--hold", type=float, default=5.0, help="stop: seconds stopped")
    ap.add_argument("--settle", type=float, default=5.0, help="load after each recovery")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--num-blocks", type=int, default=48)
    ap.add_argument("--engine-threads", type=int, default=1)
    ap.add_argument("--gossip-interval", default="0.1")
    args = ap.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    if bad := [f for f in faults if f not in FAULTS]:
        ap.error(f"unknown faults {bad}; choose from {FAULTS}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = save_model_dir(out / "model", 0)
    ports = free_ports(6)
    engines = [VllmServer(f"vllm{i}", args.vllm_python, model_dir, *ports[3 * i:3 * i + 3],
                          args.block_size, args.num_blocks, out / f"vllm{i}.log",
                          threads=args.engine_threads) for i in range(2)]
    results: list[dict[str, Any]] = []
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready(time.monotonic() + READY_TIMEOUT_S)
        results = _run(args, faults, engines, model_dir, out)
    finally:
        for e in engines:
            e.stop()
    doc = {"faults": results, "command": " ".join(["python -m radixmesh.chaos.engines",
                                                   *(argv or sys.argv[1:])])}
    (out / "vllm_chaos.json").write_text(json.dumps(doc, indent=2), encoding="utf-8")
    print(json.dumps(doc, indent=2))
    return 0


def _run(args: argparse.Namespace, faults: Sequence[str], engines: Sequence[VllmServer],
         model_dir: Path, out: Path) -> list[dict[str, Any]]:
    per_node = {i: {"engine_url": e.url, "kv_events": f"tcp://*:{e.events_port}",
                    "kv_replay": f"tcp://*:{e.replay_port}"} for i, e in enumerate(engines)}
    cluster = LocalCluster(2, node_options("cost", args, model_dir), per_node=per_node,
                           log_dir=out / "nodes", python=sys.executable)
    results = []
    with cluster:
        wait_subscribed(cluster)
        load = ClosedLoopLoad(cluster.urls, build_workload(400, 8, 0.5, 0), args.concurrency)
        load.start()
        try:
            time.sleep(args.settle)
            for name in faults:
                results.append(run_fault(name, cluster, engines, load, args))
                print(json.dumps(results[-1]), flush=True)
        finally:
            load.stop()
    return results


if __name__ == "__main__":
    raise SystemExit(main())
