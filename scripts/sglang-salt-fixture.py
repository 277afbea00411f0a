#!/usr/bin/env python3
"""Writes tests/fixtures/sglang_0_5_23_salt/: SGLang 0.5.23's own RadixCache (CPU tensors, no
model, no GPU) with KV events on, fed salted and unsalted inserts and one eviction; after each
step the events its recorder publishes, encoded with SGLang's own msgspec classes as its ZMQ
publisher encodes a batch (``EventBatch``: ``[ts, events]``, events as tagged maps).

Run it with SGLang's interpreter (the CUDA wheel imports on a CPU box; nothing here touches
a GPU): ``/path/to/sglang-venv/bin/python scripts/sglang-salt-fixture.py OUT_DIR``.
"""
import json
import sys

import msgspec
import torch
from sglang.srt.disaggregation.kv_events import EventBatch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey


class Pool:  # the allocator evict() hands freed slots to
    device = torch.device("cpu")
    def free_segment(self, idx, start_pos=0):
        pass
    def free(self, idx):
        pass

PAGE = 4
cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                   token_to_kv_pool_allocator=Pool(), page_size=PAGE,
                                   enable_kv_cache_events=True))
prompt = list(range(100, 116))  # 16 tokens = 4 pages
longer = prompt + list(range(200, 208))  # 2 pages more
enc = msgspec.msgpack.Encoder()
batches, steps = [], []


def step(what, **kw):
    if what == "insert":
        key = RadixKey(kw["tokens"], cache_salt=kw["salt"])
        cache.insert(InsertParams(key=key, value=torch.arange(len(kw["tokens"]))))
    else:
        cache.evict(EvictParams(num_tokens=kw["tokens"]))
    ev = cache.take_events()
    batches.append(enc.encode(EventBatch(ts=float(len(batches)), events=ev)))
    steps.append({"step": what, "tokens": kw["tokens"] if what == "evict" else len(kw["tokens"]),
                  "cache_salt": kw.get("salt"), "events": [msgspec.to_builtins(e) for e in ev]})


step("insert", tokens=prompt, salt=None)
step("insert", tokens=prompt, salt="tenant-a")
step("insert", tokens=longer, salt="tenant-a")   # a child run under tenant-a's
step("insert", tokens=prompt, salt="tenant-b")
step("evict", tokens=8)                          # the two least recently used pages' node
out = sys.argv[1]
for i, b in enumerate(batches):
    with open(f"{out}/batch{i}.msgpack", "wb") as f:
        f.write(b)
with open(f"{out}/steps.json", "w") as f:
    json.dump({"sglang": "0.5.23", "page_size": PAGE, "steps": steps}, f, indent=1)
