"""Multi-turn chats with and without ``prompt_cache_key`` on the emulated mesh.

Theory of operation
-------------------
The mesh of ``bench/sidechannel.py`` (three nodes over emulated vLLMs, ``h100-llama3-8b``,
cost policy, no tenants). ``chats`` conversations run at once, each ``turns`` turns long, one
turn at a time: a turn sends the whole history so far (a 600-character opening, then every
earlier question and answer) plus a new 200-character question, with ``max_tokens``
``answer`` tokens, to a random node (clients behind a load balancer). With sessions, each
request names its chat in ``prompt_cache_key``. Reported: the hit rate (cached over prompt
tokens), median and p90 latency of the whole request, and how many requests each node served.
``python -m radixmesh.bench.sessions`` runs both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from collections.abc import Sequence
from typing import Any

import aiohttp

from radixmesh.bench.sidechannel import TimedCompletion, _text, completion, hit_summary, mesh


async def _turn(http: aiohttp.ClientSession, port: int, prompt: str, answer: int,
                key: str | None) -> TimedCompletion:
    body: dict[str, Any] = {"model": "emulated", "prompt": prompt, "max_tokens": answer,
                            "temperature": 0}
    if key is not None:
        body["prompt_cache_key"] = key
    return await completion(http, port, body)


async def run(sessions: bool, chats: int, turns: int, answer: int, seed: int,
              profile: str) -> dict[str, Any]:
    rng = random.Random(seed)
    results: list[TimedCompletion] = []
    async with mesh(profile, False, "cost") as nodes, aiohttp.ClientSession() as http:
        ports = [port for port, _ in nodes]

        async def chat(c: int) -> None:
            history = f"Chat {c}. " + _text(rng, 600)
            for _ in range(turns):
                prompt = history + "\nUser: " + _text(rng, 200) + "\nAssistant:"
                out = await _turn(http, rng.choice(ports), prompt, answer,
                                  f"chat-{c}" if sessions else None)
                results.append(out)
                history = prompt + out.data["choices"][0]["text"]

        await asyncio.gather(*(chat(c) for c in range(chats)))
    return {"sessions": sessions, **hit_summary(results, "x-radixmesh-served-by")}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m radixmesh.bench.sessions",
                                 description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--chats", type=int, default=12)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--answer", type=int, default=16, help="max_tokens of each answer")
    ap.add_argument("--profile", default="h100-llama3-8b")
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args(argv)
    for sessions in (False, True):
        out = asyncio.run(run(sessions, args.chats, args.turns, args.answer, args.seed,
                              args.profile))
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
