"""``HttpEngine``: an :class:`~radixmesh.engine.base.AsyncEngine` over an external engine's HTTP
API (vLLM, SGLang, or any OpenAI-compatible server), so a radixmesh node can front it.

Theory of operation
-------------------
::

    generate(req) ──▶ POST (one aiohttp request per call; concurrent calls stay concurrent:
                      the engine batches them)
        vllm / openai: /v1/completions {"prompt": [ids], "stream": true, ...}
        sglang:        /generate       {"input_ids": [ids], "sampling_params": {...}, ...}
    SSE chunks ──▶ token ids ──▶ on_token (on the loop) ──▶ GenerateResult at the end

The prompt is token ids that radixmesh tokenized with the engine's own tokenizer (``--tokenizer
DIR``), so the block hashes radixmesh routes on name the very tokens the engine caches. Token
ids come back as ``token_id:N`` strings (vLLM's ``return_tokens_as_token_ids`` with
``logprobs``), as ``output_ids`` (SGLang, cumulative or incremental: ``completion_tokens``
says how many are new), or — a plain OpenAI-compatible server — by encoding the streamed text
(approximate). Cancelling the awaiting task closes the HTTP response, which is how the engine
learns the client went away (vLLM and SGLang abort a request whose stream closes).

The prefix-cache view is one of two:

* exact — an :class:`~radixmesh.core.engine_index.EngineIndex` the KV-event subscriber
  (``runtime/kv_subscriber.py``) feeds from the engine's events; ``drain_cache_delta`` is the
  index's delta, which ``NodeService.push_cache_and_load`` turns into ``CacheChanged``;
* approximate (``openai``: no events) — a ``PrefixCache[None]`` of the prompts and outputs
  this node sent, LRU under ``cache_tokens``: it guesses what the engine kept;
* slots (``llamacpp``: llama.cpp's server, no events) — the same LRU is what the node
  advertises, but its own match is :class:`~radixmesh.core.llamacpp_slots.LlamaCppSlots`:
  the server's slot choice and prompt cache replayed on what this node sent (``-np`` from
  its ``/props``), token granular, so the prediction names the slot llama.cpp will pick.

``cached_tokens`` of a result is the engine's own figure when it reports one
(``usage.prompt_tokens_details.cached_tokens`` / SGLang's ``meta_info.cached_tokens`` /
llama.cpp's ``timings.cache_n``), else
the view's match when the request was sent. ``waiting`` counts requests sent with no token
back yet, ``running`` those streaming; a result's ``queue_s`` is 0 (the engine's queue is not
visible), ``prefill_s`` is the time to the first token.

With ``kv_blocks`` (``--engine-kv-blocks``: vLLM's ``num_gpu_blocks``; engine block = mesh
block) the exact view's match is vLLM's free queue played forward
(:class:`~radixmesh.core.free_queue.EngineQueue`): what the requests this node sent and that
have no token yet will evict and store before the engine schedules the new one. Each request
is sent to the queue with its prompt and leaves it with its prompt's and output's blocks.

Why one file over 400 lines: the four engine dialects' wire formats and their cache views
(exact, free-queue, slots, LRU) are one adapter; split, each half would reach into the
other's request state.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from radixmesh.core.blocks import DEFAULT_BLOCK_SIZE, Fingerprint, block_hashes, namespace_seed
from radixmesh.core.engine_index import EngineIndex
from radixmesh.core.free_queue import EngineQueue, Held
from radixmesh.core.llamacpp_slots import LlamaCppSlots
from radixmesh.core.prefix_cache import CacheUsage, PrefixCache
from radixmesh.engine.base import (
    CacheDelta,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    TokenCallback,
    Tokenizer,
)

EngineKind = Literal["vllm", "sglang", "openai", "llamacpp"]
KINDS: tuple[str, ...] = ("vllm", "sglang", "openai", "llamacpp")
APPROXIMATE_KINDS = ("openai", "llamacpp")  # no KV events
TOKEN_ID_PREFIX = "token_id:"
CONNECT_TIMEOUT_S = 5.0
# Every engine's server closes a connection idle for 5 s: llama-server (cpp-httplib,
# CPPHTTPLIB_KEEPALIVE_TIMEOUT_SECOND), vLLM (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5) and SGLang (uvicorn).
# aiohttp keeps one 15 s, and a POST on one the server is closing fails ("Can not write request
# body", or a reset before any header): ``_exchange`` tries such a request once more, but the
# second failure reads as the engine down. Drop idle connections well before the server does.
ENGINE_KEEPALIVE_S = 2.0


class EngineUnavailable(RuntimeError):
    """The external engine could not be reached or answered with an error."""


@dataclass(slots=True)
class _Progress:
    """One request's stream, as it is read."""

    output: list[int] = field(default_factory=list)
    finish: FinishReason = "length"
    cached: int | None = None  # the engine's own figure, when it reports one
    first_token_at: float | None = None
    callback_error: Exception | None = None  # what on_token raised (it stopped the request)
    answered: bool = False  # the engine sent a response status


class _CallbackFailed(Exception):
    """``on_token`` raised: stop reading; ``generate`` raises the callback's exception."""


class HttpEngine:
    """An external engine behind its HTTP API (see the module docstring)."""

    def __init__(
        self,
        kind: str,
        url: str,
        tokenizer: Tokenizer,
        *,
        model_name: str,
        block_size: int = DEFAULT_BLOCK_SIZE,
        cache_tokens: int = 65_536,
        engine_block_size: int | None = None,
        max_context: int = 32_768,
        read_timeout_s: float = 300.0,
        kv_blocks: int = 0,
        slots: int = 1,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"engine kind must be one of {', '.join(KINDS)}, got {kind!r}")
        self.kind = kind
        self.url = url.rstrip("/")
        self._tokenizer = tokenizer
        self._model_name = model_name
        block_size = mesh_block_size(block_size, engine_block_size)
        self._fingerprint = Fingerprint(f"{kind}:{model_name}", tokenizer.fingerprint, block_size)
        self._max_context = max_context
        self.cache_tokens = cache_tokens
        seed = self._fingerprint.digest
        self.exact = kind not in APPROXIMATE_KINDS
        # (tenants) vLLM and SGLang keep cache_salt requests apart and their events say which
        # salt (core/kv_events: vLLM's extra_keys, SGLang's cache_salt); plain OpenAI servers
        # and llama.cpp have no such field
        self.cache_namespaces = kind in ("vllm", "sglang")
        self._cache_views(block_size, seed, engine_block_size, kv_blocks, slots)
        self._timeout = aiohttp.ClientTimeout(sock_connect=CONNECT_TIMEOUT_S,
                                              sock_read=read_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._closed = False
        self._waiting = self._running = 0
        self.failed = 0  # requests the engine failed (unreachable, error status, bad stream)

    def _cache_views(self, block_size: int, seed: int, engine_block_size: int | None,
                     kv_blocks: int, slots: int) -> None:
        """The node's views of the engine's cache: the exact index (KV events), the
        approximate LRU (engines without events), and the optional refinements of the match."""
        self.index = EngineIndex(block_size, seed, engine_block_size=engine_block_size)
        self.approx: PrefixCache[None] = PrefixCache(self.cache_tokens, block_size, seed)
        # (issue 55) --engine-kv-blocks: match() also counts what the requests ahead will
        # evict and store (core/free_queue.py); vLLM only (its free queue), engine block = mesh
        self.queue = (EngineQueue(kv_blocks - 1) if kv_blocks > 1 and self.kind == "vllm"
                      and engine_block_size == block_size else None)
        # llama.cpp: its slots and prompt cache (budget: cache_tokens), for the local match
        self.slots = (LlamaCppSlots(slots, cache_tokens=self.cache_tokens)
                      if self.kind == "llamacpp" else None)

    # ------------------------------------------------------------------------- identity
    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def fingerprint(self) -> Fingerprint:
        return self._fingerprint

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return self._waiting

    # ------------------------------------------------------------------------- cache view
    def match(self, prompt_ids: Sequence[int], namespace: str | None = None) -> int:
        """Prompt tokens the engine will find cached: the view's match, at most all but the
        last prompt token (the engine computes that one), in whole engine blocks (it reuses
        nothing finer: vLLM's ``num_tokens - 1`` cap, floored to its block size)."""
        if self.slots is not None:
            return self.slots.predict(prompt_ids)
        if not self.exact:
            return min(self.approx.match(prompt_ids), max(len(prompt_ids) - 1, 0))
        if self.queue is not None:
            return self.queue.surviving(self._held(prompt_ids, namespace).chain,
                                        self.index.hashes()) * self.index.block_size
        return exact_match(self.index, prompt_ids, namespace)

    def _held(self, tokens: Sequence[int], namespace: str | None) -> Held:
        """``tokens`` as the engine will hold them (the queue estimate's keys: mesh hashes)."""
        bs = self.index.block_size
        seed = namespace_seed(self.index.seed, namespace, bs)
        return Held.of_prompt(block_hashes(tokens, bs, seed), len(tokens), bs)

    def forget_cache(self) -> None:
        """The engine died or came back empty: forget what it held (the index refills from
        its events; the approximate view from what this node sends next)."""
        if self.exact:
            self.index.drop()
        else:
            self.approx.clear()
        if self.slots is not None:
            self.slots.clear()

    def usage(self) -> CacheUsage:
        if self.exact:
            return CacheUsage(self.index.indexed_tokens, self.cache_tokens, 0)
        return self.approx.usage()

    def drain_cache_delta(self) -> CacheDelta:
        added, removed = self.index.drain_delta() if self.exact else self.approx.drain_delta()
        return CacheDelta(tuple(added), tuple(removed))

    def cache_hashes(self) -> frozenset[int]:
        return self.index.hashes() if self.exact else self.approx.block_hashes()

    def describe(self) -> dict[str, object]:
        """The ``engine`` field of ``/mesh``."""
        return {"kind": self.kind, "url": self.url, "cache_view": self.cache_view,
                "running": self._running, "waiting": self._waiting, "failed": self.failed,
                "indexed_tokens": self.usage().tokens}

    @property
    def cache_view(self) -> str:
        return "exact" if self.exact else "slots" if self.slots is not None else "approximate"

    # ------------------------------------------------------------------------- requests
    async def generate(
        self, req: GenerateRequest, on_token: TokenCallback | None = None
    ) -> GenerateResult:
        if self._closed:
            raise RuntimeError("engine is closed")
        session = self._ensure_session()
        slot_key = object()  # this call, in the slot model
        matched = (self.slots.start(slot_key, req.prompt_ids) if self.slots is not None
                   else self.match(req.prompt_ids, req.cache_namespace))
        path, body = self._request_body(req)
        t0 = time.perf_counter()
        self._waiting += 1
        progress = _Progress()
        if self.queue is not None:
            self.queue.sent(id(progress), self._held(req.prompt_ids, req.cache_namespace))
        try:
            await self._exchange(session, path, body, progress, on_token)
        except _CallbackFailed:
            assert progress.callback_error is not None
            raise progress.callback_error from None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self.failed += 1
            raise EngineUnavailable(f"{self.kind} engine at {self.url}: {exc!r}") from exc
        finally:
            self._uncount(progress)
            if self.queue is not None:  # its prompt's and output's full blocks go free
                self.queue.finished(id(progress), self._held(
                    [*req.prompt_ids, *progress.output[:-1]], req.cache_namespace).chain)
            if self.slots is not None and progress.answered:  # the slot keeps what ran
                self.slots.finish(slot_key, [*req.prompt_ids, *progress.output[:-1]])
            elif self.slots is not None:  # it never reached the server
                self.slots.abort(slot_key)
        self._remember(req.prompt_ids, progress.output)
        return self._result(req, progress, matched, t0)

    async def _exchange(self, session: aiohttp.ClientSession, path: str, body: dict[str, Any],
                        progress: _Progress, on_token: TokenCallback | None) -> None:
        """POST and read the stream. A connection that fails before any answer is tried once
        more: servers close idle keep-alive connections (llama-server and uvicorn after 5 s),
        and a request written to one the server has closed never reached it."""
        for attempt in (0, 1):
            try:
                async with session.post(self.url + path, json=body) as resp:
                    progress.answered = True
                    await self._check_status(resp)
                    await self._read_stream(resp, progress, on_token)
                return
            except aiohttp.ClientConnectionError:
                if progress.answered or attempt:
                    raise

    def _uncount(self, progress: _Progress) -> None:
        if progress.first_token_at is None:
            self._waiting -= 1
        else:
            self._running -= 1

    async def _check_status(self, resp: aiohttp.ClientResponse) -> None:
        if resp.status != 200:
            text = (await resp.text())[:300]
            raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status,
                                              message=text)

    async def _read_stream(self, resp: aiohttp.ClientResponse, progress: _Progress,
                           on_token: TokenCallback | None) -> None:
        try:
            async for chunk in _sse_events(resp):
                for tok in self._tokens_of(chunk, progress):
                    self._deliver(tok, progress, on_token)
        except BaseException:
            resp.close()  # cancelled or on_token raised: the engine sees its stream close
            raise

    def _deliver(self, tok: int, progress: _Progress, on_token: TokenCallback | None) -> None:
        if progress.first_token_at is None:
            progress.first_token_at = time.perf_counter()
            self._waiting -= 1
            self._running += 1
            if self.queue is not None:
                self.queue.started(id(progress))
        progress.output.append(tok)
        if on_token is None:
            return
        try:
            on_token(tok)
        except Exception as exc:
            progress.callback_error = exc
            raise _CallbackFailed from exc

    def _tokens_of(self, chunk: dict[str, Any], progress: _Progress) -> list[int]:
        if self.kind == "sglang":
            return _sglang_tokens(chunk, progress)
        return _completion_tokens(chunk, progress, self._tokenizer)

    def _request_body(self, req: GenerateRequest) -> tuple[str, dict[str, Any]]:
        sp = req.sampling
        if self.kind == "sglang":
            params: dict[str, Any] = {"max_new_tokens": sp.max_tokens,
                                      "temperature": sp.temperature, "top_p": sp.top_p}
            if sp.stop_token_ids:
                params["stop_token_ids"] = list(sp.stop_token_ids)
            if sp.seed is not None:
                params["sampling_seed"] = sp.seed
            generate: dict[str, Any] = {"input_ids": list(req.prompt_ids),
                                        "sampling_params": params, "stream": True}
            if req.cache_namespace is not None:  # (tenants) SGLang's GenerateReqInput.cache_salt
                generate["cache_salt"] = req.cache_namespace
            return "/generate", generate
        body: dict[str, Any] = {
            "model": req.adapter or self._model_name, "prompt": list(req.prompt_ids),
            "max_tokens": sp.max_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
            "stream": True, "stream_options": {"include_usage": True},
        }
        if sp.seed is not None:
            body["seed"] = sp.seed
        if self.kind == "vllm":
            body.update(return_tokens_as_token_ids=True, logprobs=1)
            if sp.stop_token_ids:
                body["stop_token_ids"] = list(sp.stop_token_ids)
            if req.cache_namespace is not None:  # (tenants) the namespace is vLLM's salt
                body["cache_salt"] = req.cache_namespace
        return "/v1/completions", body

    def _remember(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Approximate view: what this request left in the engine's cache, as far as we know."""
        if self.exact:
            return
        now = time.monotonic()
        seq = [*prompt, *output[:-1]]  # the last sampled token never went through the model
        lease = self.approx.acquire(seq, self.approx.reserve_for(seq, 0), now)
        self.approx.commit(lease, seq, now)

    def _result(self, req: GenerateRequest, p: _Progress, matched: int, t0: float
                ) -> GenerateResult:
        end = time.perf_counter()
        first = p.first_token_at or end
        cached = matched if p.cached is None else min(p.cached, len(req.prompt_ids))
        return GenerateResult(req.request_id, p.output, p.finish, len(req.prompt_ids), cached,
                              0.0, first - t0, end - first)

    def _ensure_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0,  # no cap: the engine batches
                                             keepalive_timeout=ENGINE_KEEPALIVE_S)
            self._session = aiohttp.ClientSession(timeout=self._timeout, connector=connector)
        return self._session

    async def aclose(self) -> None:
        """Close the HTTP session: requests still in flight end with ``EngineUnavailable``
        (the engine sees their streams close and aborts them)."""
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None


def exact_match(index: EngineIndex, prompt_ids: Sequence[int], namespace: str | None = None
                ) -> int:  # fmt: skip
    """What an engine reports cached for ``prompt_ids`` (in cache ``namespace``) when ``index``
    is its cache: the match, at most all but the last token, floored to whole engine blocks
    (also the mismatch classifier's replayed prediction, ``bench/mismatch.py``)."""
    found = min(index.match(prompt_ids, namespace), max(len(prompt_ids) - 1, 0))
    return found - found % index.reuse_block_size


def mesh_block_size(block_size: int, engine_block_size: int | None) -> int:
    """The mesh's block size in front of an engine: the engine's own when it is a larger
    multiple of ``block_size`` (vLLM's CPU build: 128), so every hash the mesh gossips names a
    prefix the engine can reuse whole and peers' estimates are as exact as the local one."""
    if engine_block_size and engine_block_size > block_size and (
            engine_block_size % block_size == 0):
        return engine_block_size
    return block_size


# ------------------------------------------------------------------------------ wire format
async def _sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of an SSE stream's ``data:`` lines, until ``[DONE]`` or its end."""
    async for raw in resp.content:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if not isinstance(event, dict):
            raise ValueError("an SSE event is not a JSON object")
        if "error" in event:
            raise ValueError(f"engine error: {str(event['error'])[:300]}")
        yield event


def _finish(value: Any) -> FinishReason:
    if isinstance(value, dict):  # SGLang: {"type": "length", ...}
        value = value.get("type")
    return "length" if value == "length" else "stop"


def _completion_tokens(chunk: dict[str, Any], progress: _Progress,
                       tokenizer: Tokenizer) -> list[int]:
    """``/v1/completions`` chunk: token ids from ``token_id:N`` logprob tokens, else the text."""
    _usage(chunk.get("usage"), progress)
    _timings(chunk.get("timings"), progress)
    choices = chunk.get("choices") or []
    if not choices:
        return []
    choice = choices[0]
    if choice.get("finish_reason") is not None:
        progress.finish = _finish(choice["finish_reason"])
    tokens = (choice.get("logprobs") or {}).get("tokens")
    if tokens and all(isinstance(t, str) and t.startswith(TOKEN_ID_PREFIX) for t in tokens):
        return [int(t[len(TOKEN_ID_PREFIX):]) for t in tokens]
    text = choice.get("text") or ""
    return tokenizer.encode(text) if text else []


def _usage(usage: Any, progress: _Progress) -> None:
    if not isinstance(usage, dict):
        return
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        progress.cached = details["cached_tokens"]


def _timings(timings: Any, progress: _Progress) -> None:
    """llama.cpp's server: ``timings.cache_n``, the prompt tokens it reused from its cache
    (when the usage says nothing of them)."""
    if progress.cached is None and isinstance(timings, dict) and isinstance(
            timings.get("cache_n"), int):
        progress.cached = timings["cache_n"]


def _sglang_tokens(chunk: dict[str, Any], progress: _Progress) -> list[int]:
    """SGLang ``/generate`` chunk: ``output_ids`` (cumulative or incremental) + ``meta_info``."""
    meta = chunk.get("meta_info") or {}
    if isinstance(meta.get("cached_tokens"), int):
        progress.cached = meta["cached_tokens"]
    if meta.get("finish_reason") is not None:
        progress.finish = _finish(meta["finish_reason"])
    ids = [int(t) for t in chunk.get("output_ids") or []]
    total = meta.get("completion_tokens")
    new = (total - len(progress.output)) if isinstance(total, int) else len(ids)
    return ids[len(ids) - new:] if 0 < new <= len(ids) else []
