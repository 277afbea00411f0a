"""A streamed answer's ``x-radixmesh-cached-tokens`` (the serving node's match at acceptance)
is read in the request's cache namespace: a prefix cached for no namespace, or for another
salt, counts 0 (it was read in the shared namespace, which showed a tenant the shared cache
and over-predicted on real vLLM: ``make vllm-tenants``). The same through SGLang's dialect: the
node sends the namespace as SGLang's ``cache_salt`` and reads it back from its events."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from radixmesh.emulate.fake import FakeEngine
from radixmesh.engine.tokenizers import ByteTokenizer
from radixmesh.runtime.cluster import free_port
from radixmesh.runtime.config import ServeConfig
from radixmesh.runtime.inprocess import serving
from radixmesh.runtime.serve_cli import build_external_service

if TYPE_CHECKING:
    from conftest import Poll

LIMIT_S = 10.0
PROMPT = "A shared system prompt, long enough for several blocks of sixteen bytes. " * 3


async def stream(http: aiohttp.ClientSession, port: int, **fields: Any) -> int:
    body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 2, "stream": True, **fields}
    async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return int(resp.headers["x-radixmesh-cached-tokens"])


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_the_streamed_cached_header_is_read_in_the_request_namespace(poll: Poll, kind: str
                                                                     ) -> None:
    async def scenario() -> None:
        fake = FakeEngine(cache_tokens=4096)
        await fake.start()
        port = free_port()
        cfg = ServeConfig(node_id="n0", port=port, engine=kind, engine_url=fake.url,
                          kv_events=fake.kv_endpoint, kv_replay=fake.replay_endpoint,
                          model=fake.model, cache_tokens=4096)
        service = build_external_service(cfg, tokenizer=ByteTokenizer())
        try:
            async with serving(service, port), aiohttp.ClientSession() as http:
                sub = service.attachments[0]

                def through() -> bool:  # past ZMQ's slow joiner
                    if sub.counts["messages"]:
                        return True
                    fake.clear_all()
                    return False

                await poll.until_async(through, "the first batch", LIMIT_S, interval=0.02)
                assert await stream(http, port) == 0
                blocks = len(PROMPT) // 16
                await poll.until_async(lambda: len(service.engine.cache_hashes()) >= blocks,
                                       "the shared prompt's events", LIMIT_S)
                assert await stream(http, port, cache_salt="tenant-a") == 0  # not its own
                assert await stream(http, port) >= len(PROMPT) - 16  # the shared one hits
                await poll.until_async(lambda: len(service.engine.cache_hashes()) >= 2 * blocks,
                                       "tenant-a's events", LIMIT_S)
                assert await stream(http, port, cache_salt="tenant-a") >= len(PROMPT) - 16
                assert await stream(http, port, cache_salt="tenant-b") == 0
        finally:
            await fake.stop()

    asyncio.run(scenario())
