"""A fake vLLM / SGLang-compatible engine for tests: real prefix cache, real KV events.

Theory of operation
-------------------
One object serves, on 127.0.0.1 only:

* HTTP (aiohttp.web): ``POST /v1/completions`` (vLLM / OpenAI shape: token-id prompt, SSE
  chunks with ``token_id:N`` logprob tokens when ``return_tokens_as_token_ids`` is set, a usage
  chunk with ``prompt_tokens_details.cached_tokens``, ``data: [DONE]``), ``POST /generate``
  (SGLang shape: cumulative ``output_ids`` and ``meta_info``), ``GET /v1/models``;
* a ZMQ PUB socket with vLLM-style KV events (msgpack maps: multi-block ``BlockStored`` with
  token ids, ``BlockRemoved`` on eviction, ``AllBlocksCleared``), frames ``[topic, seq(8-byte
  BE), payload]``; it binds (the subscriber connects), or connects to ``kv_connect`` (the
  subscriber binds);
* a ZMQ ROUTER replay socket holding the last ``replay_keep`` batches, answering in vLLM
  0.32's framing ``[topic, seq, payload]`` (``replay_topic = False``: the older ``[seq,
  payload]``).

The cache is a real ``core.prefix_cache.PrefixCache[None]`` of token ids under a small budget,
so requests evict; its own block hashes use a seed of its own (engine hashes are never mesh
keys). Each mutation's journal (``drain_delta``) becomes one event batch. "Generation" is
deterministic: next token = 32 + (sum of the last 4 tokens) % 95, printable ASCII, so the byte
tokenizer round-trips the text. Knobs (attributes) inject faults: ``skip_live`` batches not
published live (kept for replay unless ``skip_replay``), ``duplicate_next``, ``restart()``
(seq back to 0, empty cache, no event), ``publish_malformed()``, ``replay_enabled``,
``token_delay_s``, ``barrier`` (hold generation until that many requests are in flight,
bounded), ``fail_status``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from aiohttp import web

from radixmesh.core.blocks import block_hashes
from radixmesh.core.prefix_cache import PrefixCache

ENGINE_SEED = 0x5EED_E061_E000_0001  # the fake engine's own block-hash seed
BARRIER_WAIT_S = 5.0
TOPIC = b"kv-events"
Emit = Callable[[int], Awaitable[None]]


def next_token(seq: Sequence[int]) -> int:
    """The fake model: deterministic, printable ASCII."""
    return 32 + sum(seq[-4:]) % 95


class FakeEngine:
    """See the module docstring. ``await start()``, then ``url`` / ``kv_endpoint`` /
    ``replay_endpoint``; ``await stop()`` ends everything (also a "kill" mid-test)."""

    def __init__(self, *, block_size: int = 16, cache_tokens: int = 512, replay_keep: int = 64,
                 model: str = "fake-model", kv_connect: str | None = None, port: int = 0,
                 kv_port: int = 0, replay_port: int = 0) -> None:
        self.ports = (port, kv_port, replay_port)  # 0: any free port
        self.block_size = block_size
        self.cache_tokens = cache_tokens
        self.model = model
        self.kv_connect = kv_connect
        self.cache: PrefixCache[None] = PrefixCache(cache_tokens, block_size, ENGINE_SEED)
        self._blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # hash -> parent, toks
        self._replay: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=replay_keep)
        self.seq = 0
        # knobs
        self.token_delay_s = 0.0
        self.barrier = 0
        self.fail_status: int | None = None
        self.report_cached = True
        self.skip_live = 0
        self.skip_replay = False
        self.duplicate_next = 0
        self.replay_enabled = True
        self.replay_topic = True  # vLLM 0.32 replay framing [topic, seq, payload]; False: older
        # observations
        self.requests = 0
        self.active = 0
        self.peak_active = 0
        self.disconnects = 0
        self.published = 0
        self._ctx = zmq.asyncio.Context()
        self._runner: web.AppRunner | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.url = self.kv_endpoint = self.replay_endpoint = ""

    # ------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.ports[0])
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        self._open_zmq()
        self._replay_task = asyncio.create_task(self._serve_replay())

    def _open_zmq(self) -> None:
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        if self.kv_connect:
            self._pub.connect(self.kv_connect)
            self.kv_endpoint = self.kv_connect
        else:
            port = _bind(self._pub, self.ports[1])
            self.kv_endpoint = f"tcp://*:{port}"  # as an engine's config says it: it binds
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self.replay_endpoint = f"tcp://*:{_bind(self._router, self.ports[2])}"

    async def stop(self) -> None:
        if self._ctx.closed:
            return
        if self._replay_task is not None:
            self._replay_task.cancel()
            await asyncio.gather(self._replay_task, return_exceptions=True)
            self._replay_task = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._pub.close(0)
        self._router.close(0)
        self._ctx.term()

    # ------------------------------------------------------------------------- faults
    def restart(self) -> None:
        """A new engine incarnation: empty cache, seq from 0, nothing replayable, no event."""
        self.cache = PrefixCache(self.cache_tokens, self.block_size, ENGINE_SEED)
        self._blocks.clear()
        self._replay.clear()
        self.seq = 0

    def clear_all(self) -> None:
        """The engine drops its cache and says so (AllBlocksCleared)."""
        self.cache.clear()
        self.cache.drain_delta()
        self._publish([{"type": "AllBlocksCleared"}])

    def publish_malformed(self) -> None:
        """One batch (next seq) whose payload is not a valid event batch."""
        self._send(msgpack.packb({"ts": "not a number", "events": 7}))

    # ------------------------------------------------------------------------- the truth
    def block_prefixes(self) -> list[tuple[int, ...]]:
        """The full token prefix ending at each block the cache holds now."""
        out = []
        for h in self.cache.block_hashes():
            chain: list[tuple[int, ...]] = []
            key: int | None = h
            while key is not None:
                parent, tokens = self._blocks[key]
                chain.append(tokens)
                key = parent
            out.append(tuple(t for toks in reversed(chain) for t in toks))
        return out

    # ------------------------------------------------------------------------- HTTP
    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.fail_status:
            return web.json_response({"error": {"message": "injected"}}, status=self.fail_status)
        prompt = [int(t) for t in body["prompt"]]
        ids_wanted = bool(body.get("return_tokens_as_token_ids"))
        resp = await _sse_response(request)

        async def emit(tok: int) -> None:
            logprobs = {"tokens": [f"token_id:{tok}"]} if ids_wanted else None
            await _send_event(resp, {"object": "text_completion", "model": self.model,
                                     "choices": [{"index": 0, "text": chr(tok),
                                                  "logprobs": logprobs, "finish_reason": None}]})

        out, finish, cached = await self._run(prompt, body, emit)
        if out is not None:
            await _send_event(resp, {"choices": [{"index": 0, "text": "",
                                                  "finish_reason": finish}]})
            await _send_event(resp, {"choices": [], "usage": self._usage(prompt, out, cached)})
            await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.fail_status:
            return web.json_response({"error": "injected"}, status=self.fail_status)
        prompt = [int(t) for t in body["input_ids"]]
        params = body.get("sampling_params") or {}
        resp = await _sse_response(request)
        out_ids: list[int] = []
        meta: dict[str, Any] = {"prompt_tokens": len(prompt), "finish_reason": None}

        async def emit(tok: int) -> None:
            out_ids.append(tok)
            meta["completion_tokens"] = len(out_ids)
            await _send_event(resp, {"text": "".join(map(chr, out_ids)),
                                     "output_ids": list(out_ids), "meta_info": meta})

        options = {"max_tokens": params.get("max_new_tokens", 16),
                   "stop_token_ids": params.get("stop_token_ids")}
        out, finish, cached = await self._run(prompt, options, emit)
        if out is not None:
            meta.update(finish_reason={"type": finish}, cached_tokens=cached)
            await _send_event(resp, {"text": "".join(map(chr, out_ids)),
                                     "output_ids": list(out_ids), "meta_info": meta})
            await resp.write(b"data: [DONE]\n\n")
        return resp

    def _usage(self, prompt: list[int], out: list[int], cached: int) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": len(prompt), "completion_tokens": len(out),
                                 "total_tokens": len(prompt) + len(out)}
        if self.report_cached:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    # ------------------------------------------------------------------------- "model"
    async def _run(self, prompt: list[int], body: dict[str, Any], emit: Emit
                   ) -> tuple[list[int] | None, str, int]:
        """Generate; (None, ...) when the client went away (counted in ``disconnects``)."""
        max_tokens = int(body.get("max_tokens") or 16)
        stops = set(body.get("stop_token_ids") or ())
        self.requests += 1
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)
        lease = self.cache.acquire(prompt, self.cache.reserve_for(prompt, max_tokens),
                                   time.monotonic())
        self._publish_delta(prompt)
        out: list[int] = []
        try:
            await self._wait_barrier()
            finish = await self._decode(prompt, out, max_tokens, stops, emit)
        except (ConnectionError, asyncio.CancelledError):
            self.disconnects += 1
            return None, "stop", lease.cached
        finally:
            self.active -= 1
            seq = [*prompt, *out[:-1]]
            self.cache.commit(lease, seq, time.monotonic())
            self._publish_delta(seq)
        return out, finish, lease.cached

    async def _decode(self, prompt: list[int], out: list[int], max_tokens: int,
                      stops: set[int], emit: Emit) -> str:
        for _ in range(max_tokens):
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            tok = next_token([*prompt[-4:], *out[-4:]])
            out.append(tok)
            await emit(tok)
            if tok in stops:
                return "stop"
        return "length"

    async def _wait_barrier(self) -> None:
        deadline = time.monotonic() + BARRIER_WAIT_S
        while self.active < self.barrier and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    # ------------------------------------------------------------------------- KV events
    def _publish_delta(self, seq: Sequence[int]) -> None:
        added, removed = self.cache.drain_delta()
        events: list[dict[str, Any]] = []
        if removed:
            events.append({"type": "BlockRemoved", "block_hashes": list(removed),
                           "medium": "GPU"})
        if added:
            events += self._stored_events(set(added), seq)
        if events:
            self._publish(events)

    def _stored_events(self, added: set[int], seq: Sequence[int]) -> list[dict[str, Any]]:
        """Multi-block BlockStored events: one per run of consecutive new blocks of ``seq``."""
        bs = self.block_size
        hashes = block_hashes(seq, bs, ENGINE_SEED)
        events: list[dict[str, Any]] = []
        for i, h in enumerate(hashes):
            if h not in added:
                continue
            parent = hashes[i - 1] if i else None
            self._blocks[h] = (parent, tuple(seq[i * bs:(i + 1) * bs]))
            if events and events[-1]["block_hashes"][-1] == parent:
                events[-1]["block_hashes"].append(h)
                events[-1]["token_ids"].extend(seq[i * bs:(i + 1) * bs])
                continue
            event: dict[str, Any] = {"type": "BlockStored", "block_hashes": [h],
                                     "token_ids": list(seq[i * bs:(i + 1) * bs]),
                                     "block_size": bs, "medium": "GPU"}
            if parent is not None:
                event["parent_block_hash"] = parent
            events.append(event)
        return events

    def _publish(self, events: list[dict[str, Any]]) -> None:
        batch = {"ts": time.time(), "events": events, "data_parallel_rank": 0}
        self._send(msgpack.packb(batch))

    def _send(self, payload: bytes) -> None:
        seq, self.seq = self.seq, self.seq + 1
        frames = [TOPIC, seq.to_bytes(8, "big"), payload]
        if self.skip_live > 0:
            self.skip_live -= 1
            if not self.skip_replay:
                self._replay.append((seq, payload))
            return
        self._replay.append((seq, payload))
        copies = 2 if self.duplicate_next > 0 else 1
        self.duplicate_next = max(self.duplicate_next - 1, 0)
        for _ in range(copies):
            self._pub.send_multipart(frames, flags=zmq.NOBLOCK)
        self.published += 1

    async def _serve_replay(self) -> None:
        while True:
            frames = await self._router.recv_multipart()
            if not self.replay_enabled or len(frames) != 3:
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            topic = [TOPIC] if self.replay_topic else []
            for seq, payload in list(self._replay):
                if seq >= start:
                    await self._router.send_multipart([ident, b"", *topic,
                                                       seq.to_bytes(8, "big"), payload])
            end = (-1).to_bytes(8, "big", signed=True)
            # vLLM 0.32's end marker: [b"", b"", -1, b""] (an empty topic); older: [b"", -1, b""]
            await self._router.send_multipart([ident, b"", *([b""] if topic else []), end, b""])


def _bind(sock: Any, port: int) -> int:
    """Bind on loopback, to ``port`` or (0) any free one; the port bound."""
    if port:
        sock.bind(f"tcp://127.0.0.1:{port}")
        return port
    return int(sock.bind_to_random_port("tcp://127.0.0.1"))


async def _sse_response(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    return resp


async def _send_event(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")


@contextlib.asynccontextmanager
async def running(**kwargs: Any) -> Any:
    """``async with running() as fake:`` a started fake engine, stopped at the end."""
    fake = FakeEngine(**kwargs)
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()


async def _serve_forever(args: Any) -> None:
    fake = FakeEngine(port=args.port, kv_port=args.kv_port, replay_port=args.replay_port,
                      cache_tokens=args.cache_tokens, model=args.model)
    await fake.start()
    print(f"fake engine {fake.url} events {fake.kv_endpoint} replay {fake.replay_endpoint}",
          flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await fake.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m radixmesh.testing.fake_engine --port P --kv-port K --replay-port R``: one
    fake engine as a process (for ``serve --launch`` tests); SIGTERM stops it."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m radixmesh.testing.fake_engine")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--kv-port", type=int, default=0)
    ap.add_argument("--replay-port", type=int, default=0)
    ap.add_argument("--cache-tokens", type=int, default=4096)
    ap.add_argument("--model", default="fake-model")
    asyncio.run(_serve_forever(ap.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
