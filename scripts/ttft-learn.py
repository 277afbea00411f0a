#!/usr/bin/env python3
"""Does a learned TTFT predictor beat the cost model's forecast? (issue #52: "if a learned
model, as Lodestar's or llm-d's, predicts better than the cost model on these runs, adopt
it ... measured, not assumed").

Reads a ``radixmesh sim --decisions`` folder, whose records carry the node that served each
request as its entry node's router saw it when it decided (``considered``: the decision
log's fields, nothing the router did not know), or a ``radixmesh bench`` folder, whose
nodes' decision logs are joined to its records; and the TTFT each client met. Each model
predicts every measured request from the requests sent before it (prequential: fitted on
the past only, refitted every ``--refit`` requests), as a node learning online would:

* ``forecast``: the router's own TTFT forecast (``Candidate.ttft_s``);
* ``ridge``: the forecast times exp(w . x), w a ridge regression of log(actual / forecast)
  on the standardized features (a linear residual model, as llm-d's latency predictor
  starts from);
* ``mlp``: log(actual / forecast) from the same features by a one-hidden-layer network
  (32 tanh units, Adam; Lodestar's predictor is a small MLP);
* ``route median``: the forecast times the median residual of its route (local or
  forwarded) so far: how much of the error is a constant bias.

Prints one Markdown row per model and route: median / p90 / mean of |predicted - actual| /
actual.

    scripts/ttft-learn.py DIR [--policy cost] [--refit 200] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from radixmesh.results.decisions import last_rankings, served_view

BATCH = ("running", "waiting", "decoding", "ahead_tokens", "kv_used", "ahead_s",
         "residual_s", "free_s", "rate", "overhead_s")


def features(rec: dict[str, Any], c: dict[str, Any], scale: float) -> list[float]:
    """What the router knew of the served node ``c`` at its decision, as numbers (its
    forecast first, unscaled to the records' time)."""
    b = c.get("batch") or {}
    uncached = max(rec["prompt_tokens"] - c["cached_tokens"], 1)
    out = [
        math.log(c["predicted_ttft_s"] / scale), float(c["is_self"]), c["rtt_s"],
        c.get("lateness_median_s", 0.0), c.get("lateness_s", 0.0), c["wait_error_s"],
        math.log1p(uncached), math.log1p(c["cached_tokens"]), c["queue_depth"],
        c["utilization"], c.get("kv_usage", 0.0),
    ]
    out += [math.log1p(b.get(k, 0.0)) if k in ("ahead_tokens", "kv_used") else b.get(k, 0.0)
            for k in BATCH]
    return out


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _served(folder: Path, run: str) -> Callable[[dict[str, Any]], dict[str, Any] | None]:
    """A record's served node as its router saw it: the record's own ``considered`` (sim
    --decisions), else its entry node's last ranking of it in ``decisions/<run>.jsonl`` (a
    bench run's nodes' logs)."""
    rankings = last_rankings(folder, run)

    def served(rec: dict[str, Any]) -> dict[str, Any] | None:
        if rec.get("considered"):
            return dict(rec["considered"])
        return served_view(rankings, rec)

    return served


Loaded = tuple[np.ndarray, np.ndarray, np.ndarray, list[str], np.ndarray]


def load(folder: Path, policy: str) -> Loaded:
    """(features, log actual TTFT, log forecast, route, measured) of the ``policy`` run's
    requests with a forecast, in the order sent."""
    run = next(r for r in json.loads((folder / "summary.json").read_text())["runs"]
               if r["policy"] == policy)
    scale, served = float(run.get("time_scale") or 1.0), _served(folder, run["name"])
    rows = []
    for rec in sorted(_jsonl(folder / "requests.jsonl"), key=lambda r: r.get("t_send") or 0):
        c = served(rec) if rec.get("run") == run["name"] and rec.get("ttft_s") else None
        if c is not None and c.get("predicted_ttft_s"):
            rows.append((rec, c))
    if not rows:
        raise SystemExit(f"{folder}: no {policy!r} records with the router's view of their node "
                         "(`radixmesh sim ... --decisions`, or a bench run's decisions/)")
    x = np.array([features(r, c, scale) for r, c in rows])
    y = np.log(np.array([r["ttft_s"] for r, _ in rows]))
    route = ["local" if r["route"] == "local" else "forwarded" for r, _ in rows]
    measured = np.array([not r.get("warmup") for r, _ in rows])
    return x, y, x[:, 0].copy(), route, measured


def _standardize(x: np.ndarray, upto: int) -> tuple[np.ndarray, np.ndarray]:
    mu = x[:upto].mean(axis=0)
    sd = x[:upto].std(axis=0)
    return mu, np.where(sd > 1e-12, sd, 1.0)


def ridge(x: np.ndarray, y: np.ndarray, base: np.ndarray, upto: int, lam: float = 1.0
          ) -> Callable[[np.ndarray], np.ndarray]:
    mu, sd = _standardize(x, upto)
    z = np.hstack([np.ones((upto, 1)), (x[:upto] - mu) / sd])
    r = y[:upto] - base[:upto]
    w = np.linalg.solve(z.T @ z + lam * np.eye(z.shape[1]), z.T @ r)
    return lambda q: (np.hstack([np.ones((len(q), 1)), (q - mu) / sd]) @ w)


def mlp(x: np.ndarray, y: np.ndarray, base: np.ndarray, upto: int, seed: int,
        hidden: int = 32, epochs: int = 300) -> Callable[[np.ndarray], np.ndarray]:
    """A residual network: log actual - log forecast from the standardized features."""
    rng = np.random.default_rng(seed)
    mu, sd = _standardize(x, upto)
    z, r = (x[:upto] - mu) / sd, y[:upto] - base[:upto]
    w1 = rng.normal(0, 1 / math.sqrt(z.shape[1]), (z.shape[1], hidden))
    b1, w2, b2 = np.zeros(hidden), rng.normal(0, 1 / math.sqrt(hidden), hidden), 0.0
    params = [w1, b1, w2, np.array(b2)]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    for t in range(1, epochs + 1):
        h = np.tanh(z @ params[0] + params[1])
        err = h @ params[2] + params[3] - r
        gh = np.outer(err, params[2]) * (1 - h * h) / len(r)
        grads = [z.T @ gh + 1e-3 * params[0], gh.sum(0), h.T @ err / len(r) + 1e-3 * params[2],
                 np.array(err.mean())]
        for i, g in enumerate(grads):
            m[i] = 0.9 * m[i] + 0.1 * g
            v[i] = 0.999 * v[i] + 0.001 * g * g
            step = (m[i] / (1 - 0.9**t)) / (np.sqrt(v[i] / (1 - 0.999**t)) + 1e-8)
            params[i] = params[i] - 0.01 * step
    w1, b1, w2, b2 = params
    return lambda q: np.tanh(((q - mu) / sd) @ w1 + b1) @ w2 + b2


def prequential(x: np.ndarray, y: np.ndarray, base: np.ndarray, refit: int,
                fit: Callable[[int], Callable[[np.ndarray], np.ndarray]]) -> np.ndarray:
    """Each request's log TTFT predicted by a model fitted on the requests before it
    (refitted every ``refit``); the forecast itself until ``refit`` requests are known."""
    out = base.copy()
    for start in range(refit, len(y), refit):
        model = fit(start)
        out[start:start + refit] = base[start:start + refit] + model(x[start:start + refit])
    return out


def route_median(y: np.ndarray, base: np.ndarray, route: list[str]) -> np.ndarray:
    out, seen = base.copy(), {"local": [], "forwarded": []}
    for i, kind in enumerate(route):
        past = seen[kind]
        if past:
            out[i] = base[i] + float(np.median(past[-500:]))
        past.append(y[i] - base[i])
    return out


def errors(pred: np.ndarray, y: np.ndarray) -> str:
    e = np.abs(np.exp(pred) - np.exp(y)) / np.exp(y) * 100
    return f"{np.median(e):.1f} | {np.percentile(e, 90):.1f} | {e.mean():.1f} | {len(e)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--policy", default="cost", help="whose run (default cost)")
    ap.add_argument("--refit", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    x, y, base, route, measured = load(a.folder, a.policy)
    preds = {
        "forecast": base,
        "route median": route_median(y, base, route),
        "ridge": prequential(x, y, base, a.refit, lambda k: ridge(x, y, base, k)),
        "mlp": prequential(x, y, base, a.refit, lambda k: mlp(x, y, base, k, a.seed)),
    }
    print("| model | requests | median % | p90 % | mean % | n |")
    print("|---|---|---|---|---|---|")
    kinds = np.array(route)
    for name, p in preds.items():
        for kind in ("all", "local", "forwarded"):
            sel = measured if kind == "all" else measured & (kinds == kind)
            if sel.any():
                print(f"| {name} | {kind} | {errors(p[sel], y[sel])} |")


if __name__ == "__main__":
    main()
