"""Tenants on a real two-node mesh in this process, each node in front of a fake vLLM: tenant B
never hits, nor is routed by, tenant A's prefix, while A's own requests still do; the
operator key shares nothing with tenants; bad tenancy input is a 4xx."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from test_external_mesh import LIMIT_S, PREFIX, mesh_of_two, subscribed, view_blocks
from test_external_mesh import complete as mesh_complete

from radixmesh.core.blocks import block_hashes
from radixmesh.emulate.fake import FakeEngine
from radixmesh.engine.tokenizers import ByteTokenizer
from radixmesh.runtime.node import NodeService

if TYPE_CHECKING:
    from conftest import Poll

OPERATOR = "operator-key-000001"
KEYS = {"acme": "key-of-acme-0000001", "umbrella": "key-of-umbrella-001"}


async def complete(http: aiohttp.ClientSession, port: int, prompt: str, key: str,
                   **fields: Any) -> tuple[int, dict[str, str], Any]:
    """test_external_mesh's completion, by the client holding API key ``key``."""
    return await mesh_complete(http, port, prompt, key=key, **{"max_tokens": 4, **fields})


def cached(headers: dict[str, str], body: Any) -> tuple[int, int]:
    return (int(headers["x-radixmesh-cached-tokens"]),
            body["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_tenant_b_never_sees_tenant_a_prefix_and_a_still_hits(poll: Poll, tmp_path: Path
                                                               ) -> None:
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("".join(f"{k} {t}\n" for t, k in KEYS.items()))

    async def scenario(http: aiohttp.ClientSession, n1: NodeService, n2: NodeService,
                       p1: int, p2: int, engines: list[FakeEngine]) -> None:
        await _isolation(poll, http, n1, n2, p1, p2, engines[0])
        await _sessions(http, p1)
        await _bad_input(http, p2)

    asyncio.run(mesh_of_two(poll, scenario, api_key=OPERATOR, api_keys=str(keys_file)))


async def _isolation(poll: Poll, http: aiohttp.ClientSession, n1: NodeService,
                     n2: NodeService, p1: int, p2: int, fake1: FakeEngine) -> None:
    acme, umbrella = KEYS["acme"], KEYS["umbrella"]
    await subscribed(poll, n1, fake1)
    status, headers, _ = await complete(http, p1, PREFIX + "Question A0?", acme)
    assert status == 200 and headers["x-radixmesh-served-by"] == "node-1"
    await poll.until_async(lambda: len(n1.engine.cache_hashes()) >= 10, "engine 1's events",
                           LIMIT_S)
    tokens = ByteTokenizer().encode(PREFIX)
    ns = n1.namespacer.namespace_id("acme", None)
    theirs = set(n1.hashes_of(tokens, ns))
    plain = set(block_hashes(tokens, 16, n1.engine.fingerprint.digest))
    held = n1.engine.cache_hashes()
    assert theirs <= held and not plain & held  # indexed in acme's namespace only
    await poll.until_async(lambda: view_blocks(n2, "node-1") >= 10, "node 2's view", LIMIT_S)

    status, headers, body = await complete(http, p2, PREFIX + "Question B?", umbrella)
    assert status == 200, body
    assert headers["x-radixmesh-route"] == "local" and headers["x-radixmesh-served-by"] == "node-2"
    assert headers["x-radixmesh-expected-cached-tokens"] == "0" and cached(headers, body) == (0, 0)
    status, headers, body = await complete(http, p2, PREFIX + "Question O?", OPERATOR)
    assert headers["x-radixmesh-route"] == "local" and cached(headers, body) == (0, 0)
    status, headers, body = await complete(http, p2, PREFIX + "Question S?", acme,
                                           cache_salt="another salt")
    assert headers["x-radixmesh-route"] == "local" and cached(headers, body) == (0, 0)

    status, headers, body = await complete(http, p2, PREFIX + "Question A?", acme)
    assert status == 200, body
    assert headers["x-radixmesh-route"] == "forwarded"
    assert headers["x-radixmesh-served-by"] == "node-1"
    assert min(cached(headers, body)) >= len(tokens) - 16


async def _sessions(http: aiohttp.ClientSession, p1: int) -> None:
    """A session's turns follow its first (sent to node 2 on purpose), whatever their prefix;
    the same key of another tenant is another session."""
    acme, umbrella = KEYS["acme"], KEYS["umbrella"]
    status, headers, _ = await complete(http, p1, "Turn 1 of a chat.", acme,
                                        prompt_cache_key="chat-1",
                                        headers={"x-radixmesh-target": "node-2"})
    assert status == 200 and headers["x-radixmesh-served-by"] == "node-2"
    for turn, (key, field) in enumerate(((acme, "prompt_cache_key"), (acme, "header"))):
        extra: dict[str, Any] = ({"prompt_cache_key": "chat-1"} if field != "header"
                                 else {"headers": {"x-session-id": "chat-1"}})
        status, headers, body = await complete(http, p1, f"Turn {turn + 2}, new text.", key,
                                               **extra)
        assert status == 200, body
        assert headers["x-radixmesh-served-by"] == "node-2", (field, headers)
    status, headers, _ = await complete(http, p1, "Another tenant's chat.", umbrella,
                                        prompt_cache_key="chat-1")
    assert headers["x-radixmesh-served-by"] == "node-1"  # unknown session: as any request
    status, headers, _ = await complete(http, p1, "No session at all.", acme)
    assert headers["x-radixmesh-served-by"] == "node-1"


async def _bad_input(http: aiohttp.ClientSession, port: int) -> None:
    acme = KEYS["acme"]
    for fields, param in (({"cache_salt": 5}, "cache_salt"),
                          ({"cache_salt": "x" * 257}, "cache_salt"),
                          ({"prompt_cache_key": ["a"]}, "prompt_cache_key"),
                          ({"headers": {"x-session-id": "s" * 257}}, "x-session-id")):
        status, _, body = await complete(http, port, "hello there", acme, **fields)
        assert status == 400 and body["error"]["param"] == param, body
    status, _, body = await complete(http, port, "hello there", "not-a-known-key-0001")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    auth = {"authorization": f"Bearer {acme}"}
    async with http.get(f"http://127.0.0.1:{port}/mesh", headers=auth) as resp:
        assert resp.status == 403
    async with http.get(f"http://127.0.0.1:{port}/mesh",
                        headers={"authorization": f"Bearer {OPERATOR}"}) as resp:
        assert resp.status == 200
    async with http.get(f"http://127.0.0.1:{port}/v1/models", headers=auth) as resp:
        assert resp.status == 200


def test_an_engine_that_does_not_isolate_refuses_a_namespace(tmp_path: Path) -> None:
    """An engine that does not keep namespaces apart (here the built-in one told so): a
    cache_salt or a tenant key is a 400, never a run in the shared cache; the operator's
    requests run."""
    from radixmesh.engine.factory import build_engine
    from radixmesh.runtime.inprocess import serving_node

    keys_file = tmp_path / "keys.txt"
    keys_file.write_text(f"{KEYS['acme']} acme\n")

    async def scenario() -> None:
        engine = build_engine("micro", cache_tokens=4096, threads=1)
        engine.cache_namespaces = False  # type: ignore[misc]
        async with (serving_node(engine, "solo", api_key=OPERATOR, api_keys=str(keys_file))
                    as (service, address), aiohttp.ClientSession() as http):
            port = int(address.rsplit(":", 1)[1])
            model = service.engine.model_name
            for key, fields in ((KEYS["acme"], {}), (OPERATOR, {"cache_salt": "s"})):
                status, _, body = await complete(http, port, "hello", key, model=model, **fields)
                assert status == 400 and body["error"]["param"] == "cache_salt", body
            status, _, body = await complete(http, port, "hello", OPERATOR, model=model)
            assert status == 200, body

    asyncio.run(scenario())


DIGEST_A, DIGEST_B, DIGEST_C = "a" * 64, "b" * 64, "c" * 64


def test_an_adapter_is_known_by_its_digest_and_its_kv_is_its_own(poll: Poll, tmp_path: Path
                                                                  ) -> None:
    """Both engines serve "sql-lora", node 2 with other weights: node 1 never sends its
    sql-lora requests there; its own sql-lora KV is indexed under the adapter and reused by
    sql-lora only; an unknown model is a 404 naming it; /v1/models lists the adapter.
    Node 2 alone serves chat-lora: node 1 forwards chat-lora requests to it, and node 2
    forwards sql-lora requests pinned to node 1's digest there."""
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("".join(f"{k} {t}\n" for t, k in KEYS.items()))

    async def scenario(http: aiohttp.ClientSession, n1: NodeService, n2: NodeService,
                       p1: int, p2: int, engines: list[FakeEngine]) -> None:
        await subscribed(poll, n1, engines[0])
        await subscribed(poll, n2, engines[1])
        await _adapters(poll, http, n1, n2, p1, p2)
        await _forwarded_adapters(poll, http, n1, p1, p2)

    asyncio.run(mesh_of_two(
        poll, scenario, ({"adapters": ("sql-lora",)}, {"adapters": ("sql-lora", "chat-lora")}),
        ({"adapters": f"sql-lora={DIGEST_A}"},
         {"adapters": f"sql-lora={DIGEST_B},chat-lora={DIGEST_C}"}),
        api_key=OPERATOR, api_keys=str(keys_file)))


async def _adapters(poll: Poll, http: aiohttp.ClientSession, n1: NodeService,
                    n2: NodeService, p1: int, p2: int) -> None:
    op = OPERATOR
    for model in ("fake-model", "sql-lora"):  # node 2 caches the prefix under both
        status, headers, body = await complete(http, p2, PREFIX + "Q0?", op, model=model)
        assert status == 200 and headers["x-radixmesh-served-by"] == "node-2", body
    await poll.until_async(lambda: view_blocks(n1, "node-2") >= 20, "node 1's view", LIMIT_S)
    status, headers, body = await complete(http, p1, PREFIX + "Q1?", op, model="sql-lora")
    assert status == 200, body
    assert headers["x-radixmesh-served-by"] == "node-1"  # node 2's sql-lora is other weights
    assert cached(headers, body) == (0, 0)
    await poll.until_async(lambda: len(n1.engine.cache_hashes()) >= 10, "node 1's index",
                           LIMIT_S)
    status, headers, body = await complete(http, p1, PREFIX + "Q2?", op, model="sql-lora")
    assert headers["x-radixmesh-served-by"] == "node-1" and min(cached(headers, body)) > 0
    status, headers, body = await complete(http, p1, PREFIX + "Q4?", op, model="sql-lora",
                                           headers={"x-radixmesh-target": "node-2"})
    assert headers["x-radixmesh-served-by"] == "node-1", headers  # the constraint outranks it
    status, headers, body = await complete(http, p1, PREFIX + "Q3?", op,
                                           headers={"x-radixmesh-hop": "1"})
    assert headers["x-radixmesh-served-by"] == "node-1"
    assert cached(headers, body) == (0, 0)  # the base model never reuses the adapter's KV
    status, _, body = await complete(http, p1, "hello", op, model="nope-lora")
    assert status == 404 and "nope-lora" in body["error"]["message"]
    async with http.get(f"http://127.0.0.1:{p1}/v1/models",
                        headers={"authorization": f"Bearer {op}"}) as resp:
        listed = {m["id"]: m for m in (await resp.json())["data"]}
    assert listed["sql-lora"]["parent"] == "fake-model"
    assert listed["sql-lora"]["digest"] == DIGEST_A


async def _forwarded_adapters(poll: Poll, http: aiohttp.ClientSession, n1: NodeService,
                              p1: int, p2: int) -> None:
    op = OPERATOR
    await poll.until_async(lambda: "chat-lora" in n1.core.adapter_names(), "the adverts",
                           LIMIT_S)
    auth = {"authorization": f"Bearer {op}"}
    async with http.get(f"http://127.0.0.1:{p1}/v1/models", headers=auth) as resp:
        listed = [m for m in (await resp.json())["data"] if m["id"].endswith("-lora")]
    assert [(m["id"], m["remote"], m["digest"]) for m in listed] == [
        ("sql-lora", False, DIGEST_A), ("chat-lora", True, DIGEST_C)]  # peers' marked remote
    async with http.get(f"http://127.0.0.1:{p1}/v1/models/chat-lora", headers=auth) as resp:
        assert resp.status == 200 and (await resp.json())["parent"] == "fake-model"
    status, headers, body = await complete(http, p1, PREFIX + "C1?", op, model="chat-lora")
    assert status == 200 and headers["x-radixmesh-served-by"] == "node-2", (headers, body)
    pin = {"x-radixmesh-adapter-digest": f"sha256:{DIGEST_A}"}
    status, headers, body = await complete(http, p2, PREFIX + "C2?", op, model="sql-lora",
                                           headers=pin)
    assert status == 200 and headers["x-radixmesh-served-by"] == "node-1", (headers, body)
    status, _, body = await complete(http, p1, "hi", op, model="sql-lora",
                                     headers={"x-radixmesh-adapter-digest": "zz"})
    assert status == 400 and "x-radixmesh-adapter-digest" in body["error"]["message"]
    status, _, body = await complete(http, p1, "hi", op, model="chat-lora",
                                     headers={"x-radixmesh-adapter-digest": "d" * 64})
    assert status == 404 and "chat-lora" in body["error"]["message"]


def test_adapters_flag_reads_digests_and_folders(tmp_path: Path) -> None:
    import pytest

    from radixmesh.core.adapters import files_digest
    from radixmesh.runtime.node import load_adapters

    folder = tmp_path / "sql"
    (folder / "sub").mkdir(parents=True)
    (folder / "adapter_config.json").write_bytes(b"{}")
    (folder / "sub" / "w.bin").write_bytes(b"weights")
    got = load_adapters(f"sql-lora={folder}, chat=sha256:{DIGEST_A}")
    want = files_digest([("adapter_config.json", b"{}"), ("sub/w.bin", b"weights")])
    assert got["sql-lora"].digest == want and got["chat"].digest == DIGEST_A
    assert load_adapters("") == {}
    for bad in ("sql-lora", f"x={tmp_path / 'missing'}", f"a={DIGEST_A},a={DIGEST_B}"):
        with pytest.raises(ValueError):
            load_adapters(bad)


def test_a_forward_carries_beat_s_within_the_protocols_bound() -> None:
    """A local prediction past an hour (a stalled engine at a large time scale) is clamped,
    not a 500 when the forward is built; one that is not finite sets no condition."""
    from radixmesh.runtime.execution import _wire_beat

    assert _wire_beat(5000.0) == 3600.0 and _wire_beat(-5000.0) == -3600.0
    assert _wire_beat(float("inf")) is None and _wire_beat(float("nan")) is None
    assert _wire_beat(None) is None and _wire_beat(1.2345678) == 1.234568
