"""The price of tenant isolation: hit rate and latency of two tenants, isolated or sharing.

Theory of operation
-------------------
The mesh of ``bench/sidechannel.py`` (three nodes over emulated vLLMs, ``h100-llama3-8b``).
Two tenants each send ``requests`` prompts, ``concurrency`` at a time, to random nodes: a
system prompt of ``system_chars`` characters, then a fresh question. Two workloads:

* ``own``: each tenant has its own system prompt — isolation should cost (next to) nothing:
  one virtual block per namespace and node;
* ``common``: both send the same system prompt — isolation forgoes the other tenant's copy,
  so each tenant computes it once per node it reaches.

Each workload runs ``shared`` (both tenants under the operator key: one cache) and
``isolated`` (``--api-keys``: one namespace each). Reported per run: the hit rate (cached over
prompt tokens, from ``usage``), median and p90 client latency (``max_tokens`` 1: time to the
first and only token), and how many requests each node served.
``python -m radixmesh.bench.isolation_price`` runs all four.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from collections.abc import Sequence
from typing import Any

import aiohttp

from radixmesh.bench.sidechannel import KEYS, TimedCompletion, completion, hit_summary, mesh

TENANTS = ("victim", "attacker")  # the harness's two tenant keys, here two ordinary tenants


async def _one(http: aiohttp.ClientSession, port: int, prompt: str, key: str | None
               ) -> TimedCompletion:
    body = {"model": "emulated", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return await completion(http, port, body, headers)


async def run(workload: str, isolated: bool, requests: int, concurrency: int,
              system_chars: int, seed: int, profile: str) -> dict[str, Any]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz     "
    systems = ["".join(rng.choice(letters) for _ in range(system_chars)) for _ in TENANTS]
    if workload == "common":
        systems = [systems[0]] * len(TENANTS)
    jobs = [(t, systems[t] + " Question: " + "".join(rng.choice(letters) for _ in range(60)))
            for _ in range(requests) for t in range(len(TENANTS))]
    rng.shuffle(jobs)
    results: list[TimedCompletion] = []
    async with mesh(profile, isolated, "cost") as nodes, aiohttp.ClientSession() as http:
        ports = [port for port, _ in nodes]
        queue = list(reversed(jobs))

        async def worker() -> None:
            while queue:
                tenant, prompt = queue.pop()
                key = KEYS[TENANTS[tenant]] if isolated else None
                results.append(await _one(http, rng.choice(ports), prompt, key))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"workload": workload, "setup": "isolated" if isolated else "shared",
            **hit_summary(results, "x-radixmesh-served-by")}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m radixmesh.bench.isolation_price",
                                 description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--requests", type=int, default=60, help="per tenant")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--system-chars", type=int, default=1500)
    ap.add_argument("--profile", default="h100-llama3-8b")
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args(argv)
    for workload in ("own", "common"):
        for isolated in (False, True):
            out = asyncio.run(run(workload, isolated, args.requests, args.concurrency,
                                  args.system_chars, args.seed, args.profile))
            print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
