"""Fault-injection knobs of a running node, for the chaos suite (loopback clients only).

``POST /admin/netem``         ``{"loss": 0.3, "duplicate": 0.2, "delay": 0.0, "jitter": 0.2}``:
                              change the emulated peer network at run time (fields optional)
``POST /admin/engine-delay``  ``{"seconds": 0.5}``: every request sleeps this long on the engine
                              worker before it runs, like a slow or overloaded accelerator
``GET  /admin/debug``         current values of both

The engine delay is an engine proxy (:class:`DelayedEngine`) wrapped around the real engine at
start-up (``--debug-engine-delay`` sets its initial value), under the node's ``ThreadedEngine``
(the built-in engine: its ``BatchedEngine``, which sleeps before each request joins).
The sleep happens on the engine's single worker thread, so it holds the FIFO queue exactly as a
slow device would: queue depth grows, the node's measured service time grows, and push-back is
advertised through gossip.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from radixmesh.engine.base import GenerateRequest, GenerateResult
from radixmesh.engine.worker import ThreadedEngine
from radixmesh.runtime.netem import NetemConfig

LOOPBACK = ("127.0.0.1", "::1", "localhost")
MAX_DELAY_S = 60.0


class DelayedEngine:
    """An engine proxy whose ``generate`` first sleeps ``delay_s`` (0 = no effect)."""

    def __init__(self, engine: Any, delay_s: float = 0.0) -> None:
        self._engine = engine
        self.delay_s = delay_s

    def generate(self, req: GenerateRequest, on_token: Callable[[int], None] | None = None
                 ) -> GenerateResult:
        if self.delay_s > 0:
            time.sleep(self.delay_s)
        result: GenerateResult = self._engine.generate(req, on_token)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def as_async(self) -> Any:
        """What the node runs (``engine.worker.as_async_engine``): over the built-in engine
        its batching loop, sleeping ``delay_s`` on the engine thread before each request joins
        (every step waits, as on a stalled device); over any other engine a ThreadedEngine."""
        from radixmesh.engine.builtin import TransformersEngine

        if isinstance(self._engine, TransformersEngine):
            from radixmesh.engine.batched import BatchedEngine

            batched = BatchedEngine.for_engine(self._engine)
            batched.before_request, batched.proxy = self._sleep, self
            return batched
        return ThreadedEngine(self)

    def _sleep(self) -> None:
        if self.delay_s > 0:
            time.sleep(self.delay_s)


def delayed_engine(service: Any) -> DelayedEngine | None:
    """The node's :class:`DelayedEngine` (under its ThreadedEngine or BatchedEngine), or None
    without one."""
    engine = service.engine
    inner = engine.engine if isinstance(engine, ThreadedEngine) else engine
    inner = getattr(inner, "proxy", inner)
    return inner if isinstance(inner, DelayedEngine) else None


def _error(message: str, status: int = 400) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                      "code": None}}
    return JSONResponse(body, status_code=status)


def _number(body: dict[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ValueError(f"'{key}' must be a number in [{low}, {high}]")
    return float(value)


def _state(service: Any) -> dict[str, object]:
    cfg: NetemConfig = service.netem.config
    engine = delayed_engine(service)
    return {
        "netem": {"loss": cfg.loss, "duplicate": getattr(cfg, "duplicate", 0.0),
                  "delay": cfg.delay_s, "jitter": cfg.jitter_s},
        "engine_delay_s": None if engine is None else engine.delay_s,
    }


async def _json_object(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > 4096:
        raise ValueError("body too large")
    try:
        body = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise ValueError("body must be a JSON object") from None
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    return body


def _netem_update(service: Any, body: dict[str, Any]) -> None:
    cfg: NetemConfig = service.netem.config
    loss = _number(body, "loss", 0.0, 1.0)
    dup = _number(body, "duplicate", 0.0, 1.0)
    delay = _number(body, "delay", 0.0, MAX_DELAY_S)
    jitter = _number(body, "jitter", 0.0, MAX_DELAY_S)
    service.netem.config = NetemConfig(
        delay_s=cfg.delay_s if delay is None else delay,
        jitter_s=cfg.jitter_s if jitter is None else jitter,
        loss=cfg.loss if loss is None else loss,
        duplicate=getattr(cfg, "duplicate", 0.0) if dup is None else dup,
    )


def install_debug_routes(app: FastAPI, service: Any) -> None:
    """Add the fault-injection endpoints above to ``app``."""

    def refused(request: Request) -> Response | None:
        host = request.client.host if request.client else ""
        if host not in LOOPBACK:
            return _error("admin endpoints accept loopback clients only", 403)
        return None

    @app.get("/admin/debug", include_in_schema=False)
    async def get_debug(request: Request) -> Response:
        return refused(request) or JSONResponse(_state(service))

    @app.post("/admin/netem", include_in_schema=False)
    async def set_netem(request: Request) -> Response:
        if (denied := refused(request)) is not None:
            return denied
        try:
            _netem_update(service, await _json_object(request))
        except ValueError as exc:
            return _error(str(exc))
        return JSONResponse(_state(service))

    @app.post("/admin/engine-delay", include_in_schema=False)
    async def set_engine_delay(request: Request) -> Response:
        if (denied := refused(request)) is not None:
            return denied
        engine = delayed_engine(service)
        if engine is None:
            return _error("this node was built without the engine-delay knob", 409)
        try:
            seconds = _number(await _json_object(request), "seconds", 0.0, MAX_DELAY_S)
        except ValueError as exc:
            return _error(str(exc))
        engine.delay_s = seconds or 0.0
        return JSONResponse(_state(service))
