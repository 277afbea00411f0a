#!/usr/bin/env python3
"""The built-in engine's batching seen through a node's HTTP API (what a client gets).

    radixmesh serve --port 8001 &          # one node, the default preset and threads
    python scripts/node-batching.py http://127.0.0.1:8001 [--pairs 3]

Per pair: 8 distinct 500-token prompts x 32 streamed tokens (``ignore_eos``) one at a time, then
8 others all at once; output tokens/s of each, their ratio, and time to first token (the
median alone, the mean together). The prompts are those of ``python -m radixmesh.bench.batching``
(token ids of the node's default preset), fresh each pair, so nothing is cached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from radixmesh.bench.batching import OUTPUT_TOKENS, PROMPT_TOKENS, make_prompts
from radixmesh.engine.factory import DEFAULT_PRESET, preset_tokenizer


async def one(http: httpx.AsyncClient, url: str, ids: tuple[int, ...]) -> tuple[float, float, int]:
    """(seconds, time to first token, tokens) of one streamed completion."""
    body = {"model": DEFAULT_PRESET, "prompt": list(ids), "max_tokens": OUTPUT_TOKENS,
            "temperature": 0, "stream": True, "ignore_eos": True}
    start, first, tokens = time.perf_counter(), None, 0
    async with http.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if json.loads(line[6:]).get("choices"):
                first = first or time.perf_counter()
                tokens += 1
    end = time.perf_counter()
    return end - start, (first or end) - start, tokens


async def main(url: str, pairs: int) -> None:
    tok = preset_tokenizer(DEFAULT_PRESET)
    async with httpx.AsyncClient(timeout=120) as http:
        await one(http, url, make_prompts(tok, 1, 64, 99)[0])  # warm-up
        for i in range(pairs):
            solo = make_prompts(tok, 8, PROMPT_TOKENS, 1000 + i)
            together = make_prompts(tok, 8, PROMPT_TOKENS, 2000 + i)
            t0 = time.perf_counter()
            alone = [await one(http, url, p) for p in solo]
            t1 = time.perf_counter()
            batch = await asyncio.gather(*(one(http, url, p) for p in together))
            t2 = time.perf_counter()
            a_rate = sum(r[2] for r in alone) / (t1 - t0)
            b_rate = sum(r[2] for r in batch) / (t2 - t1)
            print(f"alone {a_rate:.1f} tok/s, TTFT median "
                  f"{1e3 * statistics.median(r[1] for r in alone):.0f} ms; together "
                  f"{b_rate:.1f} tok/s, TTFT mean {1e3 * statistics.fmean(r[1] for r in batch):.0f}"
                  f" ms; ratio {b_rate / a_rate:.2f}x")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url")
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args()
    asyncio.run(main(args.url.rstrip("/"), args.pairs))
