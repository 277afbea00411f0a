"""``EngineHealth``: notices an external engine going down and coming back, and tells the node.

Theory of operation
-------------------
Three ways to learn the engine is gone, whichever comes first::

    --launch child exited          polled every CHILD_POLL_S (waitpid, no I/O): at once
    GET <engine>/health            every probe_interval_s (≤ 1 s), answer within
                                   probe_timeout_s: a killed engine refuses the connection, a
                                   stopped one (SIGSTOP) times out
    a request found it unreachable NodeService.engine_failed (EngineUnavailable) at once

A fourth verdict is a refusal: an engine whose KV events carry another block size than the
node was configured with (``--engine-block-size``; restarted with another ``--block-size``)
sets the index's ``config_error``; the node then counts the engine down with that error as
the reason (``/mesh`` ``engine_health.reason``, the log) until the engine goes away (a failed
probe clears the error: a restarted engine is judged afresh).

``down`` → :meth:`NodeService.engine_state` (``up=False``): when the engine is gone (exited,
connection refused, refused for its block size) the node drops its cache index so its gossip
stops advertising it; when it only does not answer in time (stopped, or starved on a loaded
machine: vLLM's ``/health`` once took over 1 s here) the index stays, since the cache is
still there and a restart would reset the index anyway (the subscriber's tracker reads the
new seq stream as a restart). Either way the core takes no new work here
(``EngineStateChanged``: own clients' requests go to peers, forwards refused, push-back).
``up`` needs ``UP_AFTER`` consecutive good probes (a SIGCONT'd engine answers at once, but a
restarting one may answer ``/health`` before it serves); then the node takes work again with
the index it kept, or one refilled from a restarted engine's events (its seq starts at 0
again: the subscriber's tracker reads a restart and starts over). With ``--launch`` the node
does not restart a dead child; an engine restarted at the same URL is taken back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp

log = logging.getLogger("radixmesh.engine_health")

PROBE_INTERVAL_S = 0.5
PROBE_TIMEOUT_S = 1.0
CHILD_POLL_S = 0.1
UP_AFTER = 2


class EngineHealth:
    """Watches one engine for a node (an attachment: ``start`` / ``stop`` with it)."""

    name = "engine_health"

    def __init__(self, service: Any, url: str, *, launched: Any = None,
                 probe_interval_s: float = PROBE_INTERVAL_S,
                 probe_timeout_s: float = PROBE_TIMEOUT_S) -> None:
        if not 0 < probe_interval_s <= 1.0:
            raise ValueError("probe_interval_s must be in (0, 1]")
        self.service = service
        self.url = url.rstrip("/") + "/health"
        self.launched = launched
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.up = True
        self.since = time.time()
        self.reason = ""
        self.counts = {"probes": 0, "probe_failures": 0, "downs": 0, "ups": 0}
        self._good = 0
        self._child_exit_seen = False
        self._forgotten = False  # down and its index dropped
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="radixmesh-engine-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def mark(self, up: bool, reason: str, gone: bool = True) -> None:
        """Record a verdict (from a probe, the child, or a failed request); ``gone``: the
        engine's cache is gone with it (exited, refused the connection), not just slow. An
        engine already down that turns out gone (a request failed first, then the probe's
        connection was refused) has its index dropped then."""
        if up == self.up:
            if not up and gone and not self._forgotten:
                self._forgotten = True
                self.service.engine_state(False, reason, forget=True)
            return
        self.up, self.reason, self.since = up, reason, time.time()
        self._forgotten = gone and not up
        self.counts["ups" if up else "downs"] += 1
        log.warning("engine %s: %s", "back" if up else "down", reason)
        self.service.engine_state(up, reason, forget=gone and not up)

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.probe_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            next_probe = 0.0
            while True:
                self._check_child()
                now = time.monotonic()
                if now >= next_probe:
                    next_probe = now + self.probe_interval_s
                    await self._probe(http)
                await asyncio.sleep(CHILD_POLL_S if self.launched is not None
                                    else max(next_probe - time.monotonic(), 0.0))

    async def _probe(self, http: aiohttp.ClientSession) -> None:
        self.counts["probes"] += 1
        ok, why = False, ""
        gone = False
        try:
            async with http.get(self.url) as resp:
                ok, why = resp.status == 200, f"/health answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            why = f"/health: {type(exc).__name__}"
            gone = isinstance(exc, aiohttp.ClientConnectionError | OSError) and not isinstance(
                exc, TimeoutError | aiohttp.ServerTimeoutError)
        index = getattr(self.service.engine, "index", None)
        refused = getattr(index, "config_error", None)
        if ok and refused:
            self._good = 0
            self.mark(False, f"refused: {refused}")
            return
        if ok:
            self._good += 1
            if self._good >= UP_AFTER:
                self.mark(True, "/health answers again")
            return
        self.counts["probe_failures"] += 1
        self._good = 0
        if refused:  # the refused engine is gone: the next one is judged afresh
            index.config_error = None
        self.mark(False, why, gone)

    def _check_child(self) -> None:
        """The launched child's exit is a verdict once (an engine restarted at the same URL
        by someone else is then judged by its probes)."""
        proc = None if self.launched is None else self.launched.proc
        if proc is None or self._child_exit_seen or (rc := proc.poll()) is None:
            return
        self._child_exit_seen = True
        self._good = 0
        self.mark(False, f"launched engine exited with {rc}")

    def mesh_state(self) -> dict[str, object]:
        return {"up": self.up, "since": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                      time.gmtime(self.since)),
                "reason": self.reason, "url": self.url, **self.counts}

    def metrics(self) -> dict[str, float]:
        return {"engine_up": float(self.up),
                **{f"engine_health_{k}": float(v) for k, v in self.counts.items()}}

