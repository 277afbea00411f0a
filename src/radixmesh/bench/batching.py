"""Continuous-batching figures of the built-in engine (prints; asserts nothing about speed).

Theory of operation
-------------------
One engine in this process, behind the same ``as_async_engine`` a node puts it behind (so the
same script measures the batching engine and, run against an older checkout, the old
one-request-at-a-time worker)::

    python -m radixmesh.bench.batching [--preset mini] [--threads N] [--repeat N] [--skip-prefix]
                                       [--dtype bfloat16]

1. throughput: 8 distinct ~500-token prompts x 32 output tokens, all at once against the same 8
   one at a time (fresh prompts each time, so no prefix hits): output tokens/s and their ratio
   (``--repeat N``: N such pairs, and their median), and the ratio's ceiling on this machine:
   one request alone takes a prefill P (its TTFT) and 31 decode steps d, so 8 alone take
   8 (P + 31 d) and 8 together at least 8 P + 31 d (prefill is compute-bound: batching does not
   shrink it; a decode step of 8 costs at least one of 1). On a CPU, where P is ~10 d for this
   model (2 threads), that bound is ~2.8-3.0x whatever the batching;
2. latency: p50 / p99 end-to-end latency of distinct ~500-token prompts x 32 output tokens at
   1, 4 and 16 concurrent requests;
3. prefix-aware admission (needs ``build_engine(prefix_aware=...)``, this version on): 8 requests
   sharing a 2,000-token prefix (distinct 48-token tails) arriving together, on an engine with
   the scheduler's prefix-aware admission and on one with plain FCFS: prefill tokens computed
   and mean time to first token, at the default step of 2,048 tokens (one such prompt fills a
   step, so FCFS cannot admit a second beside the first) and at vLLM's 8,192.

Prompts are token ids (the preset's vocabulary, pseudo-words through its tokenizer), so a byte
and a BPE preset get the same number of tokens. Every figure is wall-clock on this machine:
compare figures from the same machine and run only.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

PROMPT_TOKENS = 500
OUTPUT_TOKENS = 32
_serial = iter(range(1, 1 << 30))


def make_prompts(tok: Any, n: int, tokens: int, seed: int) -> list[tuple[int, ...]]:
    """``n`` distinct prompts of exactly ``tokens`` ids (seeded pseudo-words, cut)."""
    from radixmesh.workload.synthetic import words

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids: list[int] = []
        while len(ids) < tokens:
            ids += tok.encode(words(rng, 4 * tokens))
        out.append(tuple(ids[:tokens]))
    return out


async def _one(engine: Any, prompt: Sequence[int], max_tokens: int) -> tuple[float, float, int]:
    """(latency, time to first token, output tokens) of one request."""
    from radixmesh.engine.base import GenerateRequest, SamplingParams

    start = time.perf_counter()
    first: list[float] = []

    def on_token(_: int) -> None:
        if not first:
            first.append(time.perf_counter())

    req = GenerateRequest(f"b{next(_serial)}", tuple(prompt), SamplingParams(max_tokens=max_tokens))
    res = await engine.generate(req, on_token)
    end = time.perf_counter()
    return end - start, (first[0] if first else end) - start, len(res.output_ids)


async def _wave(engine: Any, prompts: Sequence[Sequence[int]], max_tokens: int
                ) -> tuple[float, list[tuple[float, float, int]]]:
    start = time.perf_counter()
    out = await asyncio.gather(*(_one(engine, p, max_tokens) for p in prompts))
    return time.perf_counter() - start, list(out)


async def throughput(engine: Any, tok: Any, seed: int) -> dict[str, float]:
    """Output tokens per second of wall clock and per second of this process's CPU time (the
    second is what a loaded shared machine distorts least)."""
    solo = make_prompts(tok, 8, PROMPT_TOKENS, seed)
    together = make_prompts(tok, 8, PROMPT_TOKENS, seed + 1)
    t0, c0 = time.perf_counter(), time.process_time()
    alone = [await _one(engine, p, OUTPUT_TOKENS) for p in solo]
    solo_s, solo_cpu = time.perf_counter() - t0, time.process_time() - c0
    solo_tokens = sum(r[2] for r in alone)
    c1 = time.process_time()
    wall, res = await _wave(engine, together, OUTPUT_TOKENS)
    cpu = time.process_time() - c1
    n = sum(r[2] for r in res)
    prefill = statistics.median(r[1] for r in alone)  # TTFT alone: its prefill step
    decode = statistics.median((r[0] - r[1]) / max(r[2] - 1, 1) for r in alone)
    return {"alone_tok_s": solo_tokens / solo_s, "concurrent_tok_s": n / wall,
            "ratio": n / wall / (solo_tokens / solo_s),
            "alone_tok_cpu_s": solo_tokens / solo_cpu, "concurrent_tok_cpu_s": n / cpu,
            "cpu_ratio": n / cpu / (solo_tokens / solo_cpu),
            "prefill_s": prefill, "decode_s": decode, "ceiling": ceiling(prefill, decode)}


def ceiling(prefill_s: float, decode_s: float, n: int = 8, out: int = OUTPUT_TOKENS) -> float:
    """The ratio's bound when a decode step of ``n`` sequences costs no more than one of a
    single sequence and prefill costs the same per prompt batched or alone: ``n`` requests
    alone take n (P + (out - 1) d), together at best n P + (out - 1) d."""
    return n * (prefill_s + (out - 1) * decode_s) / (n * prefill_s + (out - 1) * decode_s)


async def latency(engine: Any, tok: Any, seed: int, levels: Sequence[int]
                  ) -> dict[int, tuple[float, float]]:
    out = {}
    for c in levels:
        n = max(c, 8)
        prompts = make_prompts(tok, n, PROMPT_TOKENS, seed + 100 + c)
        lat: list[float] = []
        for i in range(0, n, c):
            _, res = await _wave(engine, prompts[i : i + c], OUTPUT_TOKENS)
            lat += [r[0] for r in res]
        lat.sort()
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        out[c] = (statistics.median(lat), p99)
    return out


async def prefix_admission(preset: str, prefix_aware: bool, step_tokens: int, seed: int,
                           dtype: str = "float32") -> dict[str, float]:
    from radixmesh.engine.factory import build_engine
    from radixmesh.engine.worker import as_async_engine

    raw = build_engine(preset, prefix_aware=prefix_aware, step_tokens=step_tokens, dtype=dtype)
    engine = as_async_engine(raw)
    try:
        shared = make_prompts(raw.tokenizer, 1, 2000, seed + 7)[0]
        tails = make_prompts(raw.tokenizer, 8, 48, seed + 8)
        _, res = await _wave(engine, [shared + t for t in tails], 4)
        stats = raw.stats()
        return {"prefill_tokens": float(stats["prefill_tokens_computed"]),
                "mean_ttft_s": statistics.fmean(r[1] for r in res),
                "kv_bytes_copied": float(stats["kv_bytes_copied"])}
    finally:
        await engine.aclose()


def _print_throughput(tp: dict[str, float]) -> None:
    print(f"throughput: 8 one at a time {tp['alone_tok_s']:.1f} tok/s, 8 concurrent "
          f"{tp['concurrent_tok_s']:.1f} tok/s, ratio {tp['ratio']:.2f}x; per CPU "
          f"second {tp['alone_tok_cpu_s']:.1f} vs {tp['concurrent_tok_cpu_s']:.1f}, "
          f"ratio {tp['cpu_ratio']:.2f}x (load average {os.getloadavg()[0]:.1f})")
    print(f"  alone: prefill (TTFT) {tp['prefill_s'] * 1e3:.0f} ms, decode "
          f"{tp['decode_s'] * 1e3:.1f} ms/token; ceiling of the ratio (a decode step "
          f"of 8 as cheap as one of 1) {tp['ceiling']:.2f}x")


async def main_async(args: argparse.Namespace) -> None:
    from radixmesh.engine import factory
    from radixmesh.engine.worker import as_async_engine

    raw = factory.build_engine(args.preset, threads=args.threads, dtype=args.dtype)
    engine = as_async_engine(raw)
    print(f"engine: {type(engine).__name__}, preset {args.preset}, {args.dtype}, "
          f"threads {args.threads}, prompts {PROMPT_TOKENS} tokens x {OUTPUT_TOKENS} out")
    try:
        await _one(engine, make_prompts(raw.tokenizer, 1, 64, 99)[0], 2)  # warm-up
        runs = []
        for i in range(args.repeat):
            runs.append(await throughput(engine, raw.tokenizer, args.seed + 1000 * i))
            _print_throughput(runs[-1])
        if len(runs) > 1:
            med = {k: statistics.median(r[k] for r in runs) for k in ("ratio", "cpu_ratio",
                                                                      "ceiling")}
            print(f"median of {len(runs)}: ratio {med['ratio']:.2f}x, per CPU second "
                  f"{med['cpu_ratio']:.2f}x, ceiling {med['ceiling']:.2f}x")
        for c, (p50, p99) in (await latency(engine, raw.tokenizer, args.seed,
                                            args.levels)).items():
            print(f"latency at {c:>2} concurrent: p50 {p50:.2f} s, p99 {p99:.2f} s")
    finally:
        await engine.aclose()
    if args.skip_prefix or "prefix_aware" not in inspect.signature(
            factory.build_engine).parameters:
        return
    for step_tokens in (2048, 8192):
        for aware in (True, False):
            r = await prefix_admission(args.preset, aware, step_tokens, args.seed, args.dtype)
            print(f"shared 2,000-token prefix x 8, step {step_tokens} tokens, "
                  f"{'prefix-aware' if aware else 'FCFS        '}: prefill tokens "
                  f"{r['prefill_tokens']:.0f}, mean TTFT {r['mean_ttft_s']:.2f} s, "
                  f"kv_bytes_copied {r['kv_bytes_copied']:.0f}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m radixmesh.bench.batching",
                                description="continuous-batching figures of the built-in engine")
    p.add_argument("--preset", default=None, help="built-in preset (default: the default)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--dtype", default="float32", help="model dtype (float32, bfloat16, ...)")
    p.add_argument("--levels", default="1,4,16", help="concurrency levels for latency")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1,
                   help="throughput pairs (alone, then together) to run; their median too")
    p.add_argument("--skip-prefix", action="store_true", help="no prefix-admission figures")
    args = p.parse_args(argv)
    args.levels = [int(x) for x in args.levels.split(",")]
    if args.preset is None:
        from radixmesh.engine import presets

        args.preset = getattr(presets, "DEFAULT_PRESET", "tiny")
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
