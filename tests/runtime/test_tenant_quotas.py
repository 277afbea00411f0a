"""Per-tenant admission quotas over loopback (core/quotas.py): with two API keys and
``tenant_queue_share = 0.5`` of a 4-request queue, a tenant holding two requests gets a 429
(Retry-After, OpenAI-style error) for its third, while the other tenant's request is admitted
and served; a forward whose tenant is over its share at the peer is refused there.

Real HTTP on 127.0.0.1 (uvicorn in this process), a lone node in front of a fake vLLM (tenant
keys need an engine that keeps namespaces apart) whose steps each take 50 ms, so admitted
requests stay queued while the others arrive."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from test_external_mesh import mesh_of_two, node

from radixmesh.core.messages import ForwardRequest
from radixmesh.emulate.fake import FakeEngine
from radixmesh.runtime.cluster import free_port
from radixmesh.runtime.config import ServeConfig, config_from_args, config_from_mapping
from radixmesh.runtime.node import NodeService
from test_cli_flags import command_args

if TYPE_CHECKING:
    from conftest import Poll

KEYS = {"acme": "key-of-acme-0000001", "umbrella": "key-of-umbrella-001"}
STEP_S = 0.05


@contextlib.asynccontextmanager
async def _serving(poll: Poll, tmp_path: Path, **options: Any
                   ) -> AsyncIterator[tuple[NodeService, str]]:
    keys = tmp_path / "keys.txt"
    keys.write_text("".join(f"{k} {t}\n" for t, k in KEYS.items()))
    fake = FakeEngine(cache_tokens=4096)
    fake.faults.token_delay_s = STEP_S
    await fake.start()
    port = free_port()
    try:
        async with node(poll, fake, "quota", port, None, api_keys=str(keys),
                        max_queue_requests=4, max_queue_tokens=None, **options) as service:
            yield service, f"127.0.0.1:{port}"
    finally:
        await fake.stop()


async def _post(http: aiohttp.ClientSession, address: str, tenant: str,
                more: dict[str, str] | None = None, **fields: Any
                ) -> tuple[int, dict[str, str], Any]:
    body = {"model": "fake-model", "prompt": f"{tenant} asks " * 4, "max_tokens": 20,
            "temperature": 0, **fields}
    headers = {"Authorization": f"Bearer {KEYS[tenant]}", **(more or {})}
    async with http.post(f"http://{address}/v1/completions", json=body,
                         headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.json(content_type=None)


def test_a_flooding_tenant_gets_429_while_another_is_admitted(
    poll: Poll, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with _serving(poll, tmp_path, tenant_queue_share=0.5) as (node, address), \
                aiohttp.ClientSession() as http:
            flood = [asyncio.ensure_future(_post(http, address, "acme")) for _ in range(2)]
            await poll.until_async(lambda: node.queue_depth == 2, "acme's two queued")
            status, headers, body = await _post(http, address, "acme")  # its third
            assert status == 429 and int(headers["Retry-After"]) >= 1
            assert body["error"]["type"] == "rate_limit_error"
            assert body["error"]["code"] == "tenant_quota_exceeded"
            status, headers, body = await _post(http, address, "umbrella")
            assert status == 200, body  # admitted and served beside acme's two
            assert [s for s, _, _ in await asyncio.gather(*flood)] == [200, 200]
            assert node.metrics.rejected == 1
            assert node.core.metrics()["admission_full_quota"] == 1
            key = node.quota_key("acme")
            assert key is not None and "acme" not in key  # a keyed hash, never the name
            assert node.quotas.held(key).requests == 0  # released when they finished

    asyncio.run(scenario())


def test_quotas_off_admit_a_tenant_up_to_the_node_bound(
    poll: Poll, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with _serving(poll, tmp_path) as (node, address), \
                aiohttp.ClientSession() as http:
            flood = [asyncio.ensure_future(_post(http, address, "acme")) for _ in range(3)]
            await poll.until_async(lambda: node.queue_depth == 3, "acme's three queued")
            assert node.quota_key("acme") is None
            assert [s for s, _, _ in await asyncio.gather(*flood)] == [200, 200, 200]
            assert node.metrics.rejected == 0

    asyncio.run(scenario())


def test_a_forward_over_its_tenants_share_is_refused_busy_at_the_peer(
    poll: Poll, tmp_path: Path
) -> None:
    """The quota is checked where the request is admitted to run: the peer counts the
    forwarded tenant's requests by the key the forward carries."""
    async def scenario() -> None:
        async with _serving(poll, tmp_path, tenant_queue_share=0.5) as (node, address), \
                aiohttp.ClientSession() as http:
            held = [asyncio.ensure_future(_post(http, address, "acme")) for _ in range(2)]
            await poll.until_async(lambda: node.queue_depth == 2, "acme's two queued")
            prompt = tuple(range(1, 20))
            forward = ForwardRequest(prompt, 4, tenant=node.quota_key("acme"))
            replies = [r async for r in node.serve_forward(forward)]
            assert len(replies) == 1 and node.metrics.refused_for_peers == 1
            other = ForwardRequest(prompt, 4, tenant=node.quota_key("umbrella"))
            served = [r async for r in node.serve_forward(other)]
            assert len(served) > 1 and node.metrics.served_for_peers == 1
            assert [s for s, _, _ in await asyncio.gather(*held)] == [200, 200]
            assert node.core.metrics()["admission_full_quota"] == 1

    asyncio.run(scenario())


def test_the_option_flag_and_toml_key() -> None:
    assert ServeConfig().tenant_queue_share is None  # off by default: today's behaviour
    assert config_from_mapping({"tenant-queue-share": "25%"}).tenant_queue_share == 0.25
    assert config_from_mapping({"tenant_queue_share": 0.5}).tenant_queue_share == 0.5
    assert config_from_mapping({"tenant-queue-share": "off"}).tenant_queue_share is None
    args = command_args("serve", "--tenant-queue-share", "0.5")
    assert config_from_args(args).tenant_queue_share == 0.5
    for bad in ("0", "1.5", "-0.1", True, "lots"):
        with pytest.raises(ValueError):
            config_from_mapping({"tenant-queue-share": bad})


def test_a_tenant_over_its_share_at_the_entry_node_is_served_by_a_peer(
    poll: Poll, tmp_path: Path
) -> None:
    """Each node counts what runs on it: acme, over its share on node 1, is forwarded to node 2
    (where it holds nothing) instead of refused."""
    keys = tmp_path / "keys.txt"
    keys.write_text("".join(f"{k} {t}\n" for t, k in KEYS.items()))

    async def scenario(http: aiohttp.ClientSession, n1: NodeService, n2: NodeService,
                       p1: int, p2: int, engines: list[FakeEngine]) -> None:
        for fake in engines:
            fake.faults.token_delay_s = STEP_S
        address = f"127.0.0.1:{p1}"
        held = [asyncio.ensure_future(_post(http, address, "acme", {"x-radixmesh-hop": "1"}))
                for _ in range(2)]  # (hop-limited: both run on node 1)
        await poll.until_async(lambda: n1.queue_depth == 2, "acme's two on node 1")
        status, headers, body = await _post(http, address, "acme")
        assert status == 200, body
        assert headers["x-radixmesh-served-by"] == "node-2"
        assert headers["x-radixmesh-route"] == "forwarded"
        assert [s for s, _, _ in await asyncio.gather(*held)] == [200, 200]
        assert n1.core.metrics().get("admission_full_quota", 0) == 0  # a peer served it
        assert n1.metrics.rejected == 0 and n2.metrics.served_for_peers == 1

    asyncio.run(mesh_of_two(poll, scenario, api_keys=str(keys), tenant_queue_share=0.5,
                            max_queue_requests=4, max_queue_tokens=None, policy="cost"))


def test_the_samples_of_one_request_are_admitted_together(poll: Poll, tmp_path: Path) -> None:
    """The quota is checked once per API request, for all its samples and prompts: on an
    idle node n = 2 (the cap) is served; n = 3 or three prompts can never fit the cap of 2
    (a 400 naming why, not a 429 that retrying never cures); n = 2 beside one queued request
    of the same tenant gets the 429 before any sample starts; the other tenant's n = 2 runs."""
    async def scenario() -> None:
        async with _serving(poll, tmp_path, tenant_queue_share=0.5) as (node, address), \
                aiohttp.ClientSession() as http:
            status, _, body = await _post(http, address, "acme", n=2, temperature=1.0)
            assert status == 200 and len(body["choices"]) == 2, body
            for fields in ({"n": 3, "temperature": 1.0}, {"prompt": ["a b", "c d", "e f"]}):
                status, _, body = await _post(http, address, "acme", **fields)
                assert status == 400, body
                assert body["error"]["type"] == "invalid_request_error"
                assert "tenant" in body["error"]["message"] and "3" in body["error"]["message"]
            held = asyncio.ensure_future(_post(http, address, "acme"))
            await poll.until_async(lambda: node.queue_depth == 1, "acme's one queued")
            status, _, body = await _post(http, address, "acme", n=2, temperature=1.0)
            assert status == 429 and body["error"]["code"] == "tenant_quota_exceeded"
            assert node.queue_depth == 1  # no sample of it started
            status, _, body = await _post(http, address, "umbrella", n=2, temperature=1.0)
            assert status == 200 and len(body["choices"]) == 2, body
            assert (await held)[0] == 200
            assert node.metrics.rejected == 1 and node.core.metrics()["admission_full_quota"] == 1

    asyncio.run(scenario())
