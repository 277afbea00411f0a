"""Client-side load for fault injection: send completions, record every outcome.

A client-visible failure is anything a user of the OpenAI API would notice: a transport error,
a timeout, or a status other than 200. Each :class:`Outcome` keeps the response text (greedy
decoding, so outputs can be compared with a reference), which node served it and how it was
routed (the ``x-radixmesh-*`` headers).

Two drivers: :func:`closed_loop` (``concurrency`` workers, each sends when its previous request
finished) and :func:`open_loop` (arrivals on a fixed-rate schedule that does not wait for
responses: the load a real population of users puts on a cluster, so slow nodes queue up).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from radixmesh.core.headers import HEADER_QUEUE, HEADER_ROUTE, HEADER_SERVED_BY, HEADER_SERVICE
from radixmesh.results.summary import percentile


@dataclass(frozen=True, slots=True)
class Prompt:
    id: str
    text: str
    max_tokens: int = 4
    stream: bool = False  # server-sent events; the answer is the concatenated text pieces


@dataclass(frozen=True, slots=True)
class Outcome:
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

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


def completion_body(p: Prompt, model: str) -> dict[str, object]:
    body: dict[str, object] = {"model": model, "prompt": p.text, "max_tokens": p.max_tokens,
                               "temperature": 0}
    if p.stream:
        body["stream"] = True
    return body


def _cached_tokens(body: dict[str, object]) -> int | None:
    usage = body.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return int(details["cached_tokens"])
    return None


def _text(body: dict[str, object]) -> str | None:
    choices = body.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        text = choices[0].get("text")
        return text if isinstance(text, str) else None
    return None


def _error_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
        err = body.get("error", body) if isinstance(body, dict) else body
        msg = err.get("message", err) if isinstance(err, dict) else err
        return f"HTTP {resp.status_code}: {str(msg)[:200]}"
    except ValueError:
        return f"HTTP {resp.status_code}: {resp.text[:200]}"


async def send_one(
    client: httpx.AsyncClient,
    base_url: str,
    p: Prompt,
    model: str,
    t0: float,
    timeout_s: float = 60.0,
    headers: dict[str, str] | None = None,
) -> Outcome:
    """POST one completion; never raises (failures become outcomes)."""
    if p.stream:
        return await _send_stream(client, base_url, p, model, t0, timeout_s, headers)
    start = time.monotonic()
    try:
        resp = await client.post(
            f"{base_url}/v1/completions", json=completion_body(p, model), timeout=timeout_s,
            headers=headers,
        )
    except (httpx.HTTPError, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:200]
        return Outcome(p.id, base_url, None, error, time.monotonic() - start, start - t0)
    return _from_response(p.id, base_url, resp, time.monotonic() - start, start - t0)


async def _send_stream(
    client: httpx.AsyncClient, base_url: str, p: Prompt, model: str, t0: float,
    timeout_s: float, headers: dict[str, str] | None,
) -> Outcome:
    """A streamed completion: OK only if it ends with ``[DONE]`` and carried no error event."""
    start = time.monotonic()
    pieces: list[str] = []
    error: str | None = None
    status: int | None = None
    done = False
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", timeout=timeout_s,
                                 json=completion_body(p, model), headers=headers) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return _from_response(p.id, base_url, resp, time.monotonic() - start,
                                      start - t0)
            status = 200
            served_by = resp.headers.get(HEADER_SERVED_BY)
            route = resp.headers.get(HEADER_ROUTE)
            error, done = await _read_events(resp, pieces)
    except (httpx.HTTPError, OSError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:200]
        served_by = route = None
    if error is None and not done:
        error = "stream ended without [DONE]"
    return Outcome(p.id, base_url, status, error,
                   time.monotonic() - start, start - t0, text="".join(pieces),
                   served_by=served_by, route=route)


async def _read_events(resp: httpx.Response, pieces: list[str]) -> tuple[str | None, bool]:
    """Read SSE events into ``pieces`` (kept if the stream breaks); (error event, [DONE] seen)."""
    error: str | None = None
    done = False
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            done = True
            continue
        event = json.loads(data)
        if "error" in event:
            error = f"stream error: {str(event['error'])[:200]}"
            continue
        for choice in event.get("choices", []):
            pieces.append(choice.get("text", ""))
    return error, done


def _from_response(
    id_: str, base_url: str, resp: httpx.Response, latency_s: float, t_start: float
) -> Outcome:
    served_by = resp.headers.get(HEADER_SERVED_BY)
    route = resp.headers.get(HEADER_ROUTE)
    if resp.status_code != 200:
        error: str | None = _error_message(resp)
        body: dict[str, object] = {}
    else:
        try:
            parsed = resp.json()
            body = parsed if isinstance(parsed, dict) else {}
            error = None if body else "response is not a JSON object"
        except ValueError:
            body, error = {}, "response is not JSON"
    return Outcome(
        id_, base_url, resp.status_code, error, latency_s, t_start,
        text=_text(body), served_by=served_by, route=route, cached_tokens=_cached_tokens(body),
        server_s=_server_s(resp),
    )


def _server_s(resp: httpx.Response) -> float | None:
    """Queue + service seconds on the node that served the request (its response headers)."""
    try:
        return float(resp.headers[HEADER_QUEUE]) + float(
            resp.headers[HEADER_SERVICE])
    except (KeyError, ValueError):
        return None


async def closed_loop(
    entries: Callable[[int], str],
    prompts: Sequence[Prompt],
    model: str,
    concurrency: int = 2,
    timeout_s: float = 60.0,
    headers: dict[str, str] | None = None,
    on_done: Callable[[int, Outcome], None] | None = None,
    pace_s: float = 0.0,
) -> list[Outcome]:
    """Send every prompt once (prompt ``i`` to ``entries(i)``), ``concurrency`` at a time.

    ``pace_s``: each worker waits this long after a response before its next request.
    """
    t0 = time.monotonic()
    results: list[Outcome | None] = [None] * len(prompts)
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
    duration_s: float,
    timeout_s: float = 60.0,
    on_tick: Callable[[float], None] | None = None,
) -> list[Outcome]:
    """Arrivals every ``1/rate`` seconds for ``duration_s``; waits for all to finish."""
    t0 = time.monotonic()
    tasks: list[asyncio.Task[Outcome]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
        n = max(1, math.floor(rate * duration_s))
        for i in range(n):
            delay = t0 + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if on_tick is not None:
                on_tick(time.monotonic() - t0)
            coro = send_one(client, entries(i), prompt_at(i), model, t0, timeout_s)
            tasks.append(asyncio.create_task(coro))
        return list(await asyncio.gather(*tasks))


# ------------------------------------------------------------------------------ statistics


def summarize(outcomes: Sequence[Outcome]) -> dict[str, object]:
    lat = [o.latency_s for o in outcomes if o.ok]
    routes: dict[str, int] = {}
    for o in outcomes:
        routes[o.route or "none"] = routes.get(o.route or "none", 0) + 1
    return {
        "requests": len(outcomes),
        "failures": sum(not o.ok for o in outcomes),
        "p50_s": percentile(lat, 50),
        "p99_s": percentile(lat, 99),
        "max_s": max(lat) if lat else None,
        "routes": routes,
    }
