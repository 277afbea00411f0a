"""The emulated engine's HTTP server: vLLM 0.32's OpenAI-compatible surface over ``EngineLoop``.

Theory of operation
-------------------
:class:`EmulatedEngine` owns one aiohttp application, one :class:`~.loop.EngineLoop` task and
one :class:`~.events.KvEventPublisher` (when KV events are asked for). Routes:

* ``POST /v1/completions``, ``POST /v1/chat/completions``: parse (``protocol.parse``; a bad
  body is a 400 in vLLM's error shape, a ``model`` other than the served one a 404, both
  counted in ``bad_requests``), submit one sequence per prompt to the loop, then either
  stream SSE chunks (one per token, the finish reason on the last token's chunk, a usage
  chunk when ``stream_options.include_usage``, ``data: [DONE]``) or answer one JSON object;
* ``POST /generate``: SGLang's shape (``input_ids``, ``sampling_params``, ``cache_salt``;
  cumulative ``output_ids``, ``meta_info.cached_tokens``), for the node's ``--engine sglang``;
* ``GET /v1/models``, ``/health``, ``/version`` (vLLM's version this surface pins; all three
  name the profile and say ``emulated``), ``/metrics`` (Prometheus text, ``metrics.render``).

A client that goes away aborts its sequences (``disconnects``). No request crashes the
server: other routes or methods are a JSON 404 / 405, the unexpected a 500 in the error shape."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import zmq.asyncio
from aiohttp import web

from radixmesh.core.prefix_cache import PrefixCache
from radixmesh.core.profile import Profile
from radixmesh.core.scheduler import Finished
from radixmesh.emulate import metrics, protocol
from radixmesh.emulate.events import Faults, KvEventPublisher, cancel
from radixmesh.emulate.loop import ENGINE_SEED, EngineLoop, TokenSink
from radixmesh.engine.base import Tokenizer
from radixmesh.engine.tokenizers import ByteTokenizer

log = logging.getLogger("radixmesh.emulate")
Emit = Callable[[int, Any], Awaitable[None]]


class EmulatedEngine:
    """See the module docstring. ``await start()``, then ``url`` (and ``kv_endpoint`` /
    ``replay_endpoint`` when events are on); ``await stop()`` ends everything."""

    def __init__(self, profile: Profile, *, model: str | None = None,
                 tokenizer: Tokenizer | None = None, host: str = "127.0.0.1", port: int = 0,
                 time_scale: float = 1.0, kv_events: str | None = None,
                 kv_replay: str | None = None, kv_connect: bool = False,
                 replay_keep: int = 64, vocab_size: int | None = None,
                 adapters: tuple[str, ...] = ()) -> None:
        self.profile = profile
        self.model = model or default_model_name(profile)
        self.adapters = (*profile.adapters, *adapters)  # LoRA adapters served by name
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        self.vocab_size = vocab_size or self.tokenizer.vocab_size  # prompt ids must be below
        self.host, self.port = host, port
        self.faults = Faults()
        self._ctx: zmq.asyncio.Context | None = None
        self.events: KvEventPublisher | None = None
        self._kv = (kv_events, kv_replay or _any_port(kv_events), kv_connect)
        if kv_events is not None:
            self.events = KvEventPublisher(block_size=profile.block_size,
                                           seed=ENGINE_SEED, faults=self.faults,
                                           replay_keep=replay_keep)
        self.loop = EngineLoop(profile, faults=self.faults, time_scale=time_scale,
                               events=self.events)
        self.bad_requests = self.disconnects = 0
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[_errors])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5, handler_cancellation=True,
                                     access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{'127.0.0.1' if self.host in ('0.0.0.0', '') else self.host}:{port}"
        publish, replay, connect = self._kv
        self._ctx = zmq.asyncio.Context()
        if self.events is not None and publish is not None:
            self.events.open(self._ctx, publish, replay, connect=connect)
            self._tasks.append(asyncio.create_task(self.events.serve_replay()))
        self._tasks.append(asyncio.create_task(self.loop.run()))

    async def stop(self) -> None:
        if self._ctx is None or self._ctx.closed:
            return
        for task in self._tasks:
            await cancel(task)
        self._tasks.clear()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.events is not None:
            self.events.close()
        self._ctx.term()

    @property
    def kv_endpoint(self) -> str:
        return self.events.kv_endpoint if self.events else ""

    @property
    def replay_endpoint(self) -> str:
        return self.events.replay_endpoint if self.events else ""

    # ------------------------------------------------------------------------- state / faults
    @property
    def cache(self) -> PrefixCache[None]:
        """The scheduler's prefix cache (read it only)."""
        return self.loop.scheduler.cache

    @property
    def seq(self) -> int:
        """The next KV-event batch's sequence number."""
        return self.events.seq if self.events else 0

    def block_prefixes(self) -> list[tuple[int, ...]]:
        """The full token prefix ending at each block the cache holds now."""
        assert self.events is not None, "KV events are off"
        return self.events.block_prefixes(self.cache.block_hashes())

    def restart(self) -> None:
        """A new incarnation: running requests aborted, empty cache, seq from 0, no event."""
        self.loop.restart()

    def clear_all(self) -> bool:
        """Drop the cache and publish AllBlocksCleared (False, nothing done, while busy)."""
        return self.loop.clear_cache()

    def publish_malformed(self) -> None:
        assert self.events is not None, "KV events are off"
        self.events.publish_malformed()

    def describe(self) -> dict[str, Any]:
        p = self.profile
        return {"emulated": True, "profile": p.name, "hardware": p.hardware,
                "profile_model": p.model, "derived": p.derived, "source": p.source,
                "time_scale": self.loop.time_scale}

    # ------------------------------------------------------------------------- small routes
    async def _models(self, _: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "created": 0, "owned_by": "vllm",
                "root": self.model, "parent": None, "max_model_len": self.profile.context_length,
                "permission": [], **self.describe()}
        loras = [{**card, "id": name, "root": name, "parent": self.model}
                 for name in self.adapters]
        return web.json_response({"object": "list", "data": [card, *loras]})

    async def _health(self, _: web.Request) -> web.Response:
        while self.faults.stalled:  # fault knob: a stopped process answers nothing
            await asyncio.sleep(0.01)
        return web.json_response({"status": "ok", **self.describe()})

    async def _version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": protocol.VLLM_VERSION, **self.describe()})

    async def _metrics(self, _: web.Request) -> web.Response:
        text = metrics.render(self.loop, self.model, {
            "bad_requests": self.bad_requests, "disconnects": self.disconnects,
            "kv_event_batches": self.events.published if self.events else 0})
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    # ------------------------------------------------------------------------- generation
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=True)

    async def _openai(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await _json(request)
            if self.faults.fail_status:
                return _error("injected failure", self.faults.fail_status)
            if isinstance(body, dict) and body.get("model") not in (None, self.model,
                                                                    *self.adapters):
                self.bad_requests += 1  # vLLM's check_model: 404
                return _error(f"The model `{body['model']}` does not exist.", 404, "model")
            req = protocol.parse(body, self.tokenizer, self.profile.context_length, chat=chat,
                                 vocab=self.vocab_size)
            if body.get("model") in self.adapters:
                req = replace(req, lora=body["model"])
            async with self._sequences(req) as (sink, n):
                if req.stream:
                    return await self._stream(request, req, sink, n)
                return await self._whole(req, sink, n)
        except protocol.BadRequest as exc:
            self.bad_requests += 1
            return _error(str(exc), 400, exc.param)

    @contextlib.asynccontextmanager
    async def _sequences(self, req: protocol.Completion) -> AsyncIterator[tuple[TokenSink, int]]:
        """Submit one sequence per prompt; abort the unfinished ones when the client goes."""
        sink: TokenSink = asyncio.Queue()
        seqs: list[int] = []
        await self.loop.admission()  # HTTP, tokenising, the hop to the engine core
        try:
            for i, (prompt, max_tokens) in enumerate(zip(req.prompts, req.max_tokens,
                                                         strict=True)):
                seqs.append(self.loop.submit(prompt, max_tokens, req.stop_ids, sink, i,
                                             req.cache_salt, req.lora))
        except ValueError as exc:
            for seq in seqs:
                self.loop.abort(seq)
            raise protocol.BadRequest(str(exc), "max_tokens") from exc
        try:
            yield sink, len(seqs)
        except (ConnectionError, asyncio.CancelledError):
            self.disconnects += 1
            for seq in seqs:
                self.loop.abort(seq)
            raise

    async def _collect(self, sink: TokenSink, n: int, emit: Emit,
                       on_finish: Emit | None = None,
                       flush: Callable[[], Awaitable[None]] | None = None) -> list[Finished]:
        """Feed ``emit(index, token)`` (and ``on_finish(index, record)``) until all ``n``
        sequences finished; their records, by index. ``flush()`` runs whenever the sink is
        empty: the loop puts a whole step's tokens and finishes in at once, so a token held
        until then learns whether it was its sequence's last."""
        done: list[Finished | None] = [None] * n
        left = n
        while left:
            if sink.empty() and flush is not None:
                await flush()
            index, item = await sink.get()
            if isinstance(item, int):
                await emit(index, item)
                continue
            done[index] = item
            left -= 1
            if on_finish is not None:
                await on_finish(index, item)
        return [f for f in done if f is not None]

    async def _whole(self, req: protocol.Completion, sink: TokenSink, n: int) -> web.Response:
        outs: list[list[int]] = [[] for _ in range(n)]

        async def emit(index: int, tok: int) -> None:
            outs[index].append(tok)

        done = await self._collect(sink, n, emit)
        choices = [protocol.choice(i, self.tokenizer.decode(outs[i]),
                                   protocol.logprobs_of(outs[i], req, self.tokenizer, 0),
                                   done[i], req, chunk=False) for i in range(n)]
        body = protocol.envelope(protocol.new_id(req.chat), self.model, req, choices, chunk=False)
        body["usage"] = protocol.usage(done, self.faults.report_cached)
        return web.json_response(body)

    async def _stream(self, request: web.Request, req: protocol.Completion, sink: TokenSink,
                      n: int) -> web.StreamResponse:
        resp = await _sse_response(request)
        rid = protocol.new_id(req.chat)
        offsets, sent = [0] * n, [0] * n
        pending: list[int | None] = [None] * n  # each one's last token, held for its finish

        async def send(index: int, tok: int | None, fin: Finished | None) -> None:
            toks = [] if tok is None else [tok]
            text = self.tokenizer.decode(toks)
            lp = protocol.logprobs_of(toks, req, self.tokenizer, offsets[index])
            offsets[index] += len(text)
            first = sent[index] == 0
            sent[index] += 1
            ch = protocol.choice(index, text, lp, fin, req, chunk=True, first=first)
            await _event(resp, protocol.envelope(rid, self.model, req, [ch], chunk=True))

        async def emit(index: int, tok: int) -> None:
            held, pending[index] = pending[index], tok
            if held is not None:
                await send(index, held, None)

        async def finish(index: int, fin: Finished) -> None:
            held, pending[index] = pending[index], None
            await send(index, held, fin)

        async def flush() -> None:
            for index, held in enumerate(pending):
                if held is not None:
                    pending[index] = None
                    await send(index, held, None)

        done = await self._collect(sink, n, emit, finish, flush)
        if req.include_usage:
            tail = protocol.envelope(rid, self.model, req, [], chunk=True)
            tail["usage"] = protocol.usage(done, self.faults.report_cached)
            await _event(resp, tail)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        """SGLang ``/generate`` (streaming): cumulative ``output_ids`` and ``meta_info``."""
        try:
            body = await _json(request)
            if self.faults.fail_status:
                return _error("injected failure", self.faults.fail_status)
            req = protocol.sglang_request(body, self.tokenizer, self.profile.context_length,
                                  self.vocab_size)
            async with self._sequences(req) as (sink, n):
                resp = await _sse_response(request)
                out: list[int] = []
                meta: dict[str, Any] = {"prompt_tokens": len(req.prompts[0]),
                                        "finish_reason": None}

                async def emit(_: int, tok: int) -> None:
                    out.append(tok)
                    meta["completion_tokens"] = len(out)
                    await _event(resp, {"text": self.tokenizer.decode(out),
                                        "output_ids": list(out), "meta_info": meta})

                (fin,) = await self._collect(sink, n, emit)
                meta.update(finish_reason={"type": fin.reason}, cached_tokens=fin.cached_tokens,
                            completion_tokens=len(out))
                await _event(resp, {"text": self.tokenizer.decode(out), "output_ids": out,
                                    "meta_info": meta})
                await resp.write(b"data: [DONE]\n\n")
                return resp
        except protocol.BadRequest as exc:
            self.bad_requests += 1
            return _error(str(exc), 400, exc.param)


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Whatever a handler did not expect is a 500 in vLLM's error shape, never a crash."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except web.HTTPException as exc:  # 404, 405 ...: JSON, as vLLM's FastAPI answers
        if exc.status < 400:
            raise
        return _error(exc.reason, exc.status)
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as exc:
        log.exception("unexpected error serving %s", request.path)
        return _error(f"internal error: {exc!r}", 500)


def default_model_name(profile: Profile) -> str:
    """The served name without ``--served-model-name``: the first word of the profile's
    ``model`` when it has a ``/`` (a Hugging Face id, as vLLM names a path), else its name."""
    first = profile.model.replace(",", " ").split()[0] if profile.model.strip() else ""
    return first if "/" in first else profile.name


def _any_port(endpoint: str | None) -> str:
    """The replay endpoint when none is given: the events' host, any free port."""
    head, sep, _ = (endpoint or "").rpartition(":")
    return f"{head}:0" if sep and head.startswith("tcp://") else "tcp://127.0.0.1:0"


async def _json(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise protocol.BadRequest(f"the request body is not JSON: {exc}") from None


def _error(message: str, status: int, param: str | None = None) -> web.Response:
    return web.json_response(protocol.error_body(message, status, param), status=status)


async def _sse_response(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"content-type": "text/event-stream",
                                       "cache-control": "no-cache"})
    await resp.prepare(request)
    return resp


async def _event(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
