"""``EngineMetrics``: polls an external engine's ``/metrics`` and feeds its load to the shadow.

Theory of operation
-------------------
A node fronting an engine with ``--profile`` keeps a shadow of its scheduler
(``core/shadow.py``) fed by its own requests. The engine may run more (another router's, a
client calling it directly); every ``interval_s`` (``--engine-metrics-interval``, default
0.5 s) this task GETs ``<engine>/metrics`` (answer within ``timeout_s``), reads the running /
waiting gauges and KV usage (``core/engine_report.parse_metrics``: vLLM's names, SGLang's)
and hands the report to :meth:`Shadow.observe`, which reconciles it with the node's own
requests (``engine_report.reconcile``) and carries the rest as foreign load: the node's
predicted TTFT, and the batch it gossips, rise as the engine's would.

Nothing here can crash the node: an unreachable engine, a timeout, an HTTP error or a
payload that does not parse is counted (``engine_metrics_failures`` /
``engine_metrics_bad_payloads``) and ignored; after ``STALE_AFTER`` failed polls in a row the
shadow drops the foreign load it carries (stale load is worse than none), and the next good
report restores it. The loop is bounded by its interval; one poll at a time.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from radixmesh.core.engine_report import parse_metrics

log = logging.getLogger("radixmesh.engine_metrics")

TIMEOUT_S = 1.0
STALE_AFTER = 3  # failed polls in a row before the foreign load is dropped
MAX_BYTES = 4 << 20  # a /metrics body larger than this is a bad payload


class EngineMetrics:
    """Polls one engine's ``/metrics`` for a node with a shadow (an attachment)."""

    name = "engine_metrics"

    def __init__(self, service: Any, url: str, *, interval_s: float = 0.5,
                 timeout_s: float = TIMEOUT_S) -> None:
        if not 0 < interval_s <= 60:
            raise ValueError("interval_s must be in (0, 60]")
        if not 0 < timeout_s <= 60:
            raise ValueError("timeout_s must be in (0, 60]")
        self.service = service
        self.url = url.rstrip("/") + "/metrics"
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.counts = {"polls": 0, "reports": 0, "failures": 0, "bad_payloads": 0}
        self.last_error = ""
        self._failed_in_row = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="radixmesh-engine-metrics")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while True:
                try:
                    await self.poll(http)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # never let one poll end the loop (or the node)
                    self._failed("failures", f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(self.interval_s)

    async def poll(self, http: aiohttp.ClientSession) -> None:
        """One scrape: the report goes to the shadow, or the failure is counted."""
        self.counts["polls"] += 1
        try:
            async with http.get(self.url) as resp:
                if resp.status != 200:
                    self._failed("failures", f"/metrics answered {resp.status}")
                    return
                body = await resp.content.read(MAX_BYTES + 1)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self._failed("failures", f"/metrics: {type(exc).__name__}")
            return
        try:
            if len(body) > MAX_BYTES:
                raise ValueError(f"/metrics: over {MAX_BYTES} bytes")
            report = parse_metrics(body.decode("utf-8", errors="replace"))
        except ValueError as exc:
            self._failed("bad_payloads", str(exc))
            return
        shadow = self.service.shadow
        if shadow is not None:
            shadow.observe(report, self.service.clock())
            self.service.push_load()
        self.counts["reports"] += 1
        self._failed_in_row = 0

    def _failed(self, kind: str, why: str) -> None:
        self.counts[kind] += 1
        self._failed_in_row += 1
        if why != self.last_error:
            log.warning("engine metrics: %s", why)
        self.last_error = why
        shadow = self.service.shadow
        if self._failed_in_row == STALE_AFTER and shadow is not None:
            shadow.forget_foreign(self.service.clock())

    def mesh_state(self) -> dict[str, object]:
        shadow = self.service.shadow
        foreign = None if shadow is None else shadow.foreign
        return {"url": self.url, "interval_s": self.interval_s, "last_error": self.last_error,
                "foreign": None if foreign is None else
                {"running": foreign.running, "waiting": foreign.waiting,
                 "kv_tokens": foreign.kv_tokens}, **self.counts}

    def metrics(self) -> dict[str, float]:
        out = {f"engine_metrics_{k}": float(v) for k, v in self.counts.items()}
        shadow = self.service.shadow
        if shadow is not None:
            out["engine_foreign_running"] = float(shadow.foreign.running)
            out["engine_foreign_waiting"] = float(shadow.foreign.waiting)
        return out
