"""Fitting the simulator's cost model (:mod:`radixmesh.sim.costs`) to measured requests.

Every measurement is a point ``(u = uncached tokens, c = cached tokens, seconds)``. The
router's form (``core/estimators.py``)::

    prefill(u, c) = overhead + rate * u * (1 + (c + u/2) / context_scale)

is fitted by least squares on relative error (short and long prompts count alike): for each
``context_scale`` on a log grid, ``overhead`` and ``rate`` are linear; the best grid point wins.

The points come from timing the built-in engine (``radixmesh calibrate``,
:mod:`radixmesh.bench.calibrate`) or from a real cluster run's records (:func:`from_records`:
locally served one-token requests, client latency against uncached/cached tokens) —
calibration in the very conditions (machine load, threads, HTTP) the simulator is validated
against.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from radixmesh.core.units import parse_duration
from radixmesh.sim import costs
from radixmesh.sim.costs import CostModel

SCALES = tuple(2.0 ** (k / 2) for k in range(16, 37))  # 256 .. 262,144


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


def fitted_model(
    fit: dict[str, float],
    *,
    name: str,
    decode_s_per_token: float,
    request_overhead_s: float,
    forward_overhead_s: float,
    source: str,
) -> CostModel:
    """A cost model with the prefill terms of ``fit`` (from :func:`fit_prefill`)."""
    return CostModel(
        name=name,
        prefill_overhead_s=fit["prefill_overhead_s"],
        prefill_s_per_token=fit["prefill_s_per_token"],
        context_scale=fit["context_scale"],
        decode_s_per_token=decode_s_per_token,
        request_overhead_s=request_overhead_s,
        forward_overhead_s=forward_overhead_s,
        source=source,
    )


def model_doc(model: CostModel, fit: dict[str, float], points: int) -> dict[str, Any]:
    """The JSON document of a fitted cost model: its fields and the fit's quality."""
    doc: dict[str, Any] = model.to_dict()
    doc["fit"] = {"rel_rmse": fit["rel_rmse"], "points": points}
    return doc


def from_records(args: argparse.Namespace) -> dict[str, Any]:
    """Fit prefill from a real run: each locally served request is a point
    ``(prompt - cached, cached, client latency)``; the fitted overhead therefore includes the
    client's HTTP round trip and the node's handler, as the simulator's service time must."""
    points = _local_points(args.from_records, {r for r in args.runs.split(",") if r})
    if len(points) < 10:
        raise ValueError(f"{args.from_records}: too few local one-token requests to fit")
    fit = fit_prefill(points)
    decode = costs.resolve("cpu-tiny").decode_s_per_token  # not observable from 1-token requests
    model = fitted_model(
        fit,
        name=f"fitted:{Path(args.from_records).parent.name or 'records'}",
        decode_s_per_token=decode,
        request_overhead_s=0.0,
        forward_overhead_s=parse_duration(args.forward_overhead),
        source=f"fit of {len(points)} locally served requests in {args.from_records}",
    )
    doc = model_doc(model, fit, len(points))
    if not args.quiet:
        print(
            f"fit: overhead {model.prefill_overhead_s * 1e3:.2f} ms, rate "
            f"{model.prefill_s_per_token * 1e6:.2f} us/unit, context_scale "
            f"{model.context_scale:,.0f}, rel. RMSE {fit['rel_rmse']:.1%} over {len(points)} "
            "requests",
            file=sys.stderr,
        )
    return doc


def _local_points(path: str, wanted: set[str]) -> list[tuple[int, int, float]]:
    """``(uncached, cached, latency)`` of the error-free, locally served one-token requests in
    a ``requests.jsonl`` (of the runs in ``wanted``; all when empty)."""
    points: list[tuple[int, int, float]] = []
    with open(path, encoding="utf-8") as fh:
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
    return points
