"""A profiled node polls its engine's /metrics (runtime/engine_metrics.py): load another
client puts on the engine directly reaches the node's shadow (its predicted TTFT rises),
and a bad or missing answer is counted and ignored."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from test_external_mesh import LIMIT_S
from test_external_mesh import node as mesh_node

from radixmesh.core.profile import resolve
from radixmesh.core.shadow import Shadow
from radixmesh.core.shadow_state import ttft_parts
from radixmesh.emulate.server import EmulatedEngine
from radixmesh.runtime.cluster import free_port
from radixmesh.runtime.engine_metrics import STALE_AFTER, EngineMetrics

if TYPE_CHECKING:
    from conftest import Poll

H100 = resolve("h100-llama3-8b")
DIRECT = 6  # requests the other client keeps running on the engine


def _predicted(service: Any) -> float:
    return sum(ttft_parts(service.shadow.state(service.clock()), 512, 0))


@contextlib.asynccontextmanager
async def _direct_load(http: aiohttp.ClientSession, engine: EmulatedEngine
                       ) -> AsyncIterator[None]:
    """``DIRECT`` long streamed completions sent to the engine itself (not via a node),
    each past its first token; cancelled (the client goes away) at the end."""
    body = {"model": engine.model, "prompt": "another client's prompt " * 8,
            "max_tokens": 4000, "stream": True}
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(DIRECT):
            resp = await stack.enter_async_context(
                http.post(f"{engine.url}/v1/completions", json=body))
            assert resp.status == 200
            await resp.content.readline()  # its first token: it runs
        yield


def test_a_client_loading_the_engine_directly_is_seen_only_by_a_polling_node(
        poll: Poll) -> None:
    async def scenario() -> None:
        engine = EmulatedEngine(H100, time_scale=1.0, kv_events="tcp://127.0.0.1:0",
                                kv_replay="tcp://127.0.0.1:0")
        await engine.start()
        p1, p2 = free_port(), free_port()
        try:
            async with (mesh_node(poll, engine, "polls", p1, p2, policy="cost",
                                  profile=H100.name, engine_metrics_interval=0.05) as n1,
                        mesh_node(poll, engine, "blind", p2, p1, policy="cost",
                                  profile=H100.name, engine_metrics_interval=0) as n2,
                        aiohttp.ClientSession() as http):
                metrics = next(a for a in n1.attachments if a.name == "engine_metrics")
                assert not any(a.name == "engine_metrics" for a in n2.attachments)
                await poll.until_async(lambda: metrics.counts["reports"] >= 1,
                                       "a first report", LIMIT_S)
                idle1, idle2 = _predicted(n1), _predicted(n2)
                assert n1.shadow.foreign.total == 0
                async with _direct_load(http, engine):
                    await poll.until_async(lambda: n1.shadow.foreign.running == DIRECT,
                                           "the direct client's load at the node", LIMIT_S)
                    assert _predicted(n1) > idle1 + DIRECT * H100.decode_seq_s
                    assert _predicted(n2) == idle2  # the blind node sees nothing
                    text = n1.prometheus()  # a level, exported as a gauge
                    assert f"radixmesh_engine_foreign_running {float(DIRECT)}" in text
                await poll.until_async(lambda: n1.shadow.foreign.total == 0,
                                       "the load gone", LIMIT_S)
                assert metrics.counts["bad_payloads"] == 0
        finally:
            await engine.stop()

    asyncio.run(scenario())


class _Service:
    """What EngineMetrics needs of a node: its shadow, clock and load push."""

    def __init__(self) -> None:
        self.shadow = Shadow(H100)
        self.now = 0.0
        self.pushed = 0

    def clock(self) -> float:
        return self.now

    def push_load(self) -> None:
        self.pushed += 1


GOOD = ("vllm:num_requests_running 0\nvllm:num_requests_waiting 5\n"
        "vllm:kv_cache_usage_perc 0.0\n")


def test_bad_payloads_and_failures_are_counted_and_ignored_and_stale_load_dropped() -> None:
    answers = [GOOD, "vllm:num_requests_running banana\n", "<html>oops</html>", 500]

    async def handler(_: web.Request) -> web.Response:
        answer = answers.pop(0) if answers else 503
        if isinstance(answer, int):
            return web.Response(status=answer)
        return web.Response(text=answer)

    async def scenario() -> None:
        app = web.Application()
        app.router.add_get("/metrics", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        svc = _Service()
        em = EngineMetrics(svc, f"http://127.0.0.1:{port}", interval_s=0.05, timeout_s=2.0)
        try:
            async with aiohttp.ClientSession() as http:
                await em.poll(http)
                assert svc.shadow.foreign.waiting == 5 and svc.pushed == 1
                for _ in range(STALE_AFTER - 1):
                    await em.poll(http)
                    assert svc.shadow.foreign.waiting == 5  # kept through a few bad polls
                await em.poll(http)  # the STALE_AFTER-th failure in a row
                assert svc.shadow.foreign.total == 0
                assert em.counts == {"polls": STALE_AFTER + 1, "reports": 1,
                                     "failures": 1, "bad_payloads": 2}
        finally:
            await runner.cleanup()
        async with aiohttp.ClientSession() as http:  # the engine gone: a failure, no raise
            await em.poll(http)
        assert em.counts["failures"] == 2
        assert em.mesh_state()["last_error"]

    asyncio.run(scenario())
