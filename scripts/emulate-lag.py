"""How closely ``radixmesh emulate`` keeps to its profile's speed on this machine.

Starts one emulated engine in this process (a shipped profile, KV events on), sends N
concurrent streaming requests over HTTP (each a P-token prompt sharing a prefix, M output
tokens), then prints the engine's own figures: steps, planned busy seconds, lag seconds (how
much later than planned the steps ended), the lag per step, and the wall time of the burst.
A benchmark that prints; it asserts nothing.

    PYTHONPATH=src python scripts/emulate-lag.py [--profile h100-llama3-8b] [-n 32]
        [--prompt 512] [--max-tokens 64] [--time-scale 1]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import aiohttp

from radixmesh.core.profile import resolve
from radixmesh.emulate.server import EmulatedEngine


async def one(http: aiohttp.ClientSession, url: str, prompt: list[int], n: int) -> None:
    body = {"prompt": prompt, "max_tokens": n, "stream": True, "ignore_eos": True}
    async with http.post(url + "/v1/completions", json=body) as resp:
        async for _ in resp.content:
            pass


async def main(args: argparse.Namespace) -> None:
    engine = EmulatedEngine(resolve(args.profile), time_scale=args.time_scale,
                            kv_events="tcp://127.0.0.1:0")
    await engine.start()
    try:
        shared = [65 + i % 26 for i in range(args.prompt // 2)]
        prompts = [[*shared, *(32 + (i * 7 + j) % 90 for j in range(args.prompt // 2))]
                   for i in range(args.n)]
        t0 = time.perf_counter()
        async with aiohttp.ClientSession() as http:
            await asyncio.gather(*(one(http, engine.url, p, args.max_tokens) for p in prompts))
        wall = time.perf_counter() - t0
        c = engine.loop.counters
        print(f"profile {args.profile} x{args.time_scale}: {args.n} requests, prompt "
              f"{args.prompt}, {args.max_tokens} out; steps {c.steps}, busy {c.busy_s:.3f} s, "
              f"lag {c.lag_s:.3f} s ({c.lag_s / max(c.busy_s, 1e-9):.1%} of busy, "
              f"{1e3 * c.lag_s / max(c.steps, 1):.2f} ms/step), wall {wall:.3f} s, "
              f"cached {c.prefix_hits}/{c.prefix_queries} prompt tokens")
    finally:
        await engine.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="h100-llama3-8b")
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--time-scale", type=float, default=1.0)
    asyncio.run(main(ap.parse_args()))
