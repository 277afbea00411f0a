"""SIGTERM drain details in the running node: a request still running when the drain grace
ends gets 503 (retry elsewhere), not a 500; ``--drain-linger`` keeps the port open even when
nothing runs. In-process uvicorn on 127.0.0.1, the ``micro`` engine slowed to 50 ms a token."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from radixmesh.engine.testing import SlowTokens
from radixmesh.runtime.config import ServeConfig, config_from_mapping
from radixmesh.runtime.inprocess import free_port, serving
from radixmesh.runtime.node import NodeService

if TYPE_CHECKING:
    from conftest import Poll

TOKEN_S = 0.05


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_cut_at_the_drain_deadline_gets_503(
    engine: Any, stream: bool, poll: Poll
) -> None:
    async def scenario() -> None:
        port = free_port()
        service = NodeService(ServeConfig(node_id="solo", port=port, gossip_interval=5.0),
                              SlowTokens(engine, TOKEN_S))
        body = {"model": "micro", "prompt": "cut me " * 4, "max_tokens": 200, "stream": stream,
                "temperature": 0}
        async with serving(service, port) as address, aiohttp.ClientSession() as http:
            pending = asyncio.ensure_future(http.post(f"http://{address}/v1/completions",
                                                      json=body))
            await poll.until_async(lambda: service.queue_depth == 1, "service.queue_depth == 1")
            cut = await service.leave(grace_s=0.3)  # 200 tokens need 10 s: cut at 0.3 s
            assert cut == 1 and service.drain_cancelled == 1
            async with await pending as resp:
                if not stream:
                    assert resp.status == 503
                    assert resp.headers["retry-after"] == "1"
                    error = (await resp.json())["error"]
                else:  # the headers were sent: the error comes in-band, then [DONE]
                    assert resp.status == 200
                    text = await resp.text()
                    assert text.rstrip().endswith("data: [DONE]")
                    error = next(e for e in _events(text) if "error" in e)["error"]
            assert error["code"] == "node_shutting_down" and error["type"] == "server_error"
            assert service.metrics.client_errors[503] == 1
            assert service.metrics.client_errors[500] == 0

    asyncio.run(scenario())


def _events(text: str) -> list[dict[str, Any]]:
    import json

    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


class Ticking:
    """A node's clock that moves 10 ms at every reading (no wall clock in the assertion)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 0.01
        return self.now


def test_leave_lingers_when_nothing_runs(engine: Any) -> None:
    async def scenario() -> None:
        config = ServeConfig(node_id="idle", port=free_port())
        clock = Ticking()
        service = NodeService(config, SlowTokens(engine, TOKEN_S), clock=clock)
        await service.start()
        try:
            t0 = clock.now
            assert await service.leave(grace_s=5.0, linger_s=0.4) == 0
            assert 0.4 <= clock.now - t0 < 5.0  # the port stays open this long, on its clock
            assert service.health()["status"] == "leaving"
        finally:
            await service.stop()

    asyncio.run(scenario())


def test_drain_linger_setting() -> None:
    assert ServeConfig().drain_linger == 2.0
    assert config_from_mapping({"drain-linger": "500ms"}).drain_linger == 0.5
    with pytest.raises(ValueError):
        config_from_mapping({"drain_linger": "-1"})
