"""Client-side load for fault injection: send completions, record every outcome.

A client-visible failure is anything a user of the OpenAI API would notice: a transport error,
a timeout, a status other than 200, or a stream that breaks off (no ``[DONE]``). Each
:class:`ClientOutcome` keeps the response text (greedy decoding, so outputs can be compared with a
reference), which node served it and how it was routed (the ``x-radixmesh-*`` headers), and
for a streamed answer its time to first token.

One load generator: every request goes through the benchmark's client (bench/client.py
:func:`~radixmesh.bench.client.send`, which times TTFT and TPOT on the stream); this module
only turns its :class:`~radixmesh.results.records.Record` into an :class:`ClientOutcome`. Prompts
stream by default, as the bench's requests do; ``Prompt(stream=False)`` sends the API's plain
(non-streamed) request, which the faults also test.

Two drivers: :func:`closed_loop` (``concurrency`` workers, each sends when its previous request
finished) and :func:`open_loop` (arrivals on a fixed-rate schedule that does not wait for
responses: the load a real population of users puts on a cluster, so slow nodes queue up).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from radixmesh.bench.client import send
from radixmesh.results.records import Record
from radixmesh.results.run_summary import percentile
from radixmesh.workload.request import Request


@dataclass(frozen=True, slots=True)
class Prompt:
    id: str
    text: str
    max_tokens: int = 4
    stream: bool = True  # server-sent events, as the bench sends; False: one JSON response


@dataclass(frozen=True, slots=True)
class ClientOutcome:
    id: str
    entry: str  # base URL the client sent to
    status: int | None  # HTTP status; None when no response came back
    error: str | None  # transport error or error message of a non-200
    latency_s: float
    t_start: float  # seconds since the driver started
    text: str | None = None
    served_by: str | None = None
    route: str | None = None  # local | forwarded | fallback
    cached_tokens: int | None = None
    server_s: float | None = None  # the serving node's queue + service (x-radixmesh-*-s)
    ttft_s: float | None = None  # streamed: send -> the first token's text

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


def outcome_of(rec: Record, base_url: str, t_start: float) -> ClientOutcome:
    """What the bench's client recorded of one request, as the chaos checks read it."""
    timing = rec.server_timing
    server_s = timing["queue"] + timing["service"] if {"queue", "service"} <= set(timing) else None
    error = rec.error
    if error is None and rec.status != 200:
        error = f"HTTP {rec.status}"
    return ClientOutcome(rec.id, base_url, rec.status, error, rec.latency_s, t_start,
                   text=rec.output, served_by=rec.served_by, route=rec.route,
                   cached_tokens=rec.cached_tokens, server_s=server_s, ttft_s=rec.ttft_s)


async def send_one(
    client: httpx.AsyncClient,
    base_url: str,
    p: Prompt,
    model: str,
    t0: float,
    timeout_s: float = 60.0,
    headers: dict[str, str] | None = None,
) -> ClientOutcome:
    """Send one completion through the bench's client; never raises (failures are outcomes).
    ``t0``: the driver's start on ``time.monotonic()``."""
    rec = Record(run="chaos", policy="", seq=0, id=p.id, group=None, entry=0,
                 entry_node=base_url, t_send=0.0)
    req = Request(p.id, prompt=p.text, max_tokens=p.max_tokens)
    start = time.monotonic()
    await send(client, base_url, model, req, rec, time.perf_counter(), headers,
               stream=p.stream, timeout_s=timeout_s)
    return outcome_of(rec, base_url, start - t0)


async def closed_loop(
    entries: Callable[[int], str],
    prompts: Sequence[Prompt],
    model: str,
    concurrency: int = 2,
    timeout_s: float = 60.0,
    headers: dict[str, str] | None = None,
    on_done: Callable[[int, ClientOutcome], None] | None = None,
    pace_s: float = 0.0,
) -> list[ClientOutcome]:
    """Send every prompt once (prompt ``i`` to ``entries(i)``), ``concurrency`` at a time.

    ``pace_s``: each worker waits this long after a response before its next request.
    """
    t0 = time.monotonic()
    results: list[ClientOutcome | None] = [None] * len(prompts)
    next_index = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal next_index
        while next_index < len(prompts):
            i = next_index
            next_index += 1
            out = await send_one(client, entries(i), prompts[i], model, t0, timeout_s, headers)
            results[i] = out
            if on_done is not None:
                on_done(i, out)
            if pace_s > 0:
                await asyncio.sleep(pace_s)

    async with httpx.AsyncClient(trust_env=False) as client:
        await asyncio.gather(*(worker(client) for _ in range(max(1, concurrency))))
    return [r for r in results if r is not None]


async def open_loop(
    entries: Callable[[int], str],
    prompt_at: Callable[[int], Prompt],
    model: str,
    rate: float,
    duration_s: float | None,
    timeout_s: float = 60.0,
    on_tick: Callable[[float], None] | None = None,
    *,
    stop: asyncio.Event | None = None,
    t0: float | None = None,
) -> list[ClientOutcome]:
    """Arrivals every ``1/rate`` seconds for ``duration_s`` (None: until ``stop`` is set),
    from ``t0`` (``time.monotonic()``; default now); waits for every answer."""
    t0 = time.monotonic() if t0 is None else t0
    stop = stop or asyncio.Event()
    n = math.inf if duration_s is None else max(1, math.floor(rate * duration_s))
    tasks: list[asyncio.Task[ClientOutcome]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
        i = 0
        while i < n and not stop.is_set():
            delay = t0 + i / rate - time.monotonic()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await stop.wait()
                if stop.is_set():
                    break
            if on_tick is not None:
                on_tick(time.monotonic() - t0)
            coro = send_one(client, entries(i), prompt_at(i), model, t0, timeout_s)
            tasks.append(asyncio.create_task(coro))
            i += 1
        return list(await asyncio.gather(*tasks))


# ------------------------------------------------------------------------------ statistics


def summarize(outcomes: Sequence[ClientOutcome]) -> dict[str, object]:
    lat = [o.latency_s for o in outcomes if o.ok]
    ttft = [o.ttft_s for o in outcomes if o.ok and o.ttft_s is not None]
    routes: dict[str, int] = {}
    for o in outcomes:
        routes[o.route or "none"] = routes.get(o.route or "none", 0) + 1
    return {
        "requests": len(outcomes),
        "failures": sum(not o.ok for o in outcomes),
        "p50_s": percentile(lat, 50),
        "p99_s": percentile(lat, 99),
        "max_s": max(lat) if lat else None,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "routes": routes,
    }
