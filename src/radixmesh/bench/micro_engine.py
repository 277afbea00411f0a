"""Engine micro-benchmark: prefill time with 0 %, 50 % and 85 % of an MMLU prompt cached.

One 5-shot MMLU prompt (the real data in the release directory ``$RADIXMESH_MMLU`` names,
when set: the subject whose first test prompt is closest to the dataset's mean length of
3,024 characters; otherwise a synthetic MMLU-shaped prompt) is tokenized with the preset's
byte tokenizer. Each repeat, in interleaved order, empties the cache, caches the first
``f`` of the prompt's tokens (f = 0, 0.5, 0.85 and the real few-shot prefix), and times the
prefill of the whole prompt through ``generate`` (``GenerateResult.prefill_s``). Figures are
medians over the repeats of one run, so the ratios share the machine's conditions.

Also: decode seconds per token (greedy, prompt cached), KV bytes per token (from the model
config and checked against the tensors actually stored), and the largest |logit difference|
between the 85 %-cached and the uncached prefill (fp32 exactness, expected < 1e-4).

Threads: one torch thread, as each node of a local multi-node cluster uses (override with
``RADIXMESH_BENCH_THREADS``). Preset: ``tiny`` (``RADIXMESH_BENCH_PRESET`` to change), or a
local model directory (``RADIXMESH_BENCH_MODEL``, e.g. one from ``radixmesh.bench.modeldir``
whose tokenizer gives MMLU prompts realistic token counts). Device and dtype:
``RADIXMESH_BENCH_DEVICE`` (``cpu``), ``RADIXMESH_BENCH_DTYPE`` (``float32``); on CUDA each
timed call is synchronised by the sampled token's read-back.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import torch

from radixmesh.engine.base import GenerateRequest, SamplingParams
from radixmesh.engine.builtin import TransformersEngine
from radixmesh.engine.factory import build_engine
from radixmesh.engine.testing import uncached_logits

MMLU_MEAN_CHARS = 3024
FRACTIONS = {"0": 0.0, "50": 0.5, "85": 0.85}


def mmlu_prompt() -> tuple[str, int, str]:
    """(prompt, shared-prefix chars, source) for one realistic 5-shot MMLU question."""
    root = os.environ.get("RADIXMESH_MMLU")
    requests, source = None, "synthetic"
    if root:
        from radixmesh.workload.mmlu import load_subjects, subject_requests

        try:
            requests = [subject_requests(s)[0] for s in load_subjects(Path(root))]
            source = f"mmlu:{root}"
        except (FileNotFoundError, ValueError):
            requests = None
    if requests is None:
        from radixmesh.workload.synthetic import synthetic_groups

        requests = [g[0] for g in synthetic_groups(seed=0, groups=8, max_per_group=4).values()]
    best = min(requests, key=lambda r: abs(len(r.text) - MMLU_MEAN_CHARS))
    name = best.group or best.id
    return best.text, best.prefix_chars or 0, f"{source}/{name}"


def _clear(engine: TransformersEngine) -> None:
    engine.clear_cache()
    engine.drain_cache_delta()


def _prefill_with(engine: TransformersEngine, prompt: list[int], cached: int) -> float:
    _clear(engine)
    if cached:
        engine.prefill_logits(prompt[:cached])
    res = engine.generate(GenerateRequest("bench", tuple(prompt), SamplingParams(max_tokens=1)))
    bs = engine.spec.block_size  # reuse is in whole KV blocks
    assert res.cached_tokens == min(cached, len(prompt) - 1) // bs * bs
    return res.prefill_s


def _decode_per_token(engine: TransformersEngine, prompt: list[int], n: int) -> float:
    res = engine.generate(GenerateRequest("dec", tuple(prompt), SamplingParams(max_tokens=n)))
    forwards = len(res.output_ids) - (res.finish_reason == "length")
    return res.decode_s / max(forwards, 1)


def _stored_kv_bytes_per_token(engine: TransformersEngine) -> float:
    kv = engine.runner.kv  # the paged pool: bytes per slot (token position)
    slots = kv.k.shape[2]  # kv_blocks * block_size + the zeroed padding slot
    return (kv.k.numel() + kv.v.numel()) * kv.k.element_size() / slots


def _max_logit_diff(engine: TransformersEngine, prompt: list[int], cached: int) -> float:
    _clear(engine)
    engine.prefill_logits(prompt[:cached])
    logits, _ = engine.prefill_logits(prompt)
    return float((logits - uncached_logits(engine, prompt)).abs().max())


def run(quick: bool) -> dict[str, object]:
    engine, settings = _engine_from_env()
    text, prefix_chars, source = mmlu_prompt()
    prompt = engine.tokenizer.encode(text)
    shared = len(engine.tokenizer.encode(text[:prefix_chars]))
    points = {k: round(f * len(prompt)) for k, f in FRACTIONS.items()} | {"shared": shared}
    repeats = 3 if quick else 9
    med = _median_prefills(engine, prompt, points, repeats)
    decode = statistics.median(
        _decode_per_token(engine, prompt, 8 if quick else 32) for _ in range(repeats)
    )
    out: dict[str, object] = {
        **settings,
        "engine_prompt_source": source,
        "engine_prompt_tokens": len(prompt),
        "engine_shared_prefix_tokens": shared,
        "engine_repeats": repeats,
        "prefill_s_0": round(med["0"], 5),
        "prefill_s_50": round(med["50"], 5),
        "prefill_s_85": round(med["85"], 5),
        "prefill_s_shared": round(med["shared"], 5),
        "prefill_ratio_50": round(med["50"] / med["0"], 4),
        "prefill_ratio_85": round(med["85"] / med["0"], 4),
        "prefill_ratio_shared": round(med["shared"] / med["0"], 4),
        "decode_s_per_token": round(decode, 5),
        "kv_bytes_per_token": engine.kv_bytes_per_token,
        "kv_bytes_per_token_stored": round(_stored_kv_bytes_per_token(engine), 1),
        "max_abs_logit_diff_85": _max_logit_diff(engine, prompt, points["85"]),
        "torch_version": torch.__version__,
    }
    return out


def _engine_from_env() -> tuple[TransformersEngine, dict[str, object]]:
    """The engine the ``RADIXMESH_BENCH_*`` variables name, and its settings as reported."""
    preset = os.environ.get("RADIXMESH_BENCH_PRESET", "tiny")
    model = os.environ.get("RADIXMESH_BENCH_MODEL") or None
    threads = int(os.environ.get("RADIXMESH_BENCH_THREADS", "1"))
    device = os.environ.get("RADIXMESH_BENCH_DEVICE", "cpu")
    dtype = os.environ.get("RADIXMESH_BENCH_DTYPE", "float32")
    engine = build_engine(preset, model_path=model, cache_tokens=16_384, threads=threads,
                          device=device, dtype=dtype)
    return engine, {"engine_preset": model or preset, "engine_device": device,
                    "engine_dtype": dtype, "engine_threads": threads}


def _median_prefills(engine: TransformersEngine, prompt: list[int], points: dict[str, int],
                     repeats: int) -> dict[str, float]:
    """Median prefill seconds of ``prompt`` with each point's tokens cached (after one
    uncached warm-up), the points interleaved in each of ``repeats`` rounds."""
    _prefill_with(engine, prompt, 0)  # warm-up
    samples: dict[str, list[float]] = {k: [] for k in points}
    for _ in range(repeats):
        for key, cached in points.items():
            samples[key].append(_prefill_with(engine, prompt, cached))
    return {k: statistics.median(v) for k, v in samples.items()}
