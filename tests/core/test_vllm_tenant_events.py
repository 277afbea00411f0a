"""Real vLLM 0.32 CPU events of salted and LoRA requests (``tests/fixtures/vllm_0_32_tenants``,
captured by ``python -m radixmesh.bench.vllm_tenants --capture``): every store is decoded into
its namespace (the salt vLLM publishes in the first block's ``extra_keys``, after the adapter
name on a LoRA run), none is left opaque, and the index matches the prompt in the namespace it
was stored under and in no namespace not stored yet."""

from __future__ import annotations

from pathlib import Path

import msgpack

from radixmesh.core.blocks import DEFAULT_BLOCK_SIZE
from radixmesh.core.engine_index import EngineIndex
from radixmesh.core.kv_events import EngineBlockStored, decode_batch
from radixmesh.core.kv_order import decode_live_frames
from radixmesh.engine.http_engine import mesh_block_size

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "vllm_0_32_tenants"
ENGINE_BLOCK = 128


def batches() -> list[tuple[int, list[EngineBlockStored]]]:
    out = []
    for frames in msgpack.unpackb((FIXTURE / "live.msgpack").read_bytes()):
        msg = decode_live_frames(frames)
        batch = decode_batch(msg.payload)
        out.append((msg.seq, batch))
    return [(seq, [e for e in b.events if isinstance(e, EngineBlockStored)])
            for seq, b in sorted(out, key=lambda x: x[0])]


def test_salted_and_lora_stores_decode_into_namespaces_never_opaque() -> None:
    roots = [e for _, evs in batches() for e in evs if e.parent_hash is None]
    kinds = {(e.salt is not None, e.lora_name) for e in roots}
    assert {(True, None), (False, None), (True, "ad1")} <= kinds
    assert all(e.keyed == () for _, evs in batches() for e in evs)  # nothing opaque
    lora_unsalted = [e for e in roots if e.lora_name == "ad1" and e.salt is None]
    assert not lora_unsalted  # the node always sends a LoRA request a salt (its namespace)


def test_the_index_matches_each_prompt_in_its_own_namespace_only() -> None:
    index = EngineIndex(mesh_block_size(DEFAULT_BLOCK_SIZE, ENGINE_BLOCK), 0,
                        engine_block_size=ENGINE_BLOCK)
    stored: set[str | None] = set()
    checked = 0
    for _, events in batches():
        for ev in events:
            index.apply_event(ev)
            if ev.parent_hash is not None or len(ev.block_hashes) < 12:
                continue  # the warm-up prompts; the tenants' prompt is 12 blocks and more
            prompt = [*ev.token_ids, 0]
            assert index.match(prompt, ev.salt) == len(ev.token_ids)
            for other in ("never-stored-namespace", *({None} - stored - {ev.salt})):
                assert index.match(prompt, other) == 0
            stored.add(ev.salt)
            checked += 1
    assert checked >= 4  # salt A, salt B, no salt, the adapter (and adapter + salt A)
