"""Fitting step-time profiles (:mod:`radixmesh.core.profile`) to measurements.

Theory of operation
-------------------
Two sources of measurements, one output (a :class:`Profile`):

* the built-in engine (``radixmesh calibrate``): its cost-model fit ``overhead + rate *
  work(u, c)`` with ``work(u, c) = u * (1 + (c + u / 2) / context_scale)`` maps exactly onto a
  prefill step (``step_base_s = overhead``, ``prefill_token_s = rate``, ``prefill_attn_s = rate
  / context_scale``); the engine runs one request at a time, so a decode step is batch 1 and
  ``decode_seq_s = decode per token - step_base_s`` (:func:`from_builtin_fit`);
* an OpenAI/vLLM-compatible engine driven over HTTP (``calibrate --engine-url``): prompts of
  several lengths sent one at a time give time-to-first-token points ``(L, s)``, fitted by least
  squares to ``a + prefill_token_s * L + prefill_attn_s * L^2 / 2`` (a prefill from position 0);
  concurrent streams at several batch sizes give inter-token points ``(b, context, s)``, fitted
  to ``step_base_s + decode_seq_s * b + decode_kv_s * b * context`` (``decode_kv_s`` only when
  the contexts differ enough to tell it apart). A step's fixed cost is the decode intercept;
  what the prefill intercept ``a`` holds beyond it is split, where the engine reported its own
  prefill times (vLLM's ``vllm:request_prefill_time_seconds``, fitted the same way: intercept
  ``p0``), into the prefill step's own extra ``prefill_seq_s = p0 - step_base_s`` and the
  time before the step ``admission_s = a - p0`` (HTTP, tokenizer, the hop to the engine
  core); without them all of it is ``admission_s``.
  Coefficients are non-negative: a term the least squares makes negative is dropped and the rest
  refitted (:func:`nonneg_lstsq`).

Each coefficient's citation holds the measurement and the arithmetic; each measured point is a
``[[checks]]`` entry whose tolerance is how well the fit reproduced it (rounded up, >= 5 %), so
a reader sees the quality of the fit in the file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from radixmesh.core.profile import Check, Profile


def nonneg_lstsq(columns: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Least squares ``y ~ sum(coef_j * column_j)`` with every coefficient >= 0."""
    active = list(range(len(columns)))
    coef = [0.0] * len(columns)
    while active:
        a = np.array([columns[j] for j in active], dtype=float).T
        sol, *_ = np.linalg.lstsq(a, np.array(y, dtype=float), rcond=None)
        worst = int(np.argmin(sol))
        if sol[worst] >= 0:
            for j, value in zip(active, sol, strict=True):
                coef[j] = float(value)
            return coef
        del active[worst]
    return coef


def fit_prefill(points: Sequence[tuple[int, float]]) -> tuple[float, float, float]:
    """(intercept, prefill_token_s, prefill_attn_s) from (prompt tokens, TTFT seconds)."""
    if len({n for n, _ in points}) < 3:
        raise ValueError("prefill fit needs prompts of at least 3 lengths")
    ones = [1.0] * len(points)
    lin = [float(n) for n, _ in points]
    quad = [n * n / 2.0 for n, _ in points]
    a, pt, pa = nonneg_lstsq([ones, lin, quad], [s for _, s in points])
    return a, pt, pa


def fit_decode(points: Sequence[tuple[int, int, float]]) -> tuple[float, float, float]:
    """(step_base_s, decode_seq_s, decode_kv_s) from (batch, context, inter-token seconds)."""
    if len({b for b, _, _ in points}) < 2:
        raise ValueError("decode fit needs at least 2 batch sizes")
    ones = [1.0] * len(points)
    seqs = [float(b) for b, _, _ in points]
    kvs = [float(b * c) for b, c, _ in points]
    y = [s for _, _, s in points]
    contexts = [c for _, c, _ in points]
    if max(contexts) < 2 * max(1, min(contexts)):  # contexts alike: kv term not identifiable
        base, seq = nonneg_lstsq([ones, seqs], y)
        return base, seq, 0.0
    base, seq, kv = nonneg_lstsq([ones, seqs, kvs], y)
    return base, seq, kv


def _tolerance(predicted: float, measured: float) -> float:
    error = abs(predicted / measured - 1)
    return min(1.0, max(0.05, math.ceil(error * 1.25 * 20) / 20))


def _checks(prof: Profile, points: Sequence[Check]) -> tuple[Check, ...]:
    out = []
    for c in points:
        tol = _tolerance(prof.predicted_s(c), c.published_s)
        out.append(Check(c.metric, c.published_s, tol, c.source, c.batch, c.context, c.tokens))
    return tuple(out)


def from_engine_points(
    prefill: Sequence[tuple[int, float]],
    decode: Sequence[tuple[int, int, float]],
    *,
    texts: Mapping[str, str],
    capacities: Mapping[str, int],
    engine_prefill: Sequence[tuple[int, float]] = (),
) -> Profile:
    """A profile fitted to an engine's TTFT and inter-token measurements, and its own
    prefill times where it reports them (module docstring)."""
    a, pt, pa = fit_prefill(prefill)
    base, ds, dk = fit_decode(decode)
    if base <= 0:
        raise ValueError("the decode measurements give no positive step time at batch 0")
    what = texts["source"]
    citations = _fit_citations(what, prefill, decode, a, dk)
    admission, in_step = _split_intercept(a, base, engine_prefill, what, citations)
    prof = Profile(
        **texts,  # type: ignore[arg-type]
        derived=False,
        admission_s=admission,
        prefill_seq_s=in_step,
        step_base_s=base,
        prefill_token_s=pt,
        prefill_attn_s=pa,
        decode_seq_s=ds,
        decode_kv_s=dk,
        citations=citations,
        **capacities,  # type: ignore[arg-type]
    )
    points = [Check("ttft", s, 1.0, f"{what}: TTFT of {n} tokens", tokens=n) for n, s in prefill]
    points += [
        Check("tpot", s, 1.0, f"{what}: ITL at batch {b}", batch=b, context=c) for b, c, s in decode
    ]
    return _replace_checks(prof, _checks(prof, points))


def _fit_citations(what: str, prefill: Sequence[tuple[int, float]],
                   decode: Sequence[tuple[int, int, float]], a: float, dk: float
                   ) -> dict[str, str]:
    """Each fitted coefficient's citation: the fit and the measurements it came from."""
    pre = ", ".join(f"{n}: {s * 1e3:.2f} ms" for n, s in prefill)
    dec = ", ".join(f"b={b} ctx={c}: {s * 1e3:.2f} ms" for b, c, s in decode)
    kv_note = "" if dk else " (contexts alike: not identifiable, 0)"
    return {
        "step_base_s": f"{what}: decode intercept of ITL = base + seq*b + kv*b*ctx over {dec}",
        "prefill_token_s": f"{what}: TTFT = a + t*L + attn*L^2/2 over {pre}; a = "
        f"{a * 1e3:.2f} ms",
        "prefill_attn_s": f"{what}: the same TTFT fit's L^2/2 term",
        "decode_seq_s": f"{what}: ITL fit's per-sequence slope over {dec}",
        "decode_kv_s": f"{what}: ITL fit's per-KV-token slope{kv_note} over {dec}",
    }


def _split_intercept(a: float, base: float, engine_prefill: Sequence[tuple[int, float]],
                     what: str, citations: dict[str, str]) -> tuple[float, float]:
    """The TTFT fit's intercept ``a`` beyond ``step_base_s`` as (``admission_s``,
    ``prefill_seq_s``): the engine's own prefill times, where it reports them at >= 3 prompt
    lengths, say how much of it is inside the step; the rest is admission. Citations of the
    non-zero ones go into ``citations``."""
    in_step = 0.0
    if len({n for n, _ in engine_prefill}) >= 3:
        p0 = fit_prefill(engine_prefill)[0]
        in_step = min(max(0.0, p0 - base), max(0.0, a - base))
        inside = ", ".join(f"{n}: {s * 1e3:.2f} ms" for n, s in engine_prefill)
        if in_step:
            citations["prefill_seq_s"] = (
                f"{what}: the engine's own prefill times ({inside}; vllm:request_prefill_"
                f"time_seconds) fitted as TTFT: intercept {p0 * 1e3:.2f} ms - step_base_s")
    admission = max(0.0, a - base - in_step)
    if admission:
        citations["admission_s"] = (f"{what}: the TTFT fit's intercept a = {a * 1e3:.2f} ms "
                                    f"- step_base_s {base * 1e3:.2f} ms - prefill_seq_s "
                                    f"{in_step * 1e3:.2f} ms")
    return admission, in_step


def from_builtin_fit(doc: Mapping[str, Any], *, context_length: int, kv_blocks: int) -> Profile:
    """A profile from ``radixmesh calibrate``'s cost-model document (built-in engine)."""
    o = float(doc["prefill_overhead_s"])
    rate = float(doc["prefill_s_per_token"])
    scale = float(doc["context_scale"])
    per_token = float(doc["decode_s_per_token"])
    what = f"{doc['source']}"
    prof = Profile(
        name=str(doc["name"]).replace(":", "-"),
        hardware=what,
        model=str(doc["name"]),
        source=what,
        derived=False,
        step_base_s=o,
        prefill_token_s=rate,
        prefill_attn_s=rate / scale,
        decode_seq_s=max(0.0, per_token - o),
        decode_kv_s=0.0,
        kv_blocks=kv_blocks,
        block_size=16,
        context_length=context_length,
        max_running=1,
        step_tokens=context_length,
        citations=_builtin_citations(what, o, rate, scale, per_token),
    )
    cold = [m for m in doc.get("measurements", {}).get("prefill", []) if not m["cached"]]
    points = [
        Check(
            "ttft",
            m["prefill_s"],
            1.0,
            f"{what}: prefill of {m['uncached']} tokens",
            tokens=int(m["uncached"]),
        )
        for m in cold
        if m["prefill_s"] > 0
    ]
    points.append(Check("tpot", per_token, 1.0, f"{what}: decode per token", context=80))
    return _replace_checks(prof, _checks(prof, points))


def _builtin_citations(
    what: str, o: float, rate: float, scale: float, per_token: float
) -> dict[str, str]:
    return {
        "step_base_s": f"{what}: fitted prefill overhead {o * 1e3:.3f} ms",
        "prefill_token_s": f"{what}: fitted prefill rate {rate * 1e6:.2f} us per work unit",
        "prefill_attn_s": f"{what}: rate / fitted context_scale {scale:.0f}",
        "decode_seq_s": f"{what}: decode {per_token * 1e3:.3f} ms per token - step_base_s "
        "(0 if below)",
        "decode_kv_s": f"{what}: not measured (decodes after 64-token prompts): 0",
    }


def _replace_checks(prof: Profile, checks: tuple[Check, ...]) -> Profile:
    return replace(prof, checks=checks)
