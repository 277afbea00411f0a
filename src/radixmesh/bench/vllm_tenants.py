"""``make vllm-tenants``: cache namespaces (``cache_salt``) and a LoRA adapter on a real vLLM
CPU server, behind one node.

Theory of operation
-------------------
One vLLM 0.32 CPU server with KV events, ``--enable-lora --lora-modules ad1=DIR`` (a random
PEFT adapter written here: ``adapter_config.json`` + ``adapter_model.safetensors``, A and B
non-zero on ``q_proj`` / ``v_proj``), and one node with ``--engine vllm --adapters ad1=DIR``
(the adapter known by its content digest). The same long prompt goes, one request in flight,
as (namespace, adapter)::

    salt A, salt A, salt B, salt B, no salt, no salt, ad1, ad1, ad1 + salt A, ad1 + salt A

Warm-up requests first (until a batch reached the node: ZMQ's slow joiner), and each request
once the node has every batch the engine published. Per request the node's prediction ``P``
(``x-radixmesh-cached-tokens``: its KV-event index match in the request's namespace) against
the engine's truth ``A`` (``usage.prompt_tokens_details.cached_tokens``). Isolation holds on
the engine when every first request of a namespace has ``A`` = 0 although the same tokens are
cached under another one (vLLM puts ``cache_salt`` into the first block's hash, and a LoRA
request's name and path into every block's: vllm/v1/core/kv_cache_utils.py,
``generate_block_hash_extra_keys``), and the repeat within a namespace hits. The events are
mapped back to the right namespace when ``P == A`` for every request (a salted or LoRA block
mapped to another namespace, or left opaque, would show as ``P != A`` on the repeats). The
bench subscribes to the publisher itself and reports the ``extra_keys`` / ``lora_name`` shapes
the engine sent (per block, the adapter name first, then the salt on the first block:
``to_event_extra_keys``). Written to ``OUT/vllm_tenants.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from radixmesh.bench.vllm_capture import Capture
from radixmesh.bench.vllm_check import node_options
from radixmesh.bench.vllm_replay import send_stream
from radixmesh.bench.vllm_server import (
    READY_TIMEOUT_S,
    VllmServer,
    save_model_dir,
    vllm_parser,
    vllm_version,
    wait_subscribed,
)
from radixmesh.results.records import Record
from radixmesh.runtime.cluster import LocalCluster, free_ports
from radixmesh.workload.request import Request

ADAPTER = "ad1"
STEPS: tuple[tuple[str | None, str | None], ...] = (
    ("tenant-a", None), ("tenant-a", None), ("tenant-b", None), ("tenant-b", None),
    (None, None), (None, None), (None, ADAPTER), (None, ADAPTER),
    ("tenant-a", ADAPTER), ("tenant-a", ADAPTER))


def save_random_adapter(path: Path, model_dir: Path, seed: int = 0, rank: int = 8) -> Path:
    """A PEFT LoRA folder for the model in ``model_dir`` (its shapes from ``config.json``):
    ``engine.testing.save_random_lora_dir``'s seeded non-zero A and B on every layer's
    ``q_proj`` and ``v_proj``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from radixmesh.engine.testing import save_random_lora_dir

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return save_random_lora_dir(path, model, seed=seed, rank=rank, targets=("q_proj", "v_proj"))


def caught_up(cluster: LocalCluster, capture: Capture) -> bool:
    """Has the node handled every batch the engine published (as the bench's own subscriber
    saw them)?"""
    seqs = [int.from_bytes(f[1], "big") for _, f in list(capture.timed[0]) if len(f) == 3]
    pubs = (cluster.mesh(0).get("kv_events") or {}).get("publishers") or [{}]
    return bool(seqs) and pubs[0].get("next_seq") == max(seqs) + 1


async def wait_caught_up(cluster: LocalCluster, capture: Capture, timeout: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if caught_up(cluster, capture):
            return True
        await asyncio.sleep(0.02)
    return False


async def warm_up(http: httpx.AsyncClient, cluster: LocalCluster, capture: Capture) -> None:
    """Requests of their own until a batch reached the node (ZMQ's slow joiner may lose the
    first ones); each step then waits until the node has every batch, so a mismatch is the
    namespaces', not the subscriber's milliseconds behind."""
    for i in range(5):
        req = Request(id=f"warm{i}", prompt=f"warm-up {i} " * 40, max_tokens=2)
        rec = Record(run="vllm-tenants", policy="cost", seq=-1, id=req.id, group=None,
                     entry=0, entry_node=cluster.node_ids[0], t_send=0.0)
        await send_stream(http, cluster.urls[0], req, rec, time.perf_counter())
        if await wait_caught_up(cluster, capture):
            return


async def run_steps(cluster: LocalCluster, capture: Capture, prompt: str
                    ) -> list[dict[str, Any]]:
    url, node_id = cluster.urls[0], cluster.node_ids[0]
    rows = []
    async with httpx.AsyncClient(timeout=300.0, trust_env=False) as http:
        await warm_up(http, cluster, capture)
        for i, (salt, adapter) in enumerate(STEPS):
            await wait_caught_up(cluster, capture)
            req = Request(id=f"t{i}", prompt=prompt, max_tokens=4)
            rec = Record(run="vllm-tenants", policy="cost", seq=i, id=req.id, group=None,
                         entry=0, entry_node=node_id, t_send=0.0)
            extra: dict[str, Any] = {}
            if salt:
                extra["cache_salt"] = salt
            if adapter:
                extra["model"] = adapter
            actual = await send_stream(http, url, req, rec, time.perf_counter(),
                                       extra_body=extra)
            rows.append({"step": i, "cache_salt": salt, "adapter": adapter,
                         "predicted": rec.cached_tokens, "actual": actual,
                         "prompt_tokens": rec.prompt_tokens, "error": rec.error})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def event_shapes(frames: Sequence[tuple[float, Sequence[bytes]]]) -> list[dict[str, Any]]:
    """The distinct (lora_name, root or not, first and second block's ``extra_keys``) of the
    BlockStored events the engine published."""
    import msgpack

    seen: dict[str, dict[str, Any]] = {}
    for _, f in frames:
        if len(f) != 3:
            continue
        for ev in msgpack.unpackb(f[2], raw=False, strict_map_key=False)[1]:
            # vLLM 0.32 sends events as maps (core/kv_events.py); tagged arrays carry neither
            fields = ev if isinstance(ev, dict) and ev.get("type") == "BlockStored" else None
            if fields is None:
                continue
            keys = fields.get("extra_keys") or []
            shape = {"lora_name": fields.get("lora_name"),
                     "root": fields.get("parent_block_hash") is None,
                     "first_block_keys": keys[0] if keys else None,
                     "later_block_keys": keys[1] if len(keys) > 1 else None}
            seen.setdefault(json.dumps(shape, sort_keys=True), shape)
    return list(seen.values())


def verdict(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if r["error"] is None and r["actual"] is not None]
    firsts = [r for i, r in enumerate(ok) if i % 2 == 0]
    repeats = [r for i, r in enumerate(ok) if i % 2 == 1]
    return {"requests": len(rows), "answered": len(ok),
            "index_equals_engine": sum(r["predicted"] == r["actual"] for r in ok),
            "cross_namespace_hits": sum(bool(r["actual"]) for r in firsts[1:]),
            "repeat_hits": sum(bool(r["actual"]) for r in repeats)}


def save_capture(directory: Path, timed: Sequence[tuple[float, Sequence[bytes]]],
                 doc: dict[str, Any]) -> None:
    """The live messages ``[topic, seq, payload]`` that hold a BlockStored (warm-up ones
    included: the index replays them in order), msgpack, with what the run found."""
    import msgpack

    frames = [list(f) for _, f in timed if len(f) == 3]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "live.msgpack").write_bytes(msgpack.packb(frames))
    (directory / "README.md").write_text(
        "Raw ZMQ messages of a real vLLM 0.32 CPU (`--enable-lora`, block 128) captured by "
        "`python -m radixmesh.bench.vllm_tenants --capture DIR`: one 1,641-token prompt "
        "stored under two `cache_salt` namespaces, none, the LoRA adapter `ad1`, and `ad1` + "
        "a salt (the salts are the node's namespace ids).\n\n"
        f"```json\n{json.dumps({'verdict': doc['verdict'], 'shapes': doc['shapes']}, indent=2)}"
        "\n```\n", encoding="utf-8")


def markdown(doc: dict[str, Any]) -> str:
    v = doc["verdict"]
    lines = [f"vLLM {doc['vllm']} CPU (`--enable-lora`, adapter `{ADAPTER}`: random PEFT "
             f"rank 8 on q/v), one node, {doc['date']}; one prompt of "
             f"{doc['rows'][0]['prompt_tokens']} tokens, one request in flight.", "",
             "| # | cache_salt | adapter | node predicted | engine cached |",
             "|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['step']} | {r['cache_salt'] or '—'} | {r['adapter'] or '—'} | "
                     f"{r['predicted']} | {r['actual']} |")
    lines += ["", f"index == engine {v['index_equals_engine']}/{v['answered']}; hits on a "
              f"namespace's first request (another namespace holding the tokens) "
              f"{v['cross_namespace_hits']}; repeats that hit {v['repeat_hits']}/"
              f"{len(doc['rows']) // 2}.", "", "Event shapes: " + json.dumps(doc["shapes"])]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = vllm_parser("radixmesh.bench.vllm_tenants", __doc__, "runs/vllm-tenants")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--num-blocks", type=int, default=48)
    ap.add_argument("--gossip-interval", default="0.1")
    ap.add_argument("--capture", metavar="DIR", help="save the steps' raw event batches (the "
                    "salted and LoRA stores: a CI fixture)")
    return ap.parse_args(argv)


def run(args: argparse.Namespace, out: Path) -> tuple[list[dict[str, Any]], Any, Capture]:
    """The engine, the node, the steps: the rows, the node's index counters, the capture."""
    model_dir = save_model_dir(out / "model", 0)
    adapter = save_random_adapter(out / "adapter", model_dir)
    port, events, replay = free_ports(3)
    engine = VllmServer("vllm0", args.vllm_python, model_dir, port, events, replay,
                        args.block_size, args.num_blocks, out / "vllm0.log",
                        extra_args=("--enable-lora", "--lora-modules", f"{ADAPTER}={adapter}",
                                    "--max-lora-rank", "8", "--max-loras", "1"))
    options = node_options("cost", args, model_dir) | {"adapters": f"{ADAPTER}={adapter}"}
    per_node = {0: {"engine_url": engine.url, "kv_events": f"tcp://*:{events}",
                    "kv_replay": f"tcp://*:{replay}"}}
    prompt = "A system prompt both tenants were given, word for word. " * 40
    try:
        engine.start()
        engine.wait_ready(time.monotonic() + READY_TIMEOUT_S)
        capture = Capture([f"tcp://127.0.0.1:{events}"])
        try:
            with LocalCluster(1, options, per_node=per_node, log_dir=out / "nodes",
                              python=sys.executable) as cluster:
                wait_subscribed(cluster)
                rows = asyncio.run(run_steps(cluster, capture, prompt))
                time.sleep(0.5)
                kv = (cluster.mesh(0).get("kv_events") or {}).get("index")
        finally:
            capture.close()
    finally:  # every process it started goes, whatever happened
        engine.stop()
    return rows, kv, capture


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, kv, capture = run(args, out)
    doc = {"vllm": vllm_version(args.vllm_python), "date": time.strftime("%Y-%m-%d %H:%M"),
           "rows": rows, "verdict": verdict(rows), "node_index": kv,
           "shapes": event_shapes(capture.timed[0]),
           "command": " ".join(["python -m radixmesh.bench.vllm_tenants",
                                *(argv or sys.argv[1:])])}
    (out / "vllm_tenants.json").write_text(json.dumps(doc, indent=2), encoding="utf-8")
    if args.capture:
        save_capture(Path(args.capture), capture.timed[0], doc)
    text = markdown(doc)
    (out / "vllm_tenants.md").write_text(text, encoding="utf-8")
    print(text)
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
