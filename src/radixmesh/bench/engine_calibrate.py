"""``radixmesh calibrate --engine-url URL``: fit a step-time profile to a running engine.

Theory of operation
-------------------
The engine is any OpenAI-compatible server that takes token-id prompts on ``/v1/completions``
and streams (vLLM, SGLang's OpenAI surface, ``radixmesh emulate``, the test fake). Prompts are
random token ids, each request's first token unique, so no request hits the engine's prefix
cache.

* Prefill: one request at a time, ``max_tokens = 1``, for each prompt length (``--lengths``),
  one untimed (an engine's first step of a new size may build kernels for it), then
  ``--repeats`` times; the point is the median time to the first streamed token. When the
  engine's ``/metrics`` has vLLM's ``vllm:request_prefill_time_seconds`` histogram (from the
  step that first schedules a request to its first token: ``vllm/v1/metrics/stats.py``), each
  request's share of it is read too (the sum's change around it, one request at a time): the
  engine's own prefill time, which splits the TTFT intercept into the step's part and the
  part before it (``profilefit.from_engine_points``).
* Decode: ``b`` concurrent streams of ``--decode-tokens`` tokens after a 64-token prompt, for
  each batch size ``b`` (``--batches``); the point is the median over streams of each
  stream's mean gap between streamed chunks (the first gap after the prompt excluded; a mean,
  as a server that falls behind streams tokens in bursts), at context ``64 + decode_tokens /
  2``.

:func:`radixmesh.bench.profilefit.from_engine_points` fits the profile. Capacities cannot be
seen from the outside with certainty: ``max_model_len`` comes from ``/v1/models`` when the
engine reports it, the KV pool from vLLM's ``vllm:cache_config_info`` metric
(``num_gpu_blocks`` less its null block, ``block_size``) when ``/metrics`` has it; otherwise the
flags' values.
Every wait is bounded by ``--timeout``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import time
from typing import Any

import aiohttp

from radixmesh.bench.profilefit import from_engine_points
from radixmesh.core.profile import Profile
from radixmesh.runtime.metrics import parse_samples, sample_sum

DECODE_PROMPT = 64
PREFILL_METRIC = "vllm:request_prefill_time_seconds"
PREFILL_METRIC_POLLS = 50  # reads of /metrics waiting for one request's prefill time


class _Probe:
    def __init__(self, session: aiohttp.ClientSession, url: str, model: str, seed: int,
                 vocab: int | None = None) -> None:
        self.session, self.url, self.model = session, url.rstrip("/"), model
        self.rng = random.Random(seed)
        self.n = 0
        self.vocab = vocab

    def prompt(self, length: int) -> list[int]:
        """A prompt no earlier one shares a block with (its first token differs, or, in a
        small vocabulary, its first four)."""
        self.n += 1
        if self.vocab is not None:
            return [self.rng.randrange(1, self.vocab) for _ in range(length)]
        return [10_000 + self.n, *(self.rng.randrange(1000, 9000) for _ in range(length - 1))]

    async def stream(self, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
        """(seconds to the first token, arrival times of every token chunk)."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0.0,
        }
        t0 = time.perf_counter()
        arrivals: list[float] = []
        async with self.session.post(f"{self.url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise ValueError(f"engine answered HTTP {resp.status}: {await resp.text()}")
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices") or []
                # a chunk per token, its text possibly empty (a byte-level BPE token that
                # ends mid-character); the usage chunk has no choices
                if choices and choices[0].get("text") is not None:
                    arrivals.append(time.perf_counter())
        if not arrivals:
            raise ValueError("engine streamed no token")
        return arrivals[0] - t0, arrivals


async def _engine_facts(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    async with session.get(f"{url}/v1/models") as resp:
        data = (await resp.json())["data"][0]
    facts["model"] = data["id"]
    if isinstance(data.get("max_model_len"), int):
        facts["context_length"] = data["max_model_len"]
    try:
        async with session.get(f"{url}/metrics") as resp:
            text = await resp.text() if resp.status == 200 else ""
    except aiohttp.ClientError:
        text = ""
    info = next((ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info")), "")
    for key, name in (("num_gpu_blocks", "kv_blocks"), ("block_size", "block_size")):
        match = re.search(rf'{key}="(\d+)"', info)
        if match:  # vLLM holds one of num_gpu_blocks back as its null block (block_pool.py)
            facts[name] = int(match.group(1)) - (name == "kv_blocks")
    return facts


async def measure(args: argparse.Namespace) -> tuple[dict[str, Any], list[Any], list[Any]]:
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        url = args.engine_url.rstrip("/")
        facts = await _engine_facts(session, url)
        model = args.served_model_name or facts["model"]
        probe = _Probe(session, url, model, args.seed, getattr(args, "vocab_size", None))
        engine: list[tuple[int, float]] = []
        prefill = await _prefill(probe, args.lengths, args.repeats, engine)
        if len(engine) == len(prefill):
            facts["engine_prefill"] = engine
        decode = []
        for batch in (int(x) for x in args.batches.split(",")):
            runs = await asyncio.gather(
                *(
                    probe.stream(probe.prompt(DECODE_PROMPT), args.decode_tokens)
                    for _ in range(batch)
                )
            )
            # per stream: its mean gap from the second chunk to the last (a server that
            # falls behind sends tokens in bursts: single gaps near 0, then one long one)
            gaps = [(t[-1] - t[1]) / (len(t) - 2) for _, t in runs if len(t) >= 3]
            if not gaps:
                raise ValueError("--decode-tokens must be >= 3 to time decode steps")
            context = DECODE_PROMPT + args.decode_tokens // 2
            decode.append((batch, context, statistics.median(gaps)))
    return facts, prefill, decode


async def _prefill(probe: _Probe, lengths: str, repeats: int,
                   engine: list[tuple[int, float]] | None = None) -> list[tuple[int, float]]:
    """(prompt tokens, median TTFT) per length, one request at a time, after a warm-up;
    ``engine`` gets (prompt tokens, median engine prefill time) where the engine reports it."""
    await probe.stream(probe.prompt(16), 2)  # warm-up
    prefill = []
    for length in (int(x) for x in lengths.split(",")):
        await probe.stream(probe.prompt(length), 1)  # this length's first: not timed
        ttfts, inside = [], []
        for _ in range(repeats):
            before = await _prefill_time(probe)
            ttfts.append((await probe.stream(probe.prompt(length), 1))[0])
            after = await _prefill_time(probe, before) if before is not None else None
            if before is not None and after is not None:
                inside.append(after[0] - before[0])
        prefill.append((length, statistics.median(ttfts)))
        if engine is not None and len(inside) == repeats:
            engine.append((length, statistics.median(inside)))
    return prefill


async def _prefill_time(probe: _Probe, before: tuple[float, float] | None = None
                        ) -> tuple[float, float] | None:
    """(sum, count) of vLLM's ``vllm:request_prefill_time_seconds``; None if the engine has
    none. With ``before``: waits (bounded) until the count moved past it."""
    for _ in range(PREFILL_METRIC_POLLS):
        try:
            async with probe.session.get(f"{probe.url}/metrics") as resp:
                text = await resp.text() if resp.status == 200 else ""
        except aiohttp.ClientError:
            return None
        samples = parse_samples(text)
        count = sample_sum(samples, PREFILL_METRIC + "_count")
        if not any(k.startswith(PREFILL_METRIC + "_count") for k in samples):
            return None
        if before is None or count > before[1]:
            return sample_sum(samples, PREFILL_METRIC + "_sum"), count
        await asyncio.sleep(0.02)  # the engine's stats logger has not run yet: look again
    return None


async def prefill_points(url: str, model: str, lengths: str, repeats: int, seed: int,
                         vocab: int | None = None, timeout: float = 600.0
                         ) -> list[tuple[int, float]]:
    """Only the prefill half of :func:`measure` (``bench/vllm_emulated.py`` times the
    emulated engine's own HTTP path with it)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        return await _prefill(_Probe(session, url, model, seed, vocab), lengths, repeats)


def calibrate_engine(args: argparse.Namespace) -> Profile:
    facts, prefill, decode = asyncio.run(measure(args))
    model = args.served_model_name or facts["model"]
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    capacities = {
        "kv_blocks": facts.get("kv_blocks", args.kv_blocks),
        "block_size": facts.get("block_size", args.block_size),
        "context_length": facts.get("context_length", args.context_length),
        "max_running": args.max_running,
        "step_tokens": args.step_tokens,
    }
    texts = {
        "name": args.name or f"calibrated-{re.sub(r'[^A-Za-z0-9.]+', '-', model)}",
        "hardware": args.hardware,
        "model": model,
        "source": f"radixmesh calibrate --engine-url {args.engine_url} at {when}",
    }
    return from_engine_points(prefill, decode, texts=texts, capacities=capacities,
                              engine_prefill=facts.get("engine_prefill", ()))
