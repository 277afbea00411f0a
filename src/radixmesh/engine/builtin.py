"""The built-in engine: a transformers causal LM executed by continuous batching.

Theory of operation
-------------------
``TransformersEngine`` holds the model, its identity and limits, and a
:class:`~radixmesh.engine.batch.BatchRunner`: the core scheduler's steps run with torch over a
paged KV pool (``engine/batch.py``, ``engine/paged_kv.py``). A node runs it through
:class:`~radixmesh.engine.batched.BatchedEngine` (its step loop on one thread, many requests
at once); ``generate`` here is the synchronous path (tests, benchmarks, an engine proxy under
``ThreadedEngine``): it submits one request and steps the runner on the calling thread until it
is done (not re-entrant); once a ``BatchedEngine`` drives the runner, ``generate`` hands the
request to its thread and waits (``on_token`` then runs on that thread).

The KV pool (``cache_tokens``) holds both the prefix cache and the running sequences' KV, in
blocks of ``block_size`` tokens; a prefix is reused in whole blocks (never the prompt's last
token: there must be logits to sample from), as in vLLM. A request whose prompt + output can
never fit the pool is refused (``ValueError``). Position ids are explicit, so a cached block is
only read at its original positions (a chained block hash guarantees it).

Cache namespaces (tenants, ``cache_salt``, adapters): the scheduler keeps them apart behind
a virtual block per namespace, which the torch path never computes (``engine/namespaced.py``);
the cache view reports the mesh's namespaced block hashes. LoRA adapters (PEFT folders,
``load_adapter``) run per row of a batch, mixed freely (``engine/lora.py``).

Sampling and log-probabilities: ``engine/sampling.py``. Prompt log-probabilities (``echo`` +
``logprobs`` scoring) are computed by a full forward over the prompt (a cached prefix has no
logits), ``cached_tokens`` is then 0.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from radixmesh.core.blocks import Fingerprint
from radixmesh.core.scheduler import SchedulerConfig
from radixmesh.engine.base import (
    CacheDelta,
    CacheUsage,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    TokenCallback,
    Tokenizer,
)
from radixmesh.engine.batch import BatchRunner
from radixmesh.engine.lora import LoraSet, LoraWeights

STEP_TOKENS = 2048  # tokens one step computes (vLLM's max_num_batched_tokens): prefill chunk
MAX_RUNNING = 64  # sequences batched at once (vLLM's max_num_seqs)


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What ``build_engine`` resolved: identity and limits of the loaded model, and the
    batching knobs of the core scheduler."""

    model_name: str
    model_identity: str  # e.g. "preset:tiny:seed0:float32" or "dir:<digest>:float32"
    max_context: int
    block_size: int
    cache_tokens: int  # the KV pool: prefix cache + running sequences
    step_tokens: int = STEP_TOKENS
    max_running: int = MAX_RUNNING
    prefix_aware: bool = True  # the scheduler's "pioneers first" admission; False = FCFS


class TransformersEngine:
    """Implements :class:`radixmesh.engine.base.Engine` (the synchronous path) and carries the
    ``runner`` a :class:`~radixmesh.engine.batched.BatchedEngine` drives."""

    extended_sampling = True  # penalties and log-probabilities (engine/base.py)
    cache_namespaces = True  # keeps cache namespaces apart (engine/base.py)

    def __init__(self, model: PreTrainedModel, tokenizer: Tokenizer, spec: EngineSpec,
                 device: torch.device) -> None:
        self.model = model
        self._tokenizer = tokenizer
        self.spec = spec
        self.device = device
        self._fingerprint = Fingerprint(spec.model_identity, tokenizer.fingerprint, spec.block_size)
        self._vocab = int(model.get_input_embeddings().num_embeddings)
        self._allowed = min(tokenizer.vocab_size, self._vocab)  # ids the tokenizer can decode
        eos = tokenizer.eos_token_id
        default_stops = frozenset() if eos is None else frozenset({eos})
        stop_ids: frozenset[int] = getattr(tokenizer, "stop_ids", default_stops)
        config = SchedulerConfig(
            block_size=spec.block_size,
            kv_blocks=max(spec.cache_tokens // spec.block_size, 1),
            max_running=min(spec.max_running, spec.step_tokens),
            step_tokens=spec.step_tokens,
            prefix_aware=spec.prefix_aware,
            hash_seed=self._fingerprint.digest,
        )
        self.runner = BatchRunner(model, config, self._allowed,
                                  stop_ids, device)
        self.driver: Any = None  # a BatchedEngine stepping the runner on its own thread
        self._step_lock = threading.Lock()  # the synchronous path's callers step one at a time

    # ------------------------------------------------------------------------- identity
    @property
    def model_name(self) -> str:
        return self.spec.model_name

    @property
    def fingerprint(self) -> Fingerprint:
        return self._fingerprint

    @property
    def max_context(self) -> int:
        return self.spec.max_context

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def kv_bytes_per_token(self) -> int:
        cfg = self.model.config.get_text_config()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        elem = torch.empty((), dtype=self.model.dtype).element_size()
        return int(cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * elem)

    # ------------------------------------------------------------------------- cache view
    def match(self, prompt_ids: Sequence[int], namespace: str | None = None) -> int:
        return self.runner.match(list(prompt_ids), namespace)

    def drain_cache_delta(self) -> CacheDelta:
        return self.runner.drain_cache_delta()

    def cache_hashes(self) -> frozenset[int]:
        return self.runner.cache_hashes()

    def usage(self) -> CacheUsage:
        return self.runner.usage()

    def clear_cache(self) -> int:
        """Drop every cached prefix when nothing runs; returns the tokens freed."""
        return self.runner.clear_cache()

    def stats(self) -> dict[str, int]:
        """Counters for ``/mesh`` and benchmarks (``kv_bytes_copied`` stays 0: prefix hits
        read the cached blocks in place)."""
        sched = self.runner.sched
        return {**self.runner.stats, "kv_bytes_copied": self.runner.kv_bytes_copied,
                "prefill_tokens_computed": sched.prefill_tokens_computed,
                "cached_tokens_hit": sched.cached_tokens_hit,
                "preemptions": sched.preemptions}

    # ------------------------------------------------------------------------- adapters
    @property
    def adapters(self) -> tuple[str, ...]:
        """The names of the LoRA adapters loaded."""
        return () if self.runner.lora is None else tuple(self.runner.lora.adapters)

    def load_adapter(self, name: str, folder: str | Path) -> LoraWeights:
        """Load the PEFT LoRA adapter in ``folder`` as ``name`` (before serving: not while a
        step runs); ValueError naming what is wrong with it."""
        if self.runner.lora is None:
            self.runner.lora = LoraSet(self.model)
        return self.runner.lora.load(name, Path(folder))

    # ------------------------------------------------------------------------- generation
    def validate(self, prompt_ids: Sequence[int]) -> None:
        """Raise ``ValueError`` for a prompt this engine cannot run (clients get a 400)."""
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        if len(prompt_ids) >= self.max_context:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; this model's context is {self.max_context}"
            )
        if min(prompt_ids) < 0 or max(prompt_ids) >= self._vocab:
            raise ValueError(f"token ids must be in [0, {self._vocab})")

    def budget(self, req: GenerateRequest) -> int:
        """Validate ``req``; the new tokens it may generate (its max_tokens, cut at the
        context)."""
        self.validate(req.prompt_ids)
        if req.adapter is not None and req.adapter not in self.adapters:
            raise ValueError(f"adapter {req.adapter!r} is not loaded on this engine")
        return min(req.sampling.max_tokens, self.max_context - len(req.prompt_ids))

    def generate(
        self, req: GenerateRequest, on_token: TokenCallback | None = None
    ) -> GenerateResult:
        """Run one request to its end on the calling thread (module docstring)."""
        return self._run_alone(req, on_token, None)

    def prefill_logits(self, prompt_ids: Sequence[int]) -> tuple[torch.Tensor, int]:
        """Last-position fp32 logits (CPU) of ``prompt_ids`` computed over the cached prefix,
        and the cached tokens reused; the prompt is cached afterwards. For tests, benchmarks."""
        logits: list[torch.Tensor] = []
        req = GenerateRequest("prefill", tuple(prompt_ids), SamplingParams(max_tokens=1))
        result = self._run_alone(req, None, logits)
        return logits[0], result.cached_tokens

    def _run_alone(self, req: GenerateRequest, on_token: TokenCallback | None,
                   logits: list[torch.Tensor] | None) -> GenerateResult:
        """Submit ``req``, step the runner until it is done. Threads may do this at once (nodes
        sharing an engine): steps are serialised by ``_step_lock``, any step advances every
        sequence, each request's callbacks run on its caller's thread, outside the lock."""
        if self.driver is not None:  # its thread steps the runner: hand the request over
            if logits is not None:
                raise RuntimeError("prefill_logits needs the engine without a BatchedEngine")
            result: GenerateResult = self.driver.run_blocking(req, on_token)
            return result
        events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        user_logprob = req.on_logprob
        if user_logprob is not None:
            req = dataclasses.replace(req, on_logprob=lambda e: events.put(("logprob", e)))
        with self._step_lock:
            seq = self.runner.submit(req, self.budget(req), lambda t: events.put(("token", t)),
                                     lambda o: events.put(("done", o)), logits)
        failed: list[BaseException] = []  # the exception a callback raised, if one did
        while True:
            done = self._deliver(events, seq, on_token, user_logprob, failed)
            if done is not None:
                return done
            with self._step_lock:
                self.runner.step()

    def _deliver(self, events: queue.SimpleQueue[tuple[str, Any]], seq: int,
                 on_token: TokenCallback | None, on_logprob: Callable[[Any], None] | None,
                 failed: list[BaseException]) -> GenerateResult | None:
        """Run the callbacks of the events queued so far on this thread; the result once the
        sequence is done (raised: its error, or first what a callback raised), else None.
        A callback that raises ends the sequence, and no callback runs after it."""
        while True:
            try:
                kind, value = events.get_nowait()
            except queue.Empty:
                return None
            if kind == "done":
                if failed:
                    raise failed[0]
                if isinstance(value, BaseException):
                    raise value
                return value  # type: ignore[no-any-return]
            callback = on_token if kind == "token" else on_logprob
            if callback is None or failed:
                continue
            try:
                callback(value)
            except Exception as exc:  # the caller stops: the sequence ends
                failed.append(exc)
                with self._step_lock:
                    self.runner.abort(seq, exc)
