"""Tenants and adapters on a node over the built-in engine: tenant b never reuses tenant a's
prefix while a's own requests hit, every answer equals the operator's (shared cache) one, the
node's index holds only namespaced hashes; a LoRA adapter served from its PEFT folder answers
as the engine does with it, never reuses the base model's KV, and /v1/models lists it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from radixmesh.core.blocks import block_hashes
from radixmesh.engine.base import GenerateRequest, SamplingParams
from radixmesh.engine.factory import build_engine
from radixmesh.engine.testing import save_random_lora_dir
from radixmesh.runtime.inprocess import serving_node

if TYPE_CHECKING:
    from conftest import Poll

OPERATOR = "operator-key-000001"
KEYS = {"acme": "key-of-acme-0000001", "umbrella": "key-of-umbrella-001"}
PROMPT = "You are a careful assistant. Answer the question below in one word. " * 2


async def _complete(http: aiohttp.ClientSession, port: int, key: str,
                    **fields: Any) -> tuple[int, dict[str, str], Any]:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, **fields}
    async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                         headers={"authorization": f"Bearer {key}"}) as resp:
        return resp.status, dict(resp.headers), await resp.json(content_type=None)


def _cached(headers: dict[str, str], body: Any) -> int:
    got = int(headers["x-radixmesh-cached-tokens"])
    assert got == body["usage"]["prompt_tokens_details"]["cached_tokens"]
    return got


def test_tenants_and_an_adapter_on_the_builtin_engine(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("".join(f"{k} {t}\n" for t, k in KEYS.items()))
    engine = build_engine("micro", cache_tokens=4096, threads=1)
    folder = save_random_lora_dir(tmp_path / "sql", engine.model, seed=3, std=0.2)
    engine.load_adapter("sql-lora", folder)
    ids = engine.tokenizer.encode(PROMPT)
    ref = engine.generate(GenerateRequest("ref", tuple(ids), SamplingParams(max_tokens=6),
                                          adapter="sql-lora"))
    engine.clear_cache()

    async def scenario() -> None:
        async with (serving_node(engine, "solo", api_key=OPERATOR, api_keys=str(keys_file),
                                 adapters=f"sql-lora={folder}") as (service, address),
                    aiohttp.ClientSession() as http):
            port = int(address.rsplit(":", 1)[1])
            model = service.engine.model_name
            answers, hits = [], []
            for key in (OPERATOR, KEYS["acme"], KEYS["acme"], KEYS["umbrella"]):
                status, headers, body = await _complete(http, port, key, model=model)
                assert status == 200, body
                answers.append(body["choices"][0]["text"])
                hits.append(_cached(headers, body))
            assert hits[1] == 0 and hits[2] > 0 and hits[3] == 0, hits
            assert len(set(answers)) == 1
            fp = engine.fingerprint
            shared = set(block_hashes(ids, fp.block_size, fp.digest))
            held = service.engine.cache_hashes()
            assert shared <= held and len(held) >= 3 * len(shared)  # 3 namespaces, apart
            status, headers, body = await _complete(http, port, OPERATOR, model="sql-lora")
            assert status == 200 and _cached(headers, body) == 0, body
            assert body["choices"][0]["text"] == engine.tokenizer.decode(ref.output_ids)
            status, headers, body = await _complete(http, port, OPERATOR, model="sql-lora")
            assert _cached(headers, body) > 0  # its own KV, reused
            async with http.get(f"http://127.0.0.1:{port}/v1/models",
                                headers={"authorization": f"Bearer {OPERATOR}"}) as resp:
                listed = {m["id"]: m for m in (await resp.json())["data"]}
            assert listed["sql-lora"]["parent"] == model and not listed["sql-lora"]["remote"]
            assert listed["sql-lora"]["digest"] == service.adapters["sql-lora"].digest

    asyncio.run(scenario())


def test_serve_loads_adapter_folders_on_the_builtin_engine(tmp_path: Path) -> None:
    """``radixmesh serve --adapters NAME=DIR``: the engine loads the folder (its digest is the
    node's); a bare digest, enough for an external engine, is refused before the model is
    built."""
    import pytest

    from radixmesh.engine.factory import describe
    from radixmesh.engine.presets import build_random_model
    from radixmesh.runtime.config import ServeConfig
    from radixmesh.runtime.serve_cli import build_service

    folder = save_random_lora_dir(tmp_path / "sql", build_random_model("micro", 0), seed=3)
    cfg = ServeConfig(node_id="solo", preset="micro", cache_tokens=4096, threads=1,
                      adapters=f"sql-lora={folder}")
    service = build_service(cfg)
    engine = service.engine.engine
    assert describe(engine)["adapters"] == ["sql-lora"] and "sql-lora" in service.adapters
    asyncio.run(service.engine.aclose())  # its engine thread
    with pytest.raises(ValueError, match="loads a PEFT LoRA adapter from its folder"):
        build_service(ServeConfig(node_id="solo", preset="micro", adapters="sql=" + "a" * 64))


def test_a_node_without_the_adapter_forwards_to_a_builtin_holder(poll: Poll,
                                                                 tmp_path: Path) -> None:
    """Two built-in nodes, the adapter on node b only: node a forwards sql-lora requests there
    (the namespace and digest travel with the forward); b answers with the adapter's weights
    and reuses its own adapter KV; /v1/models on a lists the adapter as remote."""
    engine_a = build_engine("micro", cache_tokens=4096, threads=1)
    engine_b = build_engine("micro", cache_tokens=4096, threads=1)
    folder = save_random_lora_dir(tmp_path / "sql", engine_b.model, seed=3, std=0.2)
    engine_b.load_adapter("sql-lora", folder)
    ids = engine_b.tokenizer.encode(PROMPT)
    ref = engine_b.generate(GenerateRequest("ref", tuple(ids), SamplingParams(max_tokens=6),
                                            adapter="sql-lora"))
    engine_b.clear_cache()
    mesh = {"gossip_interval": 0.1, "gossip_announce": 0.05, "api_key": OPERATOR}

    async def scenario() -> None:
        async with (serving_node(engine_b, "node-b", adapters=f"sql-lora={folder}", **mesh)
                    as (nb, address_b),
                    serving_node(engine_a, "node-a", peers=(address_b,), **mesh) as (na, addr),
                    aiohttp.ClientSession() as http):
            port = int(addr.rsplit(":", 1)[1])
            await poll.until_async(lambda: "sql-lora" in na.core.adapter_names(),
                                   "node a learns node b's adapter", 10.0)
            hits = []
            for _ in range(2):
                status, headers, body = await _complete(http, port, OPERATOR, model="sql-lora")
                assert status == 200 and headers["x-radixmesh-served-by"] == "node-b", body
                assert body["choices"][0]["text"] == engine_b.tokenizer.decode(ref.output_ids)
                hits.append(_cached(headers, body))
            assert hits[0] == 0 and hits[1] > 0
            async with http.get(f"http://127.0.0.1:{port}/v1/models",
                                headers={"authorization": f"Bearer {OPERATOR}"}) as resp:
                listed = {m["id"]: m for m in (await resp.json())["data"]}
            assert listed["sql-lora"]["remote"]
            assert listed["sql-lora"]["digest"] == nb.adapters["sql-lora"].digest

    asyncio.run(scenario())
