"""``radixmesh calibrate``: measure the built-in engine here and write a JSON cost model.

Theory of operation
-------------------
For prompts of several lengths ``L`` and cached fractions ``f`` it warms the cache with the
first ``f·L`` tokens (a one-token request inserts exactly its prompt), then times the full
prompt: the engine reports ``cached_tokens`` (``c``) and ``prefill_s``, so every measurement
is a point ``(u = L - c, c, seconds)``, fitted by :func:`radixmesh.sim.costfit.fit_prefill`.
Decode seconds per token come from longer generations, and ``request_overhead_s`` is the
median of ``generate`` wall time minus prefill and decode (lease, commit, sampling set-up).
``forward_overhead_s`` (HTTP work of one forward) is not an engine property: pass the
runtime's measured figure with ``--forward-overhead`` (default 3 ms, as measured on this
machine by ``radixmesh.runtime.bench_forward``).

``--profile-out FILE`` also writes a step-time profile (:mod:`radixmesh.core.profile`) of the
same fit; ``--engine-url URL`` fits a profile to a running OpenAI/vLLM-compatible engine
instead (:mod:`radixmesh.bench.engine_calibrate`).

``--from-records requests.jsonl`` fits the same form to a real cluster run instead
(:func:`radixmesh.sim.costfit.from_records`). The command lives with the benchmark harness,
above the engine it times; the simulator only reads the JSON it writes.

Every measurement is written beside the fit, so a reader can check it.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from typing import Any

from radixmesh.bench.profilefit import from_builtin_fit
from radixmesh.core.profile import Profile, dumps
from radixmesh.core.units import parse_duration
from radixmesh.sim.costfit import fit_prefill, fitted_model, from_records, model_doc

LENGTHS = (128, 512, 1024, 2048, 3072)
FRACTIONS = (0.0, 0.5, 0.85)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", help="built-in engine preset (default tiny)")
    p.add_argument("--model", default=None, help="local Hugging Face model directory instead")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1 (default cpu)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1, as each node of a local cluster)",
    )
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prompt lengths")
    p.add_argument("--fractions", default=",".join(map(str, FRACTIONS)), help="cached shares")
    p.add_argument("--repeats", type=int, default=3, help="measurements per point (median)")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens per decode timing")
    p.add_argument(
        "--forward-overhead",
        default="3ms",
        help="HTTP work of one forward hop (docs/benchmarks.md, node forwarding: ~3 ms here)",
    )
    p.add_argument("--seed", type=int, default=0, help="preset weight seed (default 0)")
    p.add_argument(
        "--from-records",
        metavar="JSONL",
        default=None,
        help="fit instead from a real run's requests.jsonl (locally served requests: client "
        "latency vs prompt/cached tokens), e.g. a `radixmesh bench` output",
    )
    p.add_argument("--runs", default="", help="with --from-records: only these run names")
    p.add_argument("--out", default="costmodel.json", help="where to write the cost model")
    p.add_argument(
        "--profile-out",
        metavar="TOML",
        default=None,
        help="also write a step-time profile (radixmesh.core.profile) fitted to the same "
        "measurements; with --engine-url the profile is the only output (default profile.toml)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    _add_engine_arguments(p.add_argument_group("--engine-url: fit a running engine instead"))


def _add_engine_arguments(g: Any) -> None:
    g.add_argument(
        "--engine-url",
        default=None,
        help="an OpenAI/vLLM-compatible engine (token-id prompts, streaming): time prefills "
        "of --lengths one at a time and decodes at --batches concurrent streams",
    )
    g.add_argument("--served-model-name", default=None, help="model name (default: /v1/models)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="prompt token ids below this (a small test model; default: ids "
                   "1,000-10,000+)")
    g.add_argument("--batches", default="1,4,16", help="concurrent decode streams (default 1,4,16)")
    g.add_argument("--timeout", type=float, default=300.0, help="seconds per request at most")
    g.add_argument("--name", default=None, help="profile name (default calibrated-MODEL)")
    g.add_argument("--hardware", default="not stated", help="what the engine runs on, for the file")
    # capacities the engine does not report (vLLM's /metrics and /v1/models win when present)
    g.add_argument("--kv-blocks", type=int, default=4096, help="KV pool in blocks (vLLM log)")
    g.add_argument("--block-size", type=int, default=16, help="KV block size (default 16)")
    g.add_argument("--context-length", type=int, default=8192, help="max model length")
    g.add_argument("--max-running", type=int, default=256, help="max_num_seqs (default 256)")
    g.add_argument("--step-tokens", type=int, default=8192, help="max_num_batched_tokens")


# --------------------------------------------------------------------------- measuring
class _Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        from radixmesh.engine.factory import build_engine  # torch: only when measuring

        max_len = max(int(x) for x in args.lengths.split(","))
        self.engine = build_engine(
            preset=args.preset,
            model_path=args.model,
            device=args.device,
            dtype=args.dtype,
            threads=args.threads,
            seed=args.seed,
            cache_tokens=8 * (max_len + args.decode_tokens),
        )
        self.rng = random.Random(args.seed)
        self.n = 0
        vocab = self.engine.tokenizer.vocab_size
        eos = self.engine.tokenizer.eos_token_id
        self.ids = [i for i in range(min(vocab, 256)) if i != eos]

    def prompt(self, length: int) -> list[int]:
        return [self.rng.choice(self.ids) for _ in range(length)]

    def generate(self, prompt: list[int], max_tokens: int) -> tuple[Any, float]:
        from radixmesh.engine.base import GenerateRequest, SamplingParams

        self.n += 1
        req = GenerateRequest(f"cal-{self.n}", tuple(prompt), SamplingParams(max_tokens=max_tokens))
        t0 = time.perf_counter()
        res = self.engine.generate(req)
        return res, time.perf_counter() - t0


def measure_prefill(
    b: _Bench, lengths: list[int], fractions: list[float], repeats: int, log: Any
) -> list[dict[str, float]]:
    out = []
    for length in lengths:
        for frac in fractions:
            cached = int(length * frac)
            for _ in range(repeats):
                p = b.prompt(length)
                if cached:
                    b.generate(p[:cached], 1)
                res, wall = b.generate(p, 1)
                out.append(
                    {
                        "prompt": length,
                        "uncached": length - res.cached_tokens,
                        "cached": res.cached_tokens,
                        "prefill_s": res.prefill_s,
                        "decode_s": res.decode_s,
                        "wall_s": wall,
                    }
                )
            last = out[-1]
            ms = last["prefill_s"] * 1e3
            log(f"prefill L={length:5d} cached={last['cached']:5d}: {ms:8.2f} ms")
    return out


def measure_decode(b: _Bench, tokens: int, repeats: int) -> list[dict[str, float]]:
    out = []
    for _ in range(repeats):
        res, wall = b.generate(b.prompt(64), tokens)
        steps = max(1, len(res.output_ids) - 1)
        out.append(
            {
                "generated": len(res.output_ids),
                "decode_s": res.decode_s,
                "s_per_token": res.decode_s / steps,
                "prefill_s": res.prefill_s,
                "wall_s": wall,
            }
        )
    return out


def calibrate(args: argparse.Namespace) -> dict[str, Any]:
    def log(message: str) -> None:
        if not args.quiet:
            print(message, file=sys.stderr, flush=True)

    prefill, decode = _measure(args, log)
    points = _median_points(prefill)
    fit = fit_prefill(points)
    per_token = statistics.median(d["s_per_token"] for d in decode)
    overhead = statistics.median(
        max(0.0, m["wall_s"] - m["prefill_s"] - m["decode_s"]) for m in prefill
    )
    label = args.model or f"{args.preset}"
    model = fitted_model(
        fit,
        name=f"calibrated:{label}:{args.device}",
        decode_s_per_token=per_token,
        request_overhead_s=overhead,
        forward_overhead_s=parse_duration(args.forward_overhead),
        source=_source(args.threads),
    )
    doc = model_doc(model, fit, len(points))
    doc["measurements"] = {"prefill": prefill, "decode": decode}
    log(
        f"fit: overhead {model.prefill_overhead_s * 1e3:.2f} ms, rate "
        f"{model.prefill_s_per_token * 1e6:.2f} us/unit, context_scale "
        f"{model.context_scale:,.0f}, decode {per_token * 1e3:.2f} ms/token, "
        f"request overhead {overhead * 1e3:.2f} ms, rel. RMSE {fit['rel_rmse']:.1%}"
    )
    return doc


def _measure(
    args: argparse.Namespace, log: Any
) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """The engine's prefill and decode measurements, after a warm-up."""
    b = _Bench(args)
    for _ in range(3):  # warm-up: allocator, kernels, lazy init
        b.generate(b.prompt(256), 4)
    lengths = [int(x) for x in args.lengths.split(",")]
    fractions = [float(x) for x in args.fractions.split(",")]
    prefill = measure_prefill(b, lengths, fractions, args.repeats, log)
    decode = measure_decode(b, args.decode_tokens, args.repeats)
    return prefill, decode


def _source(threads: int) -> str:
    return (
        f"radixmesh calibrate on {platform.node() or 'this machine'} "
        f"({platform.processor() or platform.machine()}, threads={threads}) at "
        f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
    )


def _median_points(prefill: list[dict[str, float]]) -> list[tuple[int, int, float]]:
    groups: dict[tuple[int, int], list[float]] = {}
    for m in prefill:
        key = (int(m["uncached"]), int(m["cached"]))
        groups.setdefault(key, []).append(m["prefill_s"])
    return [(u, c, statistics.median(v)) for (u, c), v in sorted(groups.items())]


def _builtin_profile(args: argparse.Namespace, doc: dict[str, Any]) -> Profile:
    from radixmesh.engine.factory import DEFAULT_CACHE_TOKENS
    from radixmesh.engine.presets import get_preset

    context = 4096 if args.model else get_preset(args.preset).max_position_embeddings
    return from_builtin_fit(doc, context_length=context, kv_blocks=DEFAULT_CACHE_TOKENS // 16)


def run(args: argparse.Namespace) -> int:
    try:
        if args.engine_url:
            from radixmesh.bench.engine_calibrate import calibrate_engine

            _write(args.profile_out or "profile.toml", dumps(calibrate_engine(args)), args.quiet)
            return 0
        if args.profile_out and args.from_records:
            raise ValueError(
                "--profile-out needs step timings: the built-in engine or --engine-url"
            )
        doc = from_records(args) if args.from_records else calibrate(args)
        profile = dumps(_builtin_profile(args, doc)) if args.profile_out else None
    except (ValueError, OSError) as exc:
        print(f"radixmesh calibrate: {exc}", file=sys.stderr)
        return 2
    _write(args.out, json.dumps(doc, indent=2) + "\n", args.quiet)
    if profile is not None:
        _write(args.profile_out, profile, args.quiet)
    return 0


def _write(path: str, text: str, quiet: bool) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    if not quiet:
        print(f"wrote {path}")
