"""Mixed LoRA adapters in one batch on the built-in engine: what mixing costs, what it saves.

Theory of operation
-------------------
One engine (a preset's random weights, ``adapters`` random PEFT adapters of rank ``rank`` on
every linear layer of the decoder, ``engine/testing.save_random_lora_dir``) runs ``requests``
distinct prompts (no prefix hits) of ``prompt`` tokens, ``max_tokens`` greedy tokens each, all
submitted at once and stepped to the end (``engine/lora.py`` binds each row to its adapter).
Modes, the same requests each time:

* ``base``: no adapter (the engine's plain speed with the adapters loaded);
* ``one``: every request with adapter 0 (one group: whole-row deltas);
* ``mixed``: request i with adapter i mod ``adapters`` (per-row groups in every step);
* ``by-adapter``: the ``mixed`` requests, one adapter's requests at a time (what an engine
  that cannot mix adapters in a batch does: smaller batches, one after another).

Printed per mode: wall seconds, output tokens per second, steps. ``python -m
radixmesh.bench.lora_batch [--preset tiny] [--device cpu]``; a benchmark, nothing asserted.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from radixmesh.engine.base import GenerateRequest, GenerateResult, SamplingParams
from radixmesh.engine.builtin import TransformersEngine
from radixmesh.engine.factory import build_engine
from radixmesh.engine.testing import save_random_lora_dir, step_until_done

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def run(engine: TransformersEngine, reqs: list[GenerateRequest]) -> tuple[float, int, int]:
    """Submit ``reqs`` at once, step to the end: (wall s, output tokens, steps)."""
    engine.clear_cache()
    steps = engine.stats()["steps"]
    start = time.perf_counter()
    done: list[GenerateResult] = []
    for d in step_until_done(engine, reqs):
        if isinstance(d, BaseException):
            raise d
        done.append(d)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    wall = time.perf_counter() - start
    return wall, sum(len(d.output_ids) for d in done), engine.stats()["steps"] - steps


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5, help="runs per mode (the best is shown)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args(argv)
    engine = build_engine(args.preset, cache_tokens=args.requests * (args.prompt + 64) * 2,
                          device=args.device, dtype=args.dtype, threads=args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        for a in range(args.adapters):
            folder = save_random_lora_dir(Path(tmp) / f"a{a}", engine.model, seed=a,
                                          rank=args.rank, targets=TARGETS)
            engine.load_adapter(f"a{a}", folder)
    rng = random.Random(0)
    vocab = engine.tokenizer.vocab_size
    prompts = [tuple(rng.randrange(3, vocab) for _ in range(args.prompt))
               for _ in range(args.requests)]
    sp = SamplingParams(max_tokens=args.max_tokens)

    def reqs(adapter: Any) -> list[GenerateRequest]:
        return [GenerateRequest(f"r{i}", p, sp, adapter=adapter(i)) for i, p in enumerate(prompts)]

    mixed = reqs(lambda i: f"a{i % args.adapters}")
    modes = {"base": [reqs(lambda i: None)], "one": [reqs(lambda i: "a0")], "mixed": [mixed],
             "by-adapter": [[r for r in mixed if r.adapter == f"a{a}"]
                            for a in range(args.adapters)]}
    run(engine, mixed[:4])  # warm-up
    print(f"{args.preset} on {args.device} ({args.dtype}): {args.requests} requests x "
          f"{args.prompt} prompt + {args.max_tokens} tokens, {args.adapters} adapters of rank "
          f"{args.rank} on {len(TARGETS)} projections")
    report(engine, modes, args.repeat)


def report(engine: TransformersEngine, modes: dict[str, list[list[GenerateRequest]]],
           repeat: int) -> None:
    """Run every mode ``repeat`` times, interleaved (a busy machine slows them alike); print
    each one's best."""
    best: dict[str, tuple[float, int, int]] = {}
    for _ in range(repeat):
        for mode, batches in modes.items():
            got = [run(engine, b) for b in batches]
            wall, tokens, steps = (sum(x[i] for x in got) for i in range(3))
            if mode not in best or wall < best[mode][0]:
                best[mode] = (wall, int(tokens), int(steps))
    print(f"{'mode':<11} {'wall s':>8} {'tokens/s':>9} {'steps':>6}  (best of {repeat})")
    for mode, (wall, tokens, steps) in best.items():
        print(f"{mode:<11} {wall:>8.3f} {tokens / wall:>9.1f} {steps:>6}")

if __name__ == "__main__":
    main()
