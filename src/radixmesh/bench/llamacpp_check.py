"""``make llamacpp-check``: llama.cpp servers behind radixmesh nodes (``--engine llamacpp``, or
``--engine openai`` for the generic LRU view).

Theory of operation
-------------------
llama.cpp publishes no KV events, so a node in front of it guesses what it holds: with
``--engine openai`` an LRU of the prompts and outputs it sent (``engine/http_engine.py``); with
``--engine llamacpp`` llama.cpp's own slot choice and prompt cache replayed
(``core/llamacpp_slots.py``). This check measures how good the guess is and what routing on
it buys::

    save_model_dir (bench/vllm_check.py: the random-weight Qwen2 "tiny")
        --> bench/gguf_model.py (in the llama.cpp venv) --> tiny.gguf
    N x  llama-server -m tiny.gguf --port P -c CTX -np 1 -t 1   (its own process group)
    for policy in (cost, none): N x radixmesh serve --engine E --engine-url ...
        --tokenizer DIR (peers of each other); the same requests, CONCURRENCY in flight,
        entry round-robin; the servers restarted between policies (empty caches)

Per request: the serving node's predicted cached tokens at acceptance
(``x-radixmesh-cached-tokens`` of a stream) against what llama.cpp says it reused
(``timings.cache_n``, which the node passes on as the usage's
``prompt_tokens_details.cached_tokens``); every mismatch classified by replaying llama.cpp's
rules (``bench/llamacpp_mismatch.py``). The nodes' ``--cache-tokens`` defaults, for
``llamacpp``, to llama.cpp's default prompt cache (8192 MiB) in tokens of this model's F16 KV.
Written to ``OUT/llamacpp_check.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from radixmesh.bench.llamacpp_mismatch import classify
from radixmesh.bench.vllm_replay import _ms, _pct, build_workload, send_stream
from radixmesh.bench.vllm_server import save_model_dir, stop_group, tail
from radixmesh.core.blocks import DEFAULT_BLOCK_SIZE
from radixmesh.engine.tokenizers import HFTokenizer
from radixmesh.results.records import Record
from radixmesh.results.run_summary import summarize
from radixmesh.runtime.cluster import LocalCluster, free_ports
from radixmesh.workload.request import Request

CACHE_RAM_MIB = 8192  # llama-server's default --cache-ram (common/common.h)


def kv_bytes_per_token(model_dir: Path) -> int:
    """F16 K and V of every layer (llama-server's default KV type), from config.json."""
    cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim


@dataclass(slots=True)
class LlamaServer:
    binary: str
    gguf: Path
    port: int
    log_path: Path
    ctx: int = 8192
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        argv = [self.binary, "-m", str(self.gguf), "--host", "127.0.0.1", "--port",
                str(self.port), "-c", str(self.ctx), "-np", "1", "-t", "1"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited:\n{tail(self.log_path)}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"llama-server not ready:\n{tail(self.log_path)}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)


async def run_requests(urls: Sequence[str], reqs: Sequence[Request], policy: str,
                       concurrency: int) -> tuple[list[Record], dict[int, int]]:
    """Closed loop; returns the records and llama.cpp's cached tokens per ok request
    (by ``seq``)."""
    queue = list(enumerate(reqs))[::-1]
    records: list[Record] = []
    actuals: dict[int, int] = {}
    t0 = time.perf_counter()

    async def worker(http: httpx.AsyncClient) -> None:
        while queue:
            seq, req = queue.pop()
            entry = seq % len(urls)
            rec = Record(run="llamacpp-check", policy=policy, seq=seq, id=req.id,
                         group=req.group, entry=entry, entry_node=str(entry),
                         t_send=time.perf_counter() - t0)
            actual = await send_stream(http, urls[entry], req, rec, t0)
            records.append(rec)
            if rec.ok and actual is not None:
                actuals[seq] = actual

    async with httpx.AsyncClient(timeout=600.0, trust_env=False) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    records.sort(key=lambda r: r.seq)
    return records, actuals


def one_policy(policy: str, args: argparse.Namespace, model_dir: Path, gguf: Path,
               out: Path, reqs: Sequence[Request]) -> dict[str, Any]:
    ports = free_ports(args.servers)
    servers = [LlamaServer(args.llama_server, gguf, p, out / f"llama{i}-{policy}.log")
               for i, p in enumerate(ports)]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        options = {"policy": policy, "log_level": "warning", "engine": args.engine,
                   "tokenizer": str(model_dir), "model": "tiny", "threads": 1,
                   "gossip_interval": args.gossip_interval,
                   "cache_tokens": args.cache_tokens}
        per_node = {i: {"engine_url": s.url} for i, s in enumerate(servers)}
        with LocalCluster(args.servers, options, per_node=per_node,
                          log_dir=out / f"nodes-{policy}", python=sys.executable) as cluster:
            records, actuals = asyncio.run(run_requests(cluster.urls, reqs, policy,
                                                      args.concurrency))
    finally:
        for s in servers:
            s.stop()
    summary = summarize(records)
    rows = [{"seq": r.seq, "served_by": r.served_by, "t_send": r.t_send, "t_done": r.t_done,
             "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
             "predicted": r.cached_tokens or 0, "actual": actuals[r.seq]}
            for r in records if r.seq in actuals]
    pairs = [(row["predicted"], row["actual"]) for row in rows]
    equal = sum(p == a for p, a in pairs)
    mae = sum(abs(p - a) for p, a in pairs) / len(pairs) if pairs else None
    return {"policy": policy, "summary": summary, "requests": len(records),
            "compared": len(pairs), "predicted_equal": equal, "mean_abs_error_tokens": mae,
            "over": sum(p > a for p, a in pairs), "under": sum(p < a for p, a in pairs),
            "rows": rows}


def markdown(res: dict[str, Any]) -> str:
    view = "slot model" if res["engine"] == "llamacpp" else "LRU view"
    lines = [f"llama.cpp server ({res['servers']} servers, one slot each), random-weight Qwen2 "
             f"`tiny` as GGUF F32; {res['requests']} requests, {res['concurrency']} in flight, "
             f"entry round-robin; nodes with `--engine {res['engine']}` ({view}).", "",
             "| policy | predicted == llama.cpp | over / under | mean abs error | hit rate | "
             "mean latency | p99 latency | errors |", "|---|---|---|---|---|---|---|---|"]
    for p in res["policies"]:
        s = p["summary"]
        mae = "n/a" if p["mean_abs_error_tokens"] is None else f"{p['mean_abs_error_tokens']:.0f}"
        lines.append(f"| {p['policy']} | {p['predicted_equal']}/{p['compared']} | "
                     f"{p['over']} / {p['under']} | {mae} tokens | "
                     f"{_pct(s['actual_hit_rate'])} | {_ms(s['mean_latency_s'])} | "
                     f"{_ms(s['p99_latency_s'])} | {s['errors']} |")
    lines.append("")
    for p in res["policies"]:
        m = p["mismatches"]
        classes = ", ".join(f"{k}: {v}" for k, v in m["classes"].items()) or "none"
        lines.append(f"- {p['policy']}: mismatches {classes}; llama.cpp's slot rule replayed "
                     f"(bench/llamacpp_mismatch.py) == llama.cpp on {m['slot_model_equal']}/"
                     f"{p['compared']}")
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m radixmesh.bench.llamacpp_check",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", default=".venv-llamacpp/bin/llama-server")
    ap.add_argument("--gguf-python", default=".venv-llamacpp/bin/python",
                    help="a python with the gguf package (writes the model)")
    ap.add_argument("--out", default="runs/llamacpp-check")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--policies", default="cost,none")
    ap.add_argument("--engine", default="llamacpp", choices=("openai", "llamacpp"),
                    help="the nodes' --engine: openai (LRU view) or llamacpp (slot view)")
    ap.add_argument("--cache-tokens", type=int, default=None,
                    help="the nodes' --cache-tokens (default: 16384 for openai; for llamacpp "
                    "llama.cpp's default --cache-ram, 8192 MiB, in tokens of the model's KV)")
    ap.add_argument("--gossip-interval", default="0.1")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = save_model_dir(out / "model", 0)
    if args.cache_tokens is None:
        args.cache_tokens = (CACHE_RAM_MIB * 2**20 // kv_bytes_per_token(model_dir)
                             if args.engine == "llamacpp" else 16384)
    gguf = out / "tiny.gguf"
    script = Path(__file__).with_name("gguf_model.py")
    subprocess.run([args.gguf_python, str(script), str(model_dir), str(gguf)], check=True,
                   timeout=300)
    reqs = build_workload(args.requests, 8, 0.5, 0)
    res = {"servers": args.servers, "requests": len(reqs), "concurrency": args.concurrency,
           "engine": args.engine,
           "policies": [one_policy(p, args, model_dir, gguf, out, reqs)
                        for p in args.policies.split(",")]}
    tokenizer = HFTokenizer(model_dir)
    prompts = {i: tokenizer.encode(r.prompt or "") for i, r in enumerate(reqs)}
    for p in res["policies"]:
        p["mismatches"] = classify(p["rows"], prompts, DEFAULT_BLOCK_SIZE)
    (out / "llamacpp_check.json").write_text(json.dumps(res, indent=2), encoding="utf-8")
    text = markdown(res)
    (out / "llamacpp_check.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
