"""The built-in engine's step loop: the core scheduler's steps executed with torch.

Theory of operation
-------------------
::

    submit(req) ─▶ [prompt scored if asked] ─▶ Scheduler.add (the one call site)
    step():  schedule(now) ─▶ PagedKV: preempted dropped, evictions freed, admissions mapped
             onto cached blocks, blocks for the step's tokens
          ─▶ one packed forward of every prefill chunk and decode token (paged attention),
             run in pieces of at most PIECE_TOKENS prefill tokens (``pieces``)
          ─▶ a token per emitting sequence (its own Sampler; plain greedy rows in one argmax)
          ─▶ complete(step, tokens, stop)
          ─▶ cache journal: published / committed blocks adopted by the cache, evicted freed
             (the blocks' side of the plan and of the journal: ``engine/kv_mirror.py``)
          ─▶ callbacks: on_logprob, on_token, and on_done with the GenerateResult

Every scheduling decision (admission order, prefix-aware deferral, chunk sizes, preemption,
eviction) is the core :class:`~radixmesh.core.scheduler.Scheduler`'s, as for the emulated
engine and the simulator; this module only executes it. The node's index stays exact: the
journal it drains (``drain_cache_delta``) is the scheduler's own cache journal, whose blocks are
exactly the ones :class:`~radixmesh.engine.paged_kv.PagedKV` holds for the cache.

Why not transformers' continuous batching (5.25): its own scheduler, block allocator, prefix
sharing and thread would make the decisions, and its cache would not be the journal the node's
index reads. We take only the model forward over packed sequences: one registered attention
function (``paged_attention.paged_attention``) under the stock transformers model. Only the cache
view is thread-safe (it takes ``lock``).

Stops: a stop token (EOS, the tokenizer's ``stop_ids``, a ``stop_token_ids`` member) ends the
sequence, not in ``output_ids`` (its logprob entry is delivered). An ``on_token`` that raises
aborts its sequence (its prompt's whole blocks stay cached) and ``on_done`` gets the exception.
Prompt log-probabilities need logits a cached prefix lacks: such a request is scored by a plain
forward over its prompt (``sampling.score_prompt``), then generates (``cached_tokens`` 0).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from radixmesh.core.blocks import extend_hashes
from radixmesh.core.scheduler import Finished, Scheduler, SchedulerConfig, Step
from radixmesh.engine import packed_linear
from radixmesh.engine.base import (
    CacheDelta,
    CacheUsage,
    GenerateRequest,
    GenerateResult,
    TokenCallback,
    TokenLogprob,
)
from radixmesh.engine.kv_mirror import KvMirror
from radixmesh.engine.lora import LoraSet, bound, only
from radixmesh.engine.namespaced import effective_namespace, model_step, sequence_seed
from radixmesh.engine.paged_attention import ATTENTION
from radixmesh.engine.paged_kv import PIECE_TOKENS, PagedKV, pieces
from radixmesh.engine.sampling import Sampler, greedy_rows, score_prompt

OnResult = Callable[[GenerateResult | BaseException], None]


@dataclass(slots=True, eq=False)
class Live:
    """One request in the engine."""

    req: GenerateRequest
    tokens: list[int]  # prompt + outputs (the scheduler's view of the sequence)
    budget: int
    sampler: Sampler
    stops: frozenset[int]
    on_token: TokenCallback | None
    on_done: OnResult
    submitted: float
    scored: tuple[TokenLogprob | None, ...] = ()
    hashes: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    admitted: float | None = None
    first: float | None = None
    logits: list[torch.Tensor] | None = None  # receives the first output's raw logits
    hidden: int = 0  # its namespace's virtual tokens in front (engine/namespaced.py)
    seed: int = 0  # the hash chain's seed of its real blocks (its namespace's)


class BatchRunner(KvMirror):
    """Continuous batching of one model on the core scheduler (module docstring)."""

    def __init__(self, model: PreTrainedModel, config: SchedulerConfig, allowed: int,
                 stop_ids: frozenset[int], device: torch.device) -> None:
        model.set_attn_implementation(ATTENTION)
        packed_linear.pack_linears(model)  # oneDNN for batched rows (engine/packed_linear.py)
        self.model, self.config, self.device = model, config, device
        self._allowed, self._stop_ids = allowed, stop_ids
        cfg = model.config.get_text_config()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self._kv_shape = (int(cfg.num_hidden_layers), int(cfg.num_key_value_heads), int(head_dim))
        self.lock = threading.Lock()  # the scheduler's cache, read from other threads
        self.lora: LoraSet | None = None  # the engine's LoRA adapters (engine/lora.py)
        self._reset()
        self._ids = itertools.count(1)
        self.stats = {"steps": 0, "batched_tokens": 0, "max_batch": 0, "prefill_tokens": 0,
                      "reclaims": 0}

    def _reset(self) -> None:
        self.sched = Scheduler(self.config)
        layers, heads, dim = self._kv_shape
        self.kv = PagedKV(layers, heads, dim, self.config.kv_blocks, self.config.block_size,
                          self.model.dtype, self.device)
        self._live: dict[int, Live] = {}
        self._admitted = 0  # of them admitted
        self._added: set[int] = set()  # the node's journal, net
        self._removed: set[int] = set()

    # ------------------------------------------------------------------------- cache view
    def match(self, prompt: list[int] | tuple[int, ...], namespace: str | None = None) -> int:
        with self.lock:
            return self.sched.cached_prefix(prompt, namespace)

    def usage(self) -> CacheUsage:
        with self.lock:
            return self.sched.cache.usage()

    def cache_hashes(self) -> frozenset[int]:
        with self.lock:
            return self.sched.cache_hashes()

    def drain_cache_delta(self) -> CacheDelta:
        with self.lock:
            added, removed = tuple(self._added), tuple(self._removed)
            self._added, self._removed = set(), set()
        return CacheDelta(added, removed)

    def clear_cache(self) -> int:
        """Drop every cached block (only when idle: like vLLM's ``reset_prefix_cache``)."""
        with self.lock:
            if self._live:
                return 0
            tokens = self.sched.cache.usage().tokens
            self._journal([], self.kv.clear())
            added, removed = self._added, self._removed
            self._reset()
            self._added, self._removed = added, removed
            return tokens

    @property
    def idle(self) -> bool:
        return not self._live

    @property
    def in_flight(self) -> int:
        return len(self._live)

    @property
    def waiting(self) -> int:
        """Requests not admitted yet (read from any thread: two integer reads)."""
        return len(self._live) - self._admitted

    def has(self, seq: int) -> bool:
        return seq in self._live

    def restart(self, error: BaseException) -> None:
        """After a failed step: every request ends with ``error``, the cache starts empty
        (the node is told every block went)."""
        lives = list(self._live.values())
        with self.lock:
            self._journal([], list(self.sched.cache_hashes()))
            added, removed = self._added, self._removed
            self._reset()
            self._added, self._removed = added, removed
        for live in lives:
            live.on_done(error)

    @property
    def kv_bytes_copied(self) -> int:
        return self.kv.kv_bytes_copied

    def waiting_ids(self) -> list[int]:
        return [seq for seq, live in self._live.items() if live.admitted is None]

    def _pop(self, seq: int) -> Live | None:
        live = self._live.pop(seq, None)
        if live is not None and live.admitted is not None:
            self._admitted -= 1
        return live

    # ------------------------------------------------------------------------- requests
    def submit(self, req: GenerateRequest, budget: int, on_token: TokenCallback | None,
               on_done: OnResult, logits: list[torch.Tensor] | None = None) -> int:
        """Queue a validated request (``budget`` = its max new tokens, >= 0); its id."""
        sp = req.sampling
        prompt = list(req.prompt_ids)
        live = Live(req, prompt, budget, Sampler(sp, self._allowed, self.device),
                    self._stop_ids | frozenset(sp.stop_token_ids), on_token, on_done,
                    time.perf_counter(), logits=logits)
        namespace = effective_namespace(req)
        live.hidden = 0 if namespace is None else self.config.block_size
        live.seed = sequence_seed(self.config.hash_seed, namespace, self.config.block_size)
        seq = next(self._ids)
        if sp.prompt_logprobs is not None:
            with only(self.lora, req.adapter):  # its LoRA adapter over every row
                live.scored = score_prompt(self.model, prompt, sp.prompt_logprobs, self._allowed)
            if req.on_prompt_logprobs is not None:
                req.on_prompt_logprobs(live.scored)
            if budget == 0:
                on_done(self._result(live, "length", 0))
                return seq
        with self.lock:
            self.sched.add(seq, prompt, budget, time.monotonic(), namespace=namespace)
        live.hashes = extend_hashes([], prompt, self.config.block_size, live.seed)
        self._live[seq] = live
        return seq

    def abort(self, seq: int, error: BaseException) -> None:
        """End a request wherever it is; ``on_done`` gets ``error``."""
        live = self._pop(seq)
        if live is None:
            return
        with self.lock:
            self.sched.abort(seq, time.monotonic())
            self.kv.drop(seq)
            self._journal(*self.sched.drain_cache_delta())
        live.on_done(error)

    # ------------------------------------------------------------------------- stepping
    def step(self) -> bool:
        """Plan, run and apply one step; False when there was nothing to run."""
        with self.lock:
            step = self.sched.schedule(time.monotonic())
            run = model_step(step, self._live)  # in model positions (engine/namespaced.py)
            self._prepare(run)
        if step.empty:
            return False
        with bound(self.lora, run, self._live):  # each row's LoRA adapter (engine/lora.py)
            rows = self._forward(run) if run.prefills or run.decodes else torch.empty(0, 0)
        tokens: dict[int, int] = {}
        stop: list[int] = []
        emitted: list[tuple[int, Live, int, TokenLogprob | None]] = []
        lives = [self._live[seq] for seq in step.emitting]
        plain = [i for i, live in enumerate(lives) if live.sampler.plain_greedy]
        picked = dict(zip(plain, greedy_rows(rows[:, : self._allowed], plain), strict=True))
        for i, (seq, live) in enumerate(zip(step.emitting, lives, strict=True)):
            if live.logits is not None and not live.logits:
                live.logits.append(rows[i].cpu())
            token = picked.get(i)
            entry = None
            if token is None:
                token, entry = live.sampler.next(rows[i, : self._allowed])
            tokens[seq] = token
            if token in live.stops:
                stop.append(seq)
            emitted.append((seq, live, token, entry))
        with self.lock:
            finished = self.sched.complete(step, tokens, time.monotonic(), stop)
            self._settle(run, finished)
        self._deliver(emitted, {f.seq: f for f in finished})
        return True

    @torch.inference_mode()
    def _forward(self, step: Step) -> torch.Tensor:
        """The step's forward, in pieces (``pieces``); the logits rows of ``step.emitting``, in
        order."""
        rows = torch.cat([self._run(piece) for piece in pieces(step, PIECE_TOKENS)])
        st = self.stats
        st["steps"] += 1
        st["batched_tokens"] += step.prefill_tokens + len(step.decodes)
        st["prefill_tokens"] += step.prefill_tokens
        st["max_batch"] = max(st["max_batch"], len(step.prefills) + len(step.decodes))
        return rows

    def _run(self, step: Step) -> torch.Tensor:
        """One packed forward; the logits rows of ``step.emitting``, in order."""
        ids: list[int] = []
        pos: list[int] = []
        keep: list[int] = []
        for chunk in step.prefills:
            live = self._live[chunk.seq]
            ids += live.tokens[chunk.start : chunk.start + chunk.tokens]
            pos += range(chunk.start, chunk.start + chunk.tokens)
            if chunk.last:
                keep.append(len(ids) - 1)
        for slot in step.decodes:
            ids.append(self._live[slot.seq].tokens[slot.context - 1])
            pos.append(slot.context - 1)
            keep.append(len(ids) - 1)
        batch = self.kv.batch([(c.seq, c.start, c.tokens) for c in step.prefills],
                              [(d.seq, d.context) for d in step.decodes])
        dev = self.device
        out = self.model(input_ids=torch.tensor([ids], device=dev),
                         position_ids=torch.tensor([pos], device=dev), use_cache=False,
                         logits_to_keep=torch.tensor(keep, dtype=torch.long, device=dev),
                         rm_batch=batch)
        return out.logits[0].float()

    def _deliver(self, emitted: list[tuple[int, Live, int, TokenLogprob | None]],
                 finished: dict[int, Finished]) -> None:
        now = time.perf_counter()
        for seq, live, token, entry in emitted:
            live.first = live.first or now
            live.tokens.append(token)
            try:
                if entry is not None:
                    live.logprobs.append(entry)
                    if live.req.on_logprob is not None:
                        live.req.on_logprob(entry)
                if token not in live.stops:
                    live.output.append(token)
                    if live.on_token is not None:
                        live.on_token(token)
            except Exception as exc:  # the request's consumer failed: it ends, nothing else
                if seq in finished:
                    self._pop(seq)
                    live.on_done(exc)
                else:
                    self.abort(seq, exc)
                continue
            fin = finished.get(seq)
            if fin is not None:
                self._pop(seq)
                live.on_done(self._result(live, fin.reason, fin.cached_tokens))

    def _result(self, live: Live, reason: str, cached: int) -> GenerateResult:
        now = time.perf_counter()
        admitted = live.admitted or now
        first = live.first or now
        finish = "stop" if reason == "stop" else "length"
        return GenerateResult(
            live.req.request_id, live.output, finish, len(live.req.prompt_ids),
            0 if live.req.sampling.prompt_logprobs is not None else cached,
            admitted - live.submitted, first - admitted, now - first,
            tuple(live.logprobs), live.scored)
