"""Adapter-aware against adapter-blind routing: 4 LoRA adapters on an emulated mesh.

Theory of operation
-------------------
``nodes`` nodes (in this process), each fronting an emulated vLLM (``h100-llama3-8b``, its
steps ``time_scale`` times slower: every figure printed is divided back). Each engine keeps
``lora_slots = 1`` adapter resident (vLLM's ``--max-loras 1``); a step that needs another
first loads it for ``lora_load_s`` (0.5 s: LoRAX issue predibase/lorax#433 measured 500 ms to
1+ s to move one adapter's layers to the GPU; the low end). Clients send to random nodes,
``concurrency`` at a time; each request names one of ``adapters`` adapters (uniformly) and
starts with that adapter's own system prompt, then a fresh question; ``max_tokens`` 1, so a
request's latency is its time to first token.

* ``aware``: node i serves adapter i mod ``adapters`` only (``--adapters``): the mesh routes
  each request to a holder (an entry node without it forwards, core/adapters.py); an
  engine never swaps adapters.
* ``blind``: every node serves every adapter (``--adapters`` lists all four, the engine
  loads them on demand): routing has no adapter constraint, only prefixes and load — what a
  prefix-aware router in front of vLLM pods with ``--enable-lora`` does. The adapter's
  digest still keys the KV (sharing KV across adapters would be wrong answers, not a
  baseline), so the blind router still finds each adapter's cached system prompt; it pays
  cold loads when a node's resident adapter is another.

Reported per mode: hit rate (cached over prompt tokens, ``usage``), TTFT p50/p90, the
engines' adapter loads, requests forwarded. ``python -m radixmesh.bench.adapter_routing``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

import aiohttp
import numpy as np

from radixmesh.bench.launcher import _stretched_timeouts
from radixmesh.bench.sidechannel import TimedCompletion, _subscribed, _until, completion
from radixmesh.core.profile import Profile, resolve
from radixmesh.emulate.server import EmulatedEngine
from radixmesh.engine.tokenizers import ByteTokenizer
from radixmesh.runtime.cluster import free_port
from radixmesh.runtime.config import ServeConfig
from radixmesh.runtime.inprocess import serving
from radixmesh.runtime.node import NodeService
from radixmesh.runtime.serve_cli import build_external_service

LORA_LOAD_S = 0.5
LORA_CITATION = ("LoRAX issue predibase/lorax#433: moving one adapter's layers CPU->GPU, "
                 "~20 ms a layer, 500 ms to 1+ s in all (the low end taken)")


def lora_profile(name: str, adapters: Sequence[str]) -> Profile:
    base = resolve(name)
    return replace(base, adapters=tuple(adapters), lora_slots=1, lora_load_s=LORA_LOAD_S,
                   citations={**base.citations, "lora_load_s": LORA_CITATION})


def digest(name: str) -> str:
    return (name.encode().hex() * 64)[:64]


@contextlib.asynccontextmanager
async def mesh(profile: str, names: Sequence[str], aware: bool, n: int, scale: float
               ) -> AsyncIterator[list[tuple[int, NodeService, EmulatedEngine]]]:
    served = [[names[i % len(names)]] if aware else list(names) for i in range(n)]
    ports = [free_port() for _ in range(n)]
    async with contextlib.AsyncExitStack() as stack:
        out = []
        for i in range(n):
            eng = EmulatedEngine(lora_profile(profile, served[i]), model="emulated",
                                 kv_events="tcp://127.0.0.1:0", time_scale=scale)
            await eng.start()
            stack.push_async_callback(eng.stop)
            cfg = ServeConfig(
                node_id=f"n{i}", port=ports[i], gossip_interval=0.5, gossip_announce=0.05,
                peers=tuple(f"127.0.0.1:{p}" for p in ports[:i][-3:]), engine="vllm",
                engine_url=eng.url, kv_events=eng.kv_endpoint, kv_replay=eng.replay_endpoint,
                model="emulated", policy="cost", cache_tokens=eng.profile.kv_blocks
                * eng.profile.block_size, **_stretched_timeouts(scale),
                adapters=",".join(f"{a}={digest(a)}" for a in served[i]))
            service = build_external_service(cfg, tokenizer=ByteTokenizer())
            await stack.enter_async_context(serving(service, ports[i]))
            out.append((ports[i], service, eng))
        await _until(lambda: all(len(s.peer_states()) == n - 1 for _, s, _ in out), 120.0)
        # every adapter known at every node: its own and its peers' (adapter_names() lists
        # the peers' only; below 4 x adapters nodes a node's own is served by no peer)
        await _until(lambda: all(len(s.core.adapter_names() | set(s.adapters)) == len(names)
                                 for _, s, _ in out), 60.0)
        for _, service, eng in out:  # ZMQ's slow joiner
            await _until(lambda s=service, e=eng: _subscribed(s, e))
        yield out


async def _one(http: aiohttp.ClientSession, port: int, model: str, prompt: str
               ) -> TimedCompletion:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    return await completion(http, port, body)


async def run(aware: bool, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    names = [f"lora-{k}" for k in range(args.adapters)]
    letters = "abcdefghijklmnopqrstuvwxyz     "
    systems = {a: "".join(rng.choice(letters) for _ in range(args.system_chars)) for a in names}
    jobs = [(a, systems[a] + " Q: " + "".join(rng.choice(letters) for _ in range(60)))
            for a in (rng.choice(names) for _ in range(args.requests))]
    results: list[TimedCompletion] = []
    async with (mesh(args.profile, names, aware, args.nodes, args.time_scale) as nodes,
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http):
        ports, queue = [p for p, _, _ in nodes], list(reversed(jobs))

        async def worker() -> None:
            while queue:
                model, prompt = queue.pop()
                results.append(await _one(http, rng.choice(ports), model, prompt))

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        loads = sum(e.loop.counters.lora_loads for _, _, e in nodes)
    ttft = np.array([r.elapsed_s for r in results]) / args.time_scale
    return {
        "routing": "aware" if aware else "blind", "nodes": args.nodes,
        "adapters": args.adapters, "requests": len(results),
        "hit_rate": round(sum(r.cached_tokens for r in results)
                          / sum(r.prompt_tokens for r in results), 3),
        "ttft_mean_s": round(float(ttft.mean()), 4),
        "ttft_p50_s": round(float(np.median(ttft)), 4),
        "ttft_p90_s": round(float(np.percentile(ttft, 90)), 4),
        "adapter_loads": loads,
        "forwarded": sum(r.headers.get("x-radixmesh-route", "?") != "local" for r in results),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m radixmesh.bench.adapter_routing",
                                 description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--system-chars", type=int, default=1500)
    ap.add_argument("--time-scale", type=float, default=20.0)
    ap.add_argument("--profile", default="h100-llama3-8b")
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args(argv)
    for aware in (True, False):
        print(json.dumps(asyncio.run(run(aware, args))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
