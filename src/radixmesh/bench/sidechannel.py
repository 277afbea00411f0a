"""The prefix-cache side channel, measured before and after tenant isolation (docs/security.md).

Theory of operation
-------------------
One harness, two set-ups of the same in-process mesh: three radixmesh nodes, each in front of
its own emulated vLLM (``emulate/``: prefill time from a hardware profile, default
``h100-llama3-8b``, KV events on), byte tokens, default routing::

    victim ──(secret 2,000-character prefix + question, run on n0)──▶ n0
    attacker ──(right guess = secret + fresh question, or wrong guess = random text of the
                same length with the same 19-character opening + fresh question)──▶ n1

* ``shared`` (before): no tenants; victim and attacker share the cache, as without
  isolation (today's default for requests without a namespace).
* ``isolated`` (after): ``--api-keys`` with two tenants; the victim is tenant ``victim``, the
  attacker tenant ``attacker``, and each attacker probe names a fresh ``cache_salt`` (its own
  probes must not help each other: the right guesses share the secret).

Probes alternate right and wrong in a seeded random order (every prompt made beforehand), one
at a time, each timed by the client (whole request, ``max_tokens`` 1). Per set-up it reports
the medians, the difference of medians with a 95 % bootstrap interval (2,000 resamples,
seeded), the two-sided Mann-Whitney U p-value (normal approximation), and for every
cache-revealing field
(``x-radixmesh-cached-tokens``, ``-expected-cached-tokens``, ``-placement``, ``-served-by``,
``-route``, ``usage.prompt_tokens_details.cached_tokens``), the values seen for right and for
wrong guesses. ``python -m radixmesh.bench.sidechannel --probes 200`` runs both set-ups.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import random
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from radixmesh.core.headers import HEADER_HOP
from radixmesh.core.profile import resolve
from radixmesh.emulate.server import EmulatedEngine
from radixmesh.engine.tokenizers import ByteTokenizer
from radixmesh.runtime.cluster import free_port
from radixmesh.runtime.config import ServeConfig
from radixmesh.runtime.inprocess import serving
from radixmesh.runtime.node import NodeService
from radixmesh.runtime.serve_cli import build_external_service

FIELDS = ("x-radixmesh-cached-tokens", "x-radixmesh-expected-cached-tokens",
          "x-radixmesh-placement", "x-radixmesh-served-by", "x-radixmesh-route")
KEYS = {"victim": "key-of-the-victim-01", "attacker": "key-of-the-attacker1"}
OPENING = "Confidential memo: "
WAIT_S = 20.0


def mann_whitney_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided p-value of the Mann-Whitney U test, normal approximation with tie-corrected
    variance (both samples of 20 or more)."""
    pooled = sorted((v, i) for i, v in enumerate([*a, *b]))
    ranks = [0.0] * len(pooled)
    ties = 0.0
    i = 0
    while i < len(pooled):
        j = i
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[pooled[k][1]] = (i + j) / 2 + 1
        ties += (j - i + 1) ** 3 - (j - i + 1)
        i = j + 1
    n1, n2 = len(a), len(b)
    u = sum(ranks[:n1]) - n1 * (n1 + 1) / 2
    n = n1 + n2
    var = n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1)))
    if var <= 0:
        return 1.0
    z = (abs(u - n1 * n2 / 2) - 0.5) / math.sqrt(var)
    return math.erfc(max(z, 0.0) / math.sqrt(2))


def median_diff_ci(a: Sequence[float], b: Sequence[float], seed: int = 0,
                   resamples: int = 2000) -> tuple[float, float, float]:
    """median(a) - median(b) and its 95 % percentile-bootstrap interval."""
    rng = np.random.default_rng(seed)
    xa, xb = np.asarray(a), np.asarray(b)
    ia = rng.integers(0, len(xa), (resamples, len(xa)))
    ib = rng.integers(0, len(xb), (resamples, len(xb)))
    diffs = np.median(xa[ia], axis=1) - np.median(xb[ib], axis=1)
    low, high = np.percentile(diffs, [2.5, 97.5])
    return float(np.median(xa) - np.median(xb)), float(low), float(high)


def homogeneity_p(a: Counter[str], b: Counter[str], seed: int = 0,
                  resamples: int = 2000) -> float:
    """Permutation p-value that the values of one field follow the same distribution for
    right (``a``) and wrong (``b``) guesses (chi-square statistic of the 2 x k table; 1.0
    when both saw one and the same value)."""
    values = sorted(set(a) | set(b))
    if len(values) == 1:
        return 1.0
    codes = np.array([values.index(v) for c in (a, b) for v, n in c.items() for _ in range(n)])
    n_a = sum(a.values())

    def stat(labels: np.ndarray) -> float:
        first = np.bincount(labels[:n_a], minlength=len(values))
        second = np.bincount(labels[n_a:], minlength=len(values))
        total = first + second
        exp_a = total * n_a / len(labels)
        exp_b = total - exp_a
        return float(((first - exp_a) ** 2 / exp_a).sum() + ((second - exp_b) ** 2 / exp_b).sum())

    rng = np.random.default_rng(seed)
    seen = stat(codes)
    hits = sum(stat(rng.permutation(codes)) >= seen - 1e-12 for _ in range(resamples))
    return (hits + 1) / (resamples + 1)


@contextlib.asynccontextmanager
async def mesh(profile: str, isolated: bool, policy: str, n: int = 3
               ) -> AsyncIterator[list[tuple[int, NodeService]]]:
    """``n`` nodes, each fronting an emulated engine; yields their ports and services."""
    prof = resolve(profile)
    engines = [EmulatedEngine(prof, model="emulated", kv_events="tcp://127.0.0.1:0")
               for _ in range(n)]
    ports = [free_port() for _ in range(n)]
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.txt"
        keys.write_text("".join(f"{k} {t}\n" for t, k in KEYS.items()))
        async with contextlib.AsyncExitStack() as stack:
            services: list[NodeService] = []
            for i, eng in enumerate(engines):
                await eng.start()
                stack.push_async_callback(eng.stop)
                cfg = ServeConfig(
                    node_id=f"n{i}", port=ports[i], gossip_interval=0.5, gossip_announce=0.05,
                    peers=tuple(f"127.0.0.1:{p}" for p in ports[:i]), engine="vllm",
                    engine_url=eng.url, kv_events=eng.kv_endpoint,
                    kv_replay=eng.replay_endpoint, model="emulated", policy=policy,
                    cache_tokens=prof.kv_blocks * prof.block_size,
                    api_keys=str(keys) if isolated else "")
                service = build_external_service(cfg, tokenizer=ByteTokenizer())
                await stack.enter_async_context(serving(service, ports[i]))
                services.append(service)
            await _until(lambda: all(len(s.peer_states()) == n - 1 for s in services))
            for service, eng in zip(services, engines, strict=True):  # ZMQ's slow joiner
                await _until(lambda s=service, e=eng: _subscribed(s, e))
            yield list(zip(ports, services, strict=True))


async def _until(cond: Any, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("the mesh did not get there in time")
        await asyncio.sleep(0.05)


def _subscribed(service: NodeService, engine: EmulatedEngine) -> bool:
    """The node's KV-event subscriber got a batch (else another harmless one is sent)."""
    if service.attachments[0].counts["messages"]:
        return True
    engine.clear_all()
    return False


def _view_blocks(service: NodeService, peer: str) -> int:
    peers = service.mesh()["peers"]
    assert isinstance(peers, list)
    return next((int(p["view_blocks"]) for p in peers if p["node_id"] == peer), 0)


@dataclass(frozen=True, slots=True)
class TimedCompletion:
    """One timed ``/v1/completions`` answer of a node (the harnesses of the tenants issue)."""

    elapsed_s: float
    data: dict[str, Any]
    headers: Mapping[str, str]

    @property
    def prompt_tokens(self) -> int:
        return int(self.data["usage"]["prompt_tokens"])

    @property
    def cached_tokens(self) -> int:
        return int(self.data["usage"]["prompt_tokens_details"]["cached_tokens"])


async def completion(http: aiohttp.ClientSession, port: int, body: dict[str, Any],
                     headers: dict[str, str] | None = None) -> TimedCompletion:
    """POST ``body`` to the node on ``port``, timed to its whole answer; a non-200 raises."""
    t0 = time.perf_counter()
    async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                         headers=headers or {}) as resp:
        data = await resp.json(content_type=None)
        elapsed = time.perf_counter() - t0
        if resp.status != 200:
            raise RuntimeError(f"request failed: {resp.status} {data}")
        return TimedCompletion(elapsed, data, resp.headers.copy())  # case-insensitive


def hit_summary(results: Sequence[TimedCompletion], served_by: str) -> dict[str, Any]:
    """Hit rate, latency p50 / p90 and the spread over ``served_by`` (a response header)."""
    lat = np.array([r.elapsed_s for r in results])
    return {
        "requests": len(results),
        "hit_rate": round(sum(r.cached_tokens for r in results)
                          / sum(r.prompt_tokens for r in results), 3),
        "latency_p50_s": round(float(np.median(lat)), 4),
        "latency_p90_s": round(float(np.percentile(lat, 90)), 4),
        "served_by": dict(sorted(Counter(r.headers.get(served_by, "?")
                                         for r in results).items())),
    }


async def _send(http: aiohttp.ClientSession, port: int, prompt: str, key: str | None,
                salt: str | None = None, here: bool = False) -> tuple[float, dict[str, str]]:
    body: dict[str, Any] = {"model": "emulated", "prompt": prompt, "max_tokens": 1,
                            "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if here:  # run on the entry node (the victim's prefix is cached on n0)
        headers[HEADER_HOP] = "1"
    done = await completion(http, port, body, headers)
    seen = {f: done.headers.get(f, "-") for f in FIELDS}
    seen["usage.cached_tokens"] = str(done.cached_tokens)
    return done.elapsed_s, seen


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz     ") for _ in range(n))


async def measure(profile: str, isolated: bool, probes: int, seed: int, policy: str = "cost"
                  ) -> dict[str, Any]:
    """One set-up: ``probes`` right and ``probes`` wrong guesses (see the module docstring)."""
    rng = random.Random(seed)
    text = functools.partial(_text, rng)
    secret = OPENING + text(2000)
    victim, attacker = (KEYS["victim"], KEYS["attacker"]) if isolated else (None, None)
    kinds = ["right"] * probes + ["wrong"] * probes
    rng.shuffle(kinds)
    times: dict[str, list[float]] = {"right": [], "wrong": []}
    fields: dict[str, dict[str, Counter[str]]] = {"right": {}, "wrong": {}}
    async with mesh(profile, isolated, policy) as nodes, aiohttp.ClientSession() as http:
        ports = [port for port, _ in nodes]
        await _send(http, ports[0], secret + " Question: " + text(40), victim, here=True)
        await _until(lambda: _view_blocks(nodes[1][1], "n0") >= 2000 // 16)
        # made beforehand: no harness work between probes differs between right and wrong
        prompts = [(secret if kind == "right" else OPENING + text(2000)) + " Question: "
                   + text(40) for kind in kinds]
        for k, (kind, prompt) in enumerate(zip(kinds, prompts, strict=True)):
            salt = f"probe-{k}" if isolated else None
            elapsed, seen = await _send(http, ports[1], prompt, attacker, salt)
            times[kind].append(elapsed)
            for name, value in seen.items():
                fields[kind].setdefault(name, Counter())[value] += 1
    diff, low, high = median_diff_ci(times["right"], times["wrong"], seed)
    return {
        "setup": "isolated" if isolated else "shared", "profile": profile, "probes": probes,
        "policy": policy,
        "median_right_s": float(np.median(times["right"])),
        "median_wrong_s": float(np.median(times["wrong"])),
        "median_diff_s": diff, "ci95_s": [low, high],
        "mann_whitney_p": mann_whitney_p(times["right"], times["wrong"]),
        "fields_right": {k: dict(v) for k, v in fields["right"].items()},
        "fields_wrong": {k: dict(v) for k, v in fields["wrong"].items()},
        "fields_identical": fields["right"] == fields["wrong"],
        "fields_homogeneity_p": {name: homogeneity_p(fields["right"][name],
                                                     fields["wrong"][name], seed)
                                 for name in fields["right"]},
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m radixmesh.bench.sidechannel",
                                 description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--probes", type=int, default=200, help="right and wrong guesses, each")
    ap.add_argument("--profile", default="h100-llama3-8b")
    ap.add_argument("--only", choices=("shared", "isolated"))
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--policy", default="cost", help="the nodes' routing policy")
    args = ap.parse_args(argv)
    for isolated in (False, True):
        if args.only and args.only != ("isolated" if isolated else "shared"):
            continue
        out = asyncio.run(measure(args.profile, isolated, args.probes, args.seed, args.policy))
        print(json.dumps(out, indent=1, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
