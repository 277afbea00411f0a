"""``radixmesh calibrate``: measure the built-in engine here and write a JSON cost model.

Theory of operation
-------------------
For prompts of several lengths ``L`` and cached fractions ``f`` it warms the cache with the
first ``f·L`` tokens (a one-token request inserts exactly its prompt), then times the full
prompt: the engine reports ``cached_tokens`` (``c``) and ``prefill_s``, so every measurement
is a point ``(u = L - c, c, seconds)``. The router's form (``core/estimators.py``)::

    prefill(u, c) = overhead + rate * u * (1 + (c + u/2) / context_scale)

is fitted by least squares on relative error (short and long prompts count alike): for each
``context_scale`` on a log grid, ``overhead`` and ``rate`` are linear; the best grid point wins.
Decode seconds per token come from longer generations, and ``request_overhead_s`` is the
median of ``generate`` wall time minus prefill and decode (lease, commit, sampling set-up).
``forward_overhead_s`` (HTTP work of one forward) is not an engine property: pass the
runtime's measured figure with ``--forward-overhead`` (default 3 ms, as measured on this
machine by ``radixmesh.runtime.bench_forward``).

``--from-records requests.jsonl`` fits the same form to a real cluster run instead (locally
served one-token requests: client latency against uncached/cached tokens) — calibration in
the very conditions (machine load, threads, HTTP) the simulator is validated against.

Every measurement is written beside the fit, so a reader can check it.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from radixmesh.sim import costs
from radixmesh.sim.costs import CostModel
from radixmesh.sim.network import parse_duration

LENGTHS = (128, 512, 1024, 2048, 3072)
FRACTIONS = (0.0, 0.5, 0.85)
SCALES = tuple(2.0 ** (k / 2) for k in range(16, 37))  # 256 .. 262,144


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", help="built-in engine preset (default tiny)")
    p.add_argument("--model", default=None, help="local Hugging Face model directory instead")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1, as each node of a local cluster)",
    )
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prompt lengths")
    p.add_argument("--fractions", default=",".join(map(str, FRACTIONS)), help="cached shares")
    p.add_argument("--repeats", type=int, default=3, help="measurements per point (median)")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument(
        "--forward-overhead",
        default="3ms",
        help="HTTP work of one forward hop (docs/benchmarks.md, node forwarding: ~3 ms here)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--from-records",
        metavar="JSONL",
        default=None,
        help="fit instead from a real run's requests.jsonl (locally served requests: client "
        "latency vs prompt/cached tokens), e.g. a `radixmesh bench` output",
    )
    p.add_argument("--runs", default="", help="with --from-records: only these run names")
    p.add_argument("--out", default="costmodel.json", help="where to write the cost model")
    p.add_argument("--quiet", action="store_true")


# ------------------------------------------------------------------------------ fitting
def _work(u: float, c: float, scale: float) -> float:
    return u * (1.0 + (c + u / 2.0) / scale)


def fit_prefill(points: list[tuple[int, int, float]]) -> dict[str, float]:
    """Best ``(overhead, rate, context_scale)`` for ``(u, c, seconds)`` points."""
    if len(points) < 2:
        raise ValueError("need at least two prefill measurements to fit")
    best: dict[str, float] | None = None
    for scale in SCALES:
        fit = _fit_linear(points, scale)
        if fit is not None and (best is None or fit["rel_rmse"] < best["rel_rmse"]):
            best = fit
    assert best is not None
    return best


def _fit_linear(points: list[tuple[int, int, float]], scale: float) -> dict[str, float] | None:
    # Weighted least squares on seconds/seconds_observed: minimise sum ((o + r*w)/y - 1)^2.
    s_aa = s_ab = s_bb = s_a = s_b = 0.0
    for u, c, y in points:
        a, b = 1.0 / y, _work(u, c, scale) / y
        s_aa += a * a
        s_ab += a * b
        s_bb += b * b
        s_a += a
        s_b += b
    det = s_aa * s_bb - s_ab * s_ab
    if abs(det) < 1e-30:
        return None
    overhead = (s_a * s_bb - s_b * s_ab) / det
    rate = (s_b * s_aa - s_a * s_ab) / det
    if rate <= 0:
        return None
    if overhead < 0:  # constrain to >= 0: refit the rate alone
        overhead, rate = 0.0, s_b / s_bb
    err = [((overhead + rate * _work(u, c, scale)) / y - 1.0) for u, c, y in points]
    rel_rmse = math.sqrt(sum(e * e for e in err) / len(err))
    return {
        "prefill_overhead_s": overhead,
        "prefill_s_per_token": rate,
        "context_scale": scale,
        "rel_rmse": rel_rmse,
    }


# --------------------------------------------------------------------------- measuring
class _Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        from radixmesh.engine.factory import build_engine

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

    b = _Bench(args)
    for _ in range(3):  # warm-up: allocator, kernels, lazy init
        b.generate(b.prompt(256), 4)
    lengths = [int(x) for x in args.lengths.split(",")]
    fractions = [float(x) for x in args.fractions.split(",")]
    prefill = measure_prefill(b, lengths, fractions, args.repeats, log)
    decode = measure_decode(b, args.decode_tokens, args.repeats)
    points = _median_points(prefill)
    fit = fit_prefill(points)
    per_token = statistics.median(d["s_per_token"] for d in decode)
    overhead = statistics.median(
        max(0.0, m["wall_s"] - m["prefill_s"] - m["decode_s"]) for m in prefill
    )
    label = args.model or f"{args.preset}"
    model = CostModel(
        name=f"calibrated:{label}:{args.device}",
        prefill_overhead_s=fit["prefill_overhead_s"],
        prefill_s_per_token=fit["prefill_s_per_token"],
        context_scale=fit["context_scale"],
        decode_s_per_token=per_token,
        request_overhead_s=overhead,
        forward_overhead_s=parse_duration(args.forward_overhead),
        source=(
            f"radixmesh calibrate on {platform.node() or 'this machine'} "
            f"({platform.processor() or platform.machine()}, threads={args.threads}) at "
            f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
        ),
    )
    doc: dict[str, Any] = asdict(model)
    doc["fit"] = {"rel_rmse": fit["rel_rmse"], "points": len(points)}
    doc["measurements"] = {"prefill": prefill, "decode": decode}
    log(
        f"fit: overhead {model.prefill_overhead_s * 1e3:.2f} ms, rate "
        f"{model.prefill_s_per_token * 1e6:.2f} us/unit, context_scale "
        f"{model.context_scale:,.0f}, decode {per_token * 1e3:.2f} ms/token, "
        f"request overhead {overhead * 1e3:.2f} ms, rel. RMSE {fit['rel_rmse']:.1%}"
    )
    return doc


def _median_points(prefill: list[dict[str, float]]) -> list[tuple[int, int, float]]:
    groups: dict[tuple[int, int], list[float]] = {}
    for m in prefill:
        key = (int(m["uncached"]), int(m["cached"]))
        groups.setdefault(key, []).append(m["prefill_s"])
    return [(u, c, statistics.median(v)) for (u, c), v in sorted(groups.items())]


def from_records(args: argparse.Namespace) -> dict[str, Any]:
    """Fit prefill from a real run: each locally served request is a point
    ``(prompt - cached, cached, client latency)``; the fitted overhead therefore includes the
    client's HTTP round trip and the node's handler, as the simulator's service time must."""
    wanted = {r for r in args.runs.split(",") if r}
    points: list[tuple[int, int, float]] = []
    with open(args.from_records, encoding="utf-8") as fh:
        for line in fh:
            rec = json.loads(line)
            if rec.get("error") or rec.get("route") != "local":
                continue
            if wanted and rec.get("run") not in wanted:
                continue
            if (rec.get("completion_tokens") or 1) > 1:
                continue  # decode time would be mixed in
            prompt, cached = int(rec["prompt_tokens"]), int(rec["cached_tokens"])
            points.append((prompt - cached, cached, float(rec["latency_s"])))
    if len(points) < 10:
        raise ValueError(f"{args.from_records}: too few local one-token requests to fit")
    fit = fit_prefill(points)
    decode = costs.resolve("cpu-tiny").decode_s_per_token  # not observable from 1-token requests
    model = CostModel(
        name=f"fitted:{Path(args.from_records).parent.name or 'records'}",
        prefill_overhead_s=fit["prefill_overhead_s"],
        prefill_s_per_token=fit["prefill_s_per_token"],
        context_scale=fit["context_scale"],
        decode_s_per_token=decode,
        request_overhead_s=0.0,
        forward_overhead_s=parse_duration(args.forward_overhead),
        source=f"fit of {len(points)} locally served requests in {args.from_records}",
    )
    doc: dict[str, Any] = asdict(model)
    doc["fit"] = {"rel_rmse": fit["rel_rmse"], "points": len(points)}
    if not args.quiet:
        print(
            f"fit: overhead {model.prefill_overhead_s * 1e3:.2f} ms, rate "
            f"{model.prefill_s_per_token * 1e6:.2f} us/unit, context_scale "
            f"{model.context_scale:,.0f}, rel. RMSE {fit['rel_rmse']:.1%} over {len(points)} "
            "requests",
            file=sys.stderr,
        )
    return doc


def run(args: argparse.Namespace) -> int:
    try:
        doc = from_records(args) if args.from_records else calibrate(args)
    except ValueError as exc:
        print(f"radixmesh calibrate: {exc}", file=sys.stderr)
        return 2
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
        fh.write("\n")
    if not args.quiet:
        print(f"wrote {args.out}")
    return 0
