"""An engine that dies, stalls or comes back behind a node (runtime/engine_health.py), on two
fake vLLM engines in this process: the node stops advertising its cache and taking work, its
clients' requests go to the peer (also one already accepted whose engine died before its first
token), and a restarted engine is taken back with a fresh index."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import aiohttp
from test_external_mesh import LIMIT_S, PREFIX, complete, mesh_of_two, node, subscribed

from radixmesh.emulate.fake import FakeEngine
from radixmesh.runtime.cluster import free_port
from radixmesh.runtime.node import NodeService

if TYPE_CHECKING:
    from conftest import Poll


def health(service: NodeService) -> dict[str, object]:
    return service.mesh()["engine_health"]  # type: ignore[return-value]


def same_ports(fake: FakeEngine) -> FakeEngine:
    """A new engine where ``fake`` was (a restart: empty cache, seq from 0)."""
    port = int(fake.url.rsplit(":", 1)[1])
    kv = int(fake.kv_endpoint.rsplit(":", 1)[1])
    replay = int(fake.replay_endpoint.rsplit(":", 1)[1])
    return FakeEngine(cache_tokens=4096, port=port, kv_port=kv, replay_port=replay)


def test_a_dead_engine_sends_work_to_the_peer_and_a_restarted_one_is_taken_back(
        poll: Poll) -> None:
    async def scenario(http: aiohttp.ClientSession, n1: NodeService, n2: NodeService,
                       p1: int, p2: int, engines: list[FakeEngine]) -> None:
        await subscribed(poll, n2, engines[1])
        status, headers, _ = await complete(http, p2, PREFIX + "warm node 2")
        assert status == 200 and headers["x-radixmesh-served-by"] == "node-2"
        await poll.until_async(lambda: len(n2.engine.cache_hashes()) > 0, "node 2's index",
                               LIMIT_S)
        await engines[1].stop()  # kill -9 of engine 2
        await poll.until_async(lambda: health(n2)["up"] is False, "node 2 to see it", LIMIT_S)
        assert len(n2.engine.cache_hashes()) == 0  # its cache is no longer advertised
        assert n2.mesh()["engine_down"] is True
        for i in range(3):  # node 2's own clients: served by node 1, none failed
            status, headers, body = await complete(http, p2, f"{PREFIX} after the death {i}")
            assert status == 200, body
            assert headers["x-radixmesh-served-by"] == "node-1"
        engines[1] = same_ports(engines[1])  # restarted where it was
        await engines[1].start()
        await poll.until_async(lambda: health(n2)["up"] is True, "node 2 to take it back",
                               LIMIT_S)
        assert n2.mesh()["engine_down"] is False
        status, headers, body = await complete(http, p2, "node 2 again, a fresh prompt")
        assert status == 200, body
        assert headers["x-radixmesh-served-by"] == "node-2"

    asyncio.run(mesh_of_two(poll, scenario))


def test_a_request_whose_engine_dies_before_its_first_token_goes_on_at_the_peer(
        poll: Poll) -> None:
    async def scenario(http: aiohttp.ClientSession, n1: NodeService, n2: NodeService,
                       p1: int, p2: int, engines: list[FakeEngine]) -> None:
        engines[1].faults.barrier = 2  # engine 2 holds the one request it gets (<= 5 s)
        pending = asyncio.create_task(complete(http, p2, "held on node 2, then its engine dies"))
        await poll.until_async(lambda: engines[1].active == 1, "the request on engine 2",
                               LIMIT_S)
        await engines[1].stop()
        status, headers, body = await pending
        assert status == 200, body
        assert headers["x-radixmesh-served-by"] == "node-1"
        assert n2.metrics.engine_retries == 1

    asyncio.run(mesh_of_two(poll, scenario))


def test_a_stalled_engine_keeps_its_index_and_is_left_alone_until_it_answers(
        poll: Poll) -> None:
    async def scenario(http: aiohttp.ClientSession, n1: NodeService, n2: NodeService,
                       p1: int, p2: int, engines: list[FakeEngine]) -> None:
        await subscribed(poll, n2, engines[1])
        await complete(http, p2, PREFIX + "warm node 2 before the stall")
        await poll.until_async(lambda: len(n2.engine.cache_hashes()) > 0, "node 2's index",
                               LIMIT_S)
        held = len(n2.engine.cache_hashes())
        engines[1].faults.stalled = True  # SIGSTOP
        await poll.until_async(lambda: health(n2)["up"] is False, "the probe to time out",
                               LIMIT_S)
        assert len(n2.engine.cache_hashes()) >= held > 0  # stalled, not gone: the index stays
        status, headers, body = await complete(http, p2, "sent while engine 2 is stopped")
        assert status == 200, body
        assert headers["x-radixmesh-served-by"] == "node-1"
        engines[1].faults.stalled = False  # SIGCONT
        await poll.until_async(lambda: health(n2)["up"] is True, "node 2 to take it back",
                               LIMIT_S)

    asyncio.run(mesh_of_two(poll, scenario))


def test_an_engine_with_another_block_size_is_refused_with_the_reason(poll: Poll) -> None:
    """Told 32-token engine blocks, the node gets 16: the engine counts as down, the error as
    the reason, until it goes away."""
    async def scenario() -> None:
        fake = FakeEngine(cache_tokens=4096, block_size=16)
        await fake.start()
        port = free_port()
        try:
            async with node(poll, fake, "solo", port, None, engine_block_size=32) as service:
                await subscribed(poll, service, fake)
                async with aiohttp.ClientSession() as http:
                    await complete(http, port, PREFIX + "sixteen-token blocks")
                await poll.until_async(lambda: health(service)["up"] is False, "the refusal",
                                       LIMIT_S)
                assert "16 tokens, configured 32" in str(health(service)["reason"])
        finally:
            await fake.stop()

    asyncio.run(scenario())


class _Service:
    """What EngineHealth tells its node: each (up, forget) verdict."""

    def __init__(self) -> None:
        self.calls: list[tuple[bool, bool]] = []
        self.engine = None

    def engine_state(self, up: bool, reason: str, forget: bool = False) -> None:
        self.calls.append((up, forget))


def test_a_failed_request_marks_the_engine_down_and_only_a_gone_engine_loses_its_index() -> None:
    """A request's dropped connection is no proof the cache went (under load connections are
    reset): down, index kept; the probe that then finds the connection refused drops it, once;
    back up and down again, the next gone verdict drops it again."""
    from radixmesh.runtime.engine_health import EngineHealth

    svc = _Service()
    health = EngineHealth(svc, "http://127.0.0.1:1")
    health.mark(False, "ServerDisconnectedError", gone=False)  # NodeService.engine_failed
    assert svc.calls == [(False, False)]
    health.mark(False, "/health: ClientConnectorError", gone=False)  # slow: nothing new
    assert svc.calls == [(False, False)]
    health.mark(False, "/health: ClientConnectorError", gone=True)
    health.mark(False, "/health: ClientConnectorError", gone=True)
    assert svc.calls == [(False, False), (False, True)]
    health.mark(True, "/health answers again")
    health.mark(False, "launched engine exited with -9")
    assert svc.calls[2:] == [(True, False), (False, True)]
