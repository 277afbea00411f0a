"""One run of requests through the nodes in front of real vLLM, and what the engine says it
cached for each: the workload, the streaming client, the per-request agreement.

Theory of operation
-------------------
Requests stream, so the response headers carry what radixmesh knew before the engine ran:
``x-radixmesh-cached-tokens`` is the serving node's KV-event index match at acceptance (any
policy), ``x-radixmesh-expected-cached-tokens`` the router's estimate it routed on (``none``
claims 0 by design). ``replay_run`` sends the requests in order, ``concurrency`` in flight
(closed loop). One in flight: each request's truth is the served engine's
``vllm:prefix_cache_hits`` delta around it (and the engine's own
``usage.prompt_tokens_details.cached_tokens`` must agree); more: the counters mix requests, so
the truth is the per-request usage figure and the counters are checked in total.
``Agreement`` counts predictions equal to the truth, per route, and keeps what
``bench/mismatch.py`` needs to classify the rest.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from radixmesh.bench.client import request_body
from radixmesh.bench.mismatch import Seen
from radixmesh.bench.vllm_server import VllmServer
from radixmesh.core.headers import HEADER_CACHED, HEADER_EXPECTED, HEADER_ROUTE, HEADER_SERVED_BY
from radixmesh.results.records import Record
from radixmesh.workload.request import Request

METRIC_WAIT_S = 2.0
# Idle connections are dropped before the servers close them (vLLM's and uvicorn's default
# keep-alive: 5 s, httpx's own expiry too): a request sent as the server closes is lost.
CLIENT_KEEPALIVE_S = 2.0


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=600.0, trust_env=False,
                             limits=httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_S))


@dataclass(frozen=True, slots=True)
class Observed:
    """One request's cached-token figures: radixmesh's two predictions, the engine's two."""

    index: int  # x-radixmesh-cached-tokens of a stream: the serving node's index match
    router: int  # x-radixmesh-expected-cached-tokens: what the router routed on
    usage: int | None  # the engine's usage.prompt_tokens_details.cached_tokens
    actual: int  # the served engine's vllm:prefix_cache_hits delta


@dataclass(slots=True)
class Agreement:
    """Predicted vs actual cached tokens over the requests of one run."""

    requests: int = 0
    equal: int = 0  # index prediction == actual
    router_equal: int = 0  # router estimate == actual
    usage_equal: int = 0  # the engine's usage figure == its /metrics delta
    by_route: dict[str, list[int]] = field(default_factory=dict)  # route -> [n, equal]
    misses: list[dict[str, Any]] = field(default_factory=list)
    usage_sum: int = 0  # the engines' usage cached_tokens, summed
    counter_check: tuple[int, int] | None = None  # (counters' hit delta, usage_sum) of a run
    prompts: Any = None  # request -> prompt token ids (set by the caller: the tokenizer)
    seen: list[tuple[int, Seen]] = field(default_factory=list)  # (engine, request) to classify
    mismatch: dict[str, Any] | None = None  # bench/mismatch.py's tally, once classified
    verdicts: list[str] = field(default_factory=list)  # per entry of ``seen``

    def note_seen(self, rec: Record, req: Request, marks: dict[str, float], actual: int,
                  node_engine: dict[str, int]) -> None:
        idx = node_engine.get(rec.served_by or "")
        if self.prompts is None or idx is None or "headers" not in marks:
            return
        end = marks["sent"] + rec.latency_s
        self.seen.append((idx, Seen(rec.id, tuple(self.prompts(req)), rec.cached_tokens or 0,
                                    actual, marks["sent"], marks["headers"],
                                    marks.get("first", end))))

    def add(self, rec: Record, seen: Observed) -> None:
        self.requests += 1
        self.usage_sum += seen.usage or 0
        same = seen.index == seen.actual
        self.equal += same
        self.router_equal += seen.router == seen.actual
        self.usage_equal += seen.usage == seen.actual
        slot = self.by_route.setdefault(rec.route or "?", [0, 0])
        slot[0] += 1
        slot[1] += same
        if not same and len(self.misses) < 20:
            self.misses.append({"id": rec.id, "route": rec.route, "served_by": rec.served_by,
                                "predicted": seen.index, "router": seen.router,
                                "actual": seen.actual, "prompt_tokens": rec.prompt_tokens})

    @property
    def share(self) -> float | None:
        return self.equal / self.requests if self.requests else None

    def to_json(self) -> dict[str, Any]:
        return {"requests": self.requests, "equal": self.equal, "share_equal": self.share,
                "router_equal": self.router_equal, "usage_equals_metrics": self.usage_equal,
                "counter_hits_vs_usage_sum": self.counter_check,
                "by_route": {k: {"requests": v[0], "equal": v[1]}
                             for k, v in sorted(self.by_route.items())},
                "first_mismatches": self.misses, "classified": self.mismatch}


def build_workload(requests: int, groups: int, scale: float, seed: int) -> list[Request]:
    from radixmesh.workload.skew import uniform
    from radixmesh.workload.synthetic import synthetic_groups

    pool = synthetic_groups(seed=seed, scale=scale, groups=groups,
                            max_per_group=max(1, requests // groups + 1))
    reqs = uniform(pool, requests, seed)
    return [r.with_entry(i % 2).with_time(None) for i, r in enumerate(reqs)]


async def replay_run(policy: str, urls: Sequence[str], node_ids: Sequence[str],
                     engines: Sequence[VllmServer], node_engine: dict[str, int],
                     reqs: Sequence[Request], concurrency: int = 1,
                     prompts: Callable[[Request], list[int]] | None = None
                     ) -> tuple[list[Record], Agreement]:
    """Send ``reqs`` in order, ``concurrency`` in flight (closed loop). One in flight: each
    request's truth is the served engine's counter delta around it. More: the counters mix
    requests, so the truth is the engine's per-request usage figure, and the run's summed
    usage is checked against the counters' total delta (``Agreement.counter_check``)."""
    agreement = Agreement(prompts=prompts)
    records: list[Record] = []
    t0 = time.perf_counter()
    start = [e.counters() for e in engines]
    queue = list(enumerate(reqs))[::-1]

    async def worker(http: httpx.AsyncClient) -> None:
        while queue:
            seq, req = queue.pop()
            entry = req.entry or 0
            before = [e.counters() for e in engines] if concurrency == 1 else []
            rec = Record(run="vllm-check", policy=policy, seq=seq, id=req.id, group=req.group,
                         entry=entry, entry_node=node_ids[entry], t_send=time.perf_counter() - t0)
            usage = await send_stream(http, urls[entry], req, rec, t0, marks := {})
            records.append(rec)
            if not rec.ok:
                continue
            actual = (await _served_delta(rec, engines, node_engine, before)
                      if concurrency == 1 else usage)
            if actual is not None:
                agreement.add(rec, Observed(rec.cached_tokens or 0,
                                            rec.expected_cached_tokens or 0, usage, actual))
                agreement.note_seen(rec, req, marks, actual, node_engine)

    async with _client() as http:
        await asyncio.gather(*(worker(http) for _ in range(max(1, concurrency))))
    await asyncio.sleep(METRIC_WAIT_S)  # let the engines' stats loops catch up
    hits = sum(e.counters()[1] - s[1] for e, s in zip(engines, start, strict=True))
    agreement.counter_check = (int(hits), agreement.usage_sum)
    records.sort(key=lambda r: r.seq)
    return records, agreement


async def warm_up(engines: Sequence[VllmServer], reqs: Sequence[Request],
                  concurrency: int) -> None:
    """Each engine gets ``reqs`` straight (no node), ``concurrency`` at a time, untimed: a
    fresh vLLM CPU server's first requests ran 5-15x slower than later ones (its first
    batches of each shape), which landed on whichever policy ran first after the start."""
    async def worker(http: httpx.AsyncClient, url: str, queue: list[Request]) -> None:
        while queue:
            req = queue.pop()
            rec = Record(run="warm-up", policy="-", seq=0, id=req.id, group=req.group,
                         entry=0, entry_node="-", t_send=0.0)
            await send_stream(http, url, req, rec, 0.0)

    async with _client() as http:
        for e in engines:
            queue = list(reqs)
            await asyncio.gather(*(worker(http, e.url, queue)
                                   for _ in range(max(1, concurrency))))


async def send_stream(http: httpx.AsyncClient, base_url: str, req: Request, rec: Record,
                      t0: float, marks: dict[str, float] | None = None,
                      extra_body: dict[str, Any] | None = None) -> int | None:
    """POST ``req`` streaming; fills ``rec`` from the start headers and the usage chunk;
    returns the engine's ``cached_tokens`` from that chunk (None if absent). ``marks`` gets
    the perf_counter instants "sent", "headers" and "first" (the first chunk); ``extra_body``
    goes into the body (``cache_salt``, an adapter's ``model``)."""
    path, body = request_body(req, "tiny")
    body.update(stream=True, stream_options={"include_usage": True}, **(extra_body or {}))
    start = time.perf_counter()
    marks = {} if marks is None else marks
    marks["sent"] = start
    engine_cached: int | None = None
    try:
        async with http.stream("POST", base_url.rstrip("/") + path, json=body) as resp:
            marks["headers"] = time.perf_counter()
            _read_headers(rec, resp)
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            async for line in resp.aiter_lines():
                data = line[5:].strip() if line.startswith("data:") else ""
                if data and data != "[DONE]":
                    marks.setdefault("first", time.perf_counter())
                    engine_cached = _read_chunk(rec, json.loads(data), engine_cached)
    except (httpx.HTTPError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    end = time.perf_counter()
    rec.latency_s, rec.t_done = end - start, end - t0
    return engine_cached if isinstance(engine_cached, int) else None


def _read_headers(rec: Record, resp: httpx.Response) -> None:
    """The node's start headers: who served it, how, and the cached tokens it predicted."""
    rec.status = resp.status_code
    h = resp.headers
    rec.served_by, rec.route = h.get(HEADER_SERVED_BY), h.get(HEADER_ROUTE)
    rec.expected_cached_tokens = _int(h.get(HEADER_EXPECTED))
    rec.cached_tokens = _int(h.get(HEADER_CACHED))


def _read_chunk(rec: Record, chunk: dict[str, Any], engine_cached: Any) -> Any:
    """One SSE chunk: an error into ``rec``, the usage chunk's counts into ``rec``; returns
    the engine's ``cached_tokens`` (the usage chunk's, else ``engine_cached`` unchanged)."""
    if "error" in chunk:
        rec.error = str(chunk["error"])[:300]
    usage = chunk.get("usage") or {}
    if not usage:
        return engine_cached
    rec.prompt_tokens = usage.get("prompt_tokens")
    rec.completion_tokens = usage.get("completion_tokens")
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


async def _served_delta(rec: Record, engines: Sequence[VllmServer], node_engine: dict[str, int],
                        before: Sequence[tuple[float, float]]) -> int | None:
    """The served engine's prefix-cache hit delta for this request (None: not readable)."""
    idx = node_engine.get(rec.served_by or "")
    if idx is None:
        return None
    deadline = time.monotonic() + METRIC_WAIT_S
    while True:  # the counters are updated by the engine's stats loop: wait until they moved
        queries, hits = engines[idx].counters()
        dq, dh = queries - before[idx][0], hits - before[idx][1]
        if dq >= (rec.prompt_tokens or 1) or time.monotonic() > deadline:
            return int(dh) if dq > 0 else None
        await asyncio.sleep(0.02)


def error_reasons(records: Sequence[Record]) -> dict[str, int]:
    """Failed requests by reason: HTTP status and the body's error ``code`` (a node's 429
    ``overloaded`` is its bounded admission, ``core/admission.py``; vLLM's own refusals are
    400s naming the limit), or the exception."""
    import re

    out: dict[str, int] = {}
    for r in records:
        if r.error is None:
            continue
        code = re.search(r'"code"\s*:\s*"([^"]+)"', r.error)
        key = (f"HTTP {r.status} {code.group(1) if code else ''}".strip()
               if r.status not in (None, 200) else r.error.split(":")[0][:60])
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def _int(value: str | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f} %"


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{1000 * v:.0f} ms"


