"""The benchmark's HTTP client: send one workload request to one node, read what it says.

Uses the OpenAI-compatible API (``/v1/completions`` for prompts, ``/v1/chat/completions`` for
messages; greedy, non-streaming) and the radixmesh response headers. Works unchanged against
the sglang-router gateway (which returns the worker's response as is).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import httpx

from radixmesh.core.headers import (
    HEADER_CACHED,
    HEADER_EXPECTED,
    HEADER_PLACEMENT,
    HEADER_QUEUE,
    HEADER_REQUEST,
    HEADER_ROUTE,
    HEADER_SERVED_BY,
    HEADER_SERVICE,
)
from radixmesh.results.records import Record
from radixmesh.workload.request import Request


def request_body(req: Request, model: str) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "temperature": 0.0}
    if req.prompt is not None:
        return "/v1/completions", {**body, "prompt": req.prompt}
    assert req.messages is not None
    msgs = [{"role": m.role, "content": m.content} for m in req.messages]
    return "/v1/chat/completions", {**body, "messages": msgs}


def _int(value: str | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def parse_server_timing(value: str | None) -> dict[str, float]:
    """``Server-Timing: queue;dur=1.2, prefill;dur=30`` -> {"queue": 0.0012, ...} (seconds)."""
    out: dict[str, float] = {}
    for part in (value or "").split(","):
        name, _, params = part.strip().partition(";")
        for p in params.split(";"):
            key, _, num = p.strip().partition("=")
            if key == "dur" and name:
                with contextlib.suppress(ValueError):
                    out[name] = float(num) / 1000.0
    return out


def _output(payload: dict[str, Any]) -> tuple[str | None, str | None]:
    """(generated text, finish reason) of the first choice."""
    choices = payload.get("choices") or []
    if not choices:
        return None, None
    first = choices[0]
    reason = first.get("finish_reason")
    if "text" in first:
        return str(first["text"]), reason
    msg = first.get("message") or {}
    return (None if msg.get("content") is None else str(msg["content"])), reason


def _timing(headers: httpx.Headers) -> dict[str, float]:
    out = parse_server_timing(headers.get("server-timing"))
    for name, key in (("queue", HEADER_QUEUE), ("service", HEADER_SERVICE)):
        with contextlib.suppress(ValueError):
            out[name] = float(headers.get(key, ""))
    return out


def fill_from_response(rec: Record, resp: httpx.Response) -> None:
    rec.status = resp.status_code
    h = resp.headers
    rec.served_by = h.get(HEADER_SERVED_BY)
    rec.route = h.get(HEADER_ROUTE)
    rec.expected_cached_tokens = _int(h.get(HEADER_EXPECTED))
    rec.placement = h.get(HEADER_PLACEMENT)
    rec.request = _int(h.get(HEADER_REQUEST))
    rec.cached_tokens = _int(h.get(HEADER_CACHED))
    rec.server_timing = _timing(h)
    try:
        payload = resp.json()
    except ValueError:
        rec.error = f"HTTP {resp.status_code}: body is not JSON"
        return
    if resp.status_code >= 400 or "error" in payload:
        err = payload.get("error") if isinstance(payload, dict) else None
        msg = err.get("message") if isinstance(err, dict) else str(err or payload)[:200]
        rec.error = f"HTTP {resp.status_code}: {msg}"
        return
    usage = payload.get("usage") or {}
    rec.prompt_tokens = usage.get("prompt_tokens")
    rec.completion_tokens = usage.get("completion_tokens")
    if rec.cached_tokens is None:
        details = usage.get("prompt_tokens_details") or {}
        rec.cached_tokens = details.get("cached_tokens")
    rec.output, rec.finish_reason = _output(payload)


async def send(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    req: Request,
    rec: Record,
    t0: float,
    headers: dict[str, str] | None = None,
) -> Record:
    """POST ``req`` to ``base_url``; fills ``rec`` (timing relative to ``t0``) and returns it."""
    path, body = request_body(req, model)
    start = time.perf_counter()
    try:
        resp = await client.post(base_url.rstrip("/") + path, json=body, headers=headers)
        fill_from_response(rec, resp)
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    end = time.perf_counter()
    rec.latency_s = end - start
    rec.t_done = end - t0
    return rec


async def model_name(client: httpx.AsyncClient, base_url: str) -> str:
    resp = await client.get(base_url.rstrip("/") + "/v1/models")
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url} lists no models")
    return str(data[0]["id"])
