"""SGLang 0.5.23's events of salted requests (``tests/fixtures/sglang_0_5_23_salt``, written by
``scripts/sglang-salt-fixture.py`` from SGLang's own RadixCache and msgspec classes): SGLang
puts a request's ``cache_salt`` on every page it stores (a field of ``BlockStored``, not
vLLM's ``extra_keys``) and seeds the published hashes with it. The index roots a salted run in
that namespace, a child run follows its parent, and an eviction of the unsalted copy leaves
the tenants' copies matched."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest

from radixmesh.core.engine_index import EngineIndex
from radixmesh.core.kv_events import EngineBlockStored, KvBatch, decode_batch
from radixmesh.engine.http_engine import mesh_block_size

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "sglang_0_5_23_salt"
PAGE = 4
PROMPT = list(range(100, 116))
LONGER = [*PROMPT, *range(200, 208)]


def fixture_batches() -> list[KvBatch]:
    steps = json.loads((FIXTURE / "steps.json").read_text())["steps"]
    return [decode_batch((FIXTURE / f"batch{i}.msgpack").read_bytes()) for i in range(len(steps))]


def test_every_store_carries_its_salt_and_roots_only_salted_runs() -> None:
    stores = [e for b in fixture_batches() for e in b.events if isinstance(e, EngineBlockStored)]
    assert [(e.parent_hash is None, e.salt) for e in stores] == [
        (True, None), (True, "tenant-a"), (False, None), (True, "tenant-b")]
    assert all(e.keyed == () for e in stores)  # nothing opaque: salts are namespaces here


def test_the_index_matches_each_prompt_in_its_own_namespace_only() -> None:
    index = EngineIndex(mesh_block_size(PAGE, PAGE), 0, engine_block_size=PAGE)
    batches = fixture_batches()
    for batch in batches[:4]:  # three prompts stored, tenant-a's extended by two pages
        for ev in batch.events:
            index.apply_event(ev)
    query = [*PROMPT, 0]  # the last prompt token is never reported cached
    assert index.match(query, None) == len(PROMPT)
    assert index.match(query, "tenant-a") == len(PROMPT)
    assert index.match(query, "tenant-b") == len(PROMPT)
    assert index.match(query, "tenant-c") == 0
    assert index.match([*LONGER, 0], "tenant-a") == len(LONGER)
    assert index.match([*LONGER, 0], "tenant-b") == len(PROMPT)
    for ev in batches[4].events:  # SGLang evicts the unsalted copy (least recently used)
        index.apply_event(ev)
    assert index.match(query, None) == 0
    assert index.match(query, "tenant-a") == len(PROMPT)
    assert index.match(query, "tenant-b") == len(PROMPT)


@pytest.mark.parametrize(("field", "extra", "want"), [
    ("t1", None, "t1"),  # SGLang: the field
    (None, [["t1"], None], "t1"),  # vLLM: the first block's extra key
    ("t1", [["t1"], None], "t1"),  # both, agreeing
    ("t1", [["t2"], None], None),  # both, disagreeing: keyed (the engine keeps it apart)
    ("", None, None), (7, None, None), ("x" * 257, None, None),  # malformed salts: keyed
])
def test_a_root_salt_from_either_engine_shape(field: object, extra: object, want: str | None
                                              ) -> None:
    event = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
             "token_ids": list(range(8)), "block_size": PAGE, "lora_id": None}
    if field is not None:
        event["cache_salt"] = field
    if extra is not None:
        event["extra_keys"] = extra
    (stored,) = decode_batch(msgpack.packb([0.0, [event]])).events
    assert isinstance(stored, EngineBlockStored)
    assert stored.salt == want
    assert stored.keyed == (() if want is not None else (True, True))  # never the shared cache
    index = EngineIndex(PAGE, 0, engine_block_size=PAGE)
    index.apply_event(stored)
    assert index.match([*range(8), 0], None) == 0
    assert index.match([*range(8), 0], want) == (8 if want is not None else 0)
