"""The benchmark's HTTP client: send one workload request to one node, read what it says.

Uses the OpenAI-compatible API (``/v1/completions`` for prompts, ``/v1/chat/completions`` for
messages; greedy) and the radixmesh response headers. Works unchanged against the gateways
(sglang-router and SMG return the worker's response as is) and against any OpenAI-compatible
engine.

Requests are streamed (``stream: true`` with ``stream_options.include_usage``) so the client
times what serving systems are judged on, as vLLM's and guidellm's benchmarks do:

``ttft_s``  time to first token: send → the first chunk that carries generated text
            (a chat stream's opening role-only chunk does not count);
``tpot_s``  time per output token after the first: (last token − first token) ÷
            (completion tokens − 1); None with fewer than 2 tokens;
``latency_s`` send → the stream's end.

Usage (prompt, completion and cached tokens) comes from the stream's usage chunk; a radixmesh
node adds its ``queue`` / ``service`` timings as an SSE comment (``: server-timing ...``, which
SSE clients ignore) since a stream's headers leave before they are known. A stream that ends
without ``data: [DONE]`` (a server or a forward that died mid-answer) is an error.

The one load generator's client: the benchmark's replays and ``radixmesh chaos``
(chaos/load.py) both send through :func:`send`; ``stream=False`` sends one plain request (the
API's non-streamed path, which chaos also tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
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
    STREAM_TIMING_COMMENT,
)
from radixmesh.results.records import Record
from radixmesh.workload.request import Request


def request_body(
    req: Request, model: str, stream: bool = False
) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "temperature": 0.0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
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


def _fill_headers(rec: Record, h: httpx.Headers) -> None:
    rec.served_by = h.get(HEADER_SERVED_BY)
    rec.route = h.get(HEADER_ROUTE)
    rec.expected_cached_tokens = _int(h.get(HEADER_EXPECTED))
    rec.placement = h.get(HEADER_PLACEMENT)
    rec.request = _int(h.get(HEADER_REQUEST))
    rec.cached_tokens = _int(h.get(HEADER_CACHED))
    rec.server_timing = _timing(h)


def fill_from_response(rec: Record, resp: httpx.Response) -> None:
    """A whole (non-streamed) response: an error, or a JSON completion."""
    rec.status = resp.status_code
    _fill_headers(rec, resp.headers)
    try:
        payload = resp.json()
    except ValueError:
        rec.error = f"HTTP {resp.status_code}: body is not JSON"
        return
    if not isinstance(payload, dict):
        rec.error = f"HTTP {resp.status_code}: body is not a JSON object"
        return
    if resp.status_code >= 400 or "error" in payload:
        err = payload.get("error") if isinstance(payload, dict) else None
        rec.error = f"HTTP {resp.status_code}: {_error_message(err or payload)[:200]}"
        return
    usage = payload.get("usage") or {}
    rec.prompt_tokens = usage.get("prompt_tokens")
    rec.completion_tokens = usage.get("completion_tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None:  # the engine's own figure beats the header's (as in a stream)
        rec.cached_tokens = cached
    rec.output, rec.finish_reason = _output(payload)


async def send(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    req: Request,
    rec: Record,
    t0: float,
    headers: dict[str, str] | None = None,
    *,
    stream: bool = True,
    timeout_s: float | None = None,
    link: tuple[float, float] | None = None,
) -> Record:
    """POST ``req`` to ``base_url`` (a stream unless ``stream`` is False); fills ``rec``
    (timing relative to ``t0``, TTFT and TPOT measured here) and returns it. Never raises:
    a transport error or a timeout (``timeout_s``, else the client's) is ``rec.error``.
    ``link`` = (out, back): the client stands that far from the server (bench --regions):
    the request leaves ``out`` seconds late, and the answer reaches the client ``back``
    seconds after it was read (TTFT and latency include both; TPOT is unchanged)."""
    path, body = request_body(req, model, stream=stream)
    url = base_url.rstrip("/") + path
    timeout: Any = httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s
    out, back = link or (0.0, 0.0)
    start = time.perf_counter()
    if out > 0:
        await asyncio.sleep(out)
    await _exchange(client, url, body, headers, timeout, stream, rec, start)
    if back > 0:  # the answer's way back; its first token was that much later too
        await asyncio.sleep(back)
        rec.ttft_s = None if rec.ttft_s is None else rec.ttft_s + back
    end = time.perf_counter()
    rec.latency_s = end - start
    rec.t_done = end - t0
    return rec


async def _exchange(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                    headers: dict[str, str] | None, timeout: Any, stream: bool, rec: Record,
                    start: float) -> None:
    """The request and its (streamed) answer, into ``rec``; never raises."""
    try:
        if not stream:
            fill_from_response(rec, await client.post(url, json=body, headers=headers,
                                                      timeout=timeout))
        else:
            async with client.stream("POST", url, json=body, headers=headers,
                                     timeout=timeout) as resp:
                if resp.status_code >= 400 or not _is_stream(resp):
                    await resp.aread()
                    fill_from_response(rec, resp)
                else:
                    _fill_headers(rec, resp.headers)
                    rec.status = resp.status_code
                    await _read_stream(rec, resp, start)
    except (httpx.HTTPError, OSError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]


def _error_message(err: object) -> str:
    """The message of an OpenAI-style error object (its text when it is not one)."""
    return str(err.get("message")) if isinstance(err, dict) else str(err)


def _is_stream(resp: httpx.Response) -> bool:
    return resp.headers.get("content-type", "").startswith("text/event-stream")


class _StreamState:
    """What one response stream said so far (text pieces, finish reason, token times)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.finish: str | None = None
        self.first: float | None = None
        self.last: float | None = None
        self.usage: dict[str, Any] = {}
        self.error: str | None = None
        self.done = False  # data: [DONE] arrived

    def chunk(self, payload: dict[str, Any], now: float) -> None:
        if "error" in payload:
            self.error = f"stream error: {_error_message(payload['error'])}"[:300]
            return
        if payload.get("usage"):
            self.usage = payload["usage"]
        for choice in payload.get("choices") or []:
            piece = choice.get("text")
            if piece is None:
                piece = (choice.get("delta") or {}).get("content")
            if piece:  # a token's text (a chat's role-only opening chunk carries none)
                self.text.append(str(piece))
                self.first = now if self.first is None else self.first
                self.last = now
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]


async def _read_stream(rec: Record, resp: httpx.Response, start: float) -> None:
    state = _StreamState()
    async for line in resp.aiter_lines():
        if line.startswith(STREAM_TIMING_COMMENT):
            rec.server_timing |= parse_server_timing(line[len(STREAM_TIMING_COMMENT):])
            continue
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            state.done = True
            break
        try:
            payload = json.loads(data)
        except ValueError:
            state.error = "stream chunk is not JSON"
            continue
        if isinstance(payload, dict):
            state.chunk(payload, time.perf_counter())
    _fill_stream(rec, state, start)


def _fill_stream(rec: Record, state: _StreamState, start: float) -> None:
    if state.error is None and not state.done:
        state.error = "stream ended without [DONE]"
    if state.error is not None:
        rec.error = state.error
        return
    usage = state.usage
    rec.prompt_tokens = usage.get("prompt_tokens")
    rec.completion_tokens = usage.get("completion_tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None:  # the engine's own figure beats the header's estimate
        rec.cached_tokens = cached
    rec.output, rec.finish_reason = "".join(state.text), state.finish
    if state.first is not None:
        rec.ttft_s = state.first - start
        n = rec.completion_tokens or len(state.text)
        if n >= 2 and state.last is not None:
            rec.tpot_s = (state.last - state.first) / (n - 1)


async def model_name(client: httpx.AsyncClient, base_url: str) -> str:
    resp = await client.get(base_url.rstrip("/") + "/v1/models")
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url} lists no models")
    return str(data[0]["id"])


async def wait_for_model(client: httpx.AsyncClient, base_url: str, model: str,
                         timeout_s: float, poll_s: float = 0.5) -> None:
    """Until ``base_url`` (a gateway) lists ``model`` in ``/v1/models``: a gateway can count
    its workers healthy before it knows what they serve (SMG 1.13 with 64 workers on a busy
    machine: its metadata step timed out, and every request got 404 "No worker available for
    model"). A gateway without the route (404) has nothing to wait for. RuntimeError after
    ``timeout_s``, saying so."""
    url = base_url.rstrip("/") + "/v1/models"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            resp = await client.get(url)
            if resp.status_code == 404:
                return
            if resp.status_code == 200 and model in _model_ids(resp.json()):
                return
        except (httpx.HTTPError, ValueError):  # not up yet, or not JSON
            pass
        if time.monotonic() >= deadline:
            raise RuntimeError(f"{base_url} does not list model {model!r} after {timeout_s:g} s "
                               "(its workers registered without it?)")
        await asyncio.sleep(poll_s)


def _model_ids(body: Any) -> list[str]:
    """The model ids a ``/v1/models`` body lists (none, if it is not that shape)."""
    data = body.get("data") if isinstance(body, dict) else None
    return [str(m["id"]) for m in data or [] if isinstance(m, dict) and "id" in m]
