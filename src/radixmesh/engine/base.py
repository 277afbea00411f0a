"""The interface between a node and the engine that executes requests.

Two levels, as an engine either runs one request at a time or batches many:

* :class:`Engine` — a synchronous engine (the built-in one): :class:`PrefixCacheView` (what the
  node sees of the prefix cache) + :class:`ModelRunner` (identity, limits and a blocking
  ``generate``, one request at a time, not re-entrant).
* :class:`AsyncEngine` — what the node runs on: the same cache view and identity, an
  ``async generate`` that many callers may await at once, ``running`` / ``waiting`` counts and
  ``aclose``. A batching engine (vLLM / SGLang behind HTTP) implements it directly; the
  built-in engine gets it from :class:`~radixmesh.engine.batched.BatchedEngine` (continuous
  batching on the core scheduler), any other synchronous engine from
  :class:`~radixmesh.engine.worker.ThreadedEngine` (one thread, FIFO).

The :class:`AsyncEngine` contract
---------------------------------
* ``generate`` is awaited on one event loop (the node's); every method is called from it.
* ``on_token(id)`` is called on that loop, once per generated token, in order, every call
  before ``generate`` returns and none after it returns or raises. It must not block. If it
  raises, the request stops at its next token and ``generate`` raises that exception.
* Cancelling the task awaiting ``generate`` stops the request: one still waiting is never
  started; a running one stops at its next token. ``CancelledError`` reaches the caller once the
  engine has let go of it: the KV computed so far is committed to the cache or released (the
  cache stays consistent) and ``running`` / ``waiting`` no longer count it. (A second
  cancellation stops only that wait.)
* ``running`` (executing now: a batching engine may run many) and ``waiting`` (admitted, not
  started) exclude a request as soon as ``generate`` has returned or raised for it.
* ``aclose()`` cancels waiting requests (their ``generate`` raises ``CancelledError``), lets
  running ones finish and releases the engine; ``generate`` afterwards raises ``RuntimeError``.
* The cache view (``match``, ``usage``, ``drain_cache_delta``, ``cache_hashes``) answers at once
  and may be read while requests run; only the delta drain mutates (the journal).

Cache namespaces (tenants, ``cache_salt``): an engine whose ``cache_namespaces`` attribute is
true keeps them apart — ``match(prompt_ids, namespace=...)`` and ``GenerateRequest.
cache_namespace`` — and its cache view names blocks with the namespaced hashes
(``core/blocks.namespace_seed``). The node refuses a namespaced request (400) on any other
engine rather than share its cache.

Penalties and log-probabilities (``SamplingParams`` beyond ``plain``) are honoured by an engine
whose ``extended_sampling`` attribute is true (the built-in one); the node refuses them with a
400 on any other engine rather than ignore them.

Handles: lists and results returned by an engine are owned by the caller; the engine never
mutates them. Request and result types are frozen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from radixmesh.core.blocks import Fingerprint
from radixmesh.core.prefix_cache import CacheUsage as CacheUsage  # re-exported

MAX_LOGPROBS = 20  # the most alternatives per position an engine is asked for


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample. Penalties follow OpenAI: before sampling, each token ``j`` generated
    ``c[j]`` times so far in this answer has its logit lowered by
    ``c[j] * frequency_penalty + (c[j] > 0) * presence_penalty`` (the prompt does not count).
    ``logprobs`` = k asks for each generated token's log-probability and the k most likely
    alternatives (:class:`TokenLogprob`); ``prompt_logprobs`` = k the same for every prompt
    token (the first has none) — exact, so the whole prompt is computed (no prefix reuse).
    ``max_tokens`` may be 0 only with ``prompt_logprobs`` (score the prompt, generate none)."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # besides the tokenizer's EOS
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    logprobs: int | None = None  # in [0, MAX_LOGPROBS]
    prompt_logprobs: int | None = None  # in [0, MAX_LOGPROBS]

    def __post_init__(self) -> None:
        if self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise ValueError("max_tokens must be >= 1 (0 only when scoring the prompt)")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2]")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}]")

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def plain(self) -> bool:
        """Nothing beyond what every engine and the forward protocol carry (no penalties, no
        log-probabilities)."""
        return not self.penalized and self.logprobs is None and self.prompt_logprobs is None


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One position's log-probability (natural log, of the model's raw distribution: before
    temperature, top-p and penalties) and its ``top`` alternatives, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


# An engine with ``extended_sampling`` calls a request's ``on_logprob`` like ``on_token``, just
# before ``on_token`` of the same token (and once for the stop token that ends an answer).
LogprobCallback = Callable[[TokenLogprob], None]
# ... and its ``on_prompt_logprobs`` once, with every prompt entry, before any token
PromptLogprobCallback = Callable[[tuple[TokenLogprob | None, ...]], None]


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # with ``sampling.logprobs``: receives each generated token's entry as it is computed
    # (engines with ``extended_sampling``; a proxy passing the request on passes it too)
    on_logprob: LogprobCallback | None = field(default=None, compare=False, repr=False)
    # with ``sampling.prompt_logprobs``: receives them as soon as the prompt is scored
    on_prompt_logprobs: PromptLogprobCallback | None = field(default=None, compare=False,
                                                             repr=False)
    # the request's cache namespace (core/blocks.py: None = the shared cache); an engine whose
    # ``cache_namespaces`` attribute is true reuses only that namespace's prefixes
    cache_namespace: str | None = None
    # the served name of the LoRA adapter it runs with (core/adapters.py); None: the base model
    adapter: str | None = None


FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, slots=True)
class GenerateResult:
    request_id: str
    output_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV was reused (not recomputed)
    queue_s: float  # time admitted but not started (waiting for the engine)
    prefill_s: float
    decode_s: float
    # with ``sampling.logprobs``: one per output id, and one more for the stop token that
    # ended the answer (finish "stop" on a stop id: it is not in ``output_ids``)
    logprobs: tuple[TokenLogprob, ...] = ()
    # with ``sampling.prompt_logprobs``: one per prompt token, None for the first
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()


@dataclass(frozen=True, slots=True)
class CacheDelta:
    added: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()


class Tokenizer(Protocol):
    @property
    def fingerprint(self) -> str: ...
    @property
    def eos_token_id(self) -> int | None: ...
    @property
    def vocab_size(self) -> int: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> list[int]: ...


TokenCallback = Callable[[int], None]


class PrefixCacheView(Protocol):
    """The node's view of an engine's prefix cache; read-only except the journal drain."""

    def match(self, prompt_ids: Sequence[int]) -> int:
        """Prompt tokens a request would reuse now (cached prefix, at most len - 1); read-only
        (no LRU touch). An engine with ``cache_namespaces`` also takes ``namespace=``
        (``match_in`` below calls it so)."""
        ...

    def usage(self) -> CacheUsage: ...

    def drain_cache_delta(self) -> CacheDelta:
        """Block hashes added/removed since the previous call."""
        ...

    def cache_hashes(self) -> frozenset[int]:
        """Every block hash currently cached."""
        ...


class ModelInfo(Protocol):
    """The model's identity and limits (constant for the engine's life)."""

    @property
    def model_name(self) -> str: ...  # the name clients pass as "model"
    @property
    def fingerprint(self) -> Fingerprint: ...
    @property
    def max_context(self) -> int: ...
    @property
    def tokenizer(self) -> Tokenizer: ...


class ModelRunner(ModelInfo, Protocol):
    """The model: identity, limits and request execution, one request at a time."""

    def generate(
        self, req: GenerateRequest, on_token: TokenCallback | None = None
    ) -> GenerateResult:
        """Execute one request (blocking, not re-entrant). ``on_token`` is called on the calling
        thread for each generated token; if it raises, generation stops there, the cache is
        left consistent (KV so far committed or released) and the exception propagates."""
        ...


class Engine(PrefixCacheView, ModelRunner, Protocol):
    """A synchronous engine: a model over its own prefix cache."""


class AsyncEngine(PrefixCacheView, ModelInfo, Protocol):
    """What a node runs on: concurrent requests on the event loop (contract above)."""

    @property
    def running(self) -> int:
        """Requests executing now."""
        ...

    @property
    def waiting(self) -> int:
        """Requests admitted but not started."""
        ...

    async def generate(
        self, req: GenerateRequest, on_token: TokenCallback | None = None
    ) -> GenerateResult:
        """Execute one request; ``on_token`` runs on the loop. Cancel the awaiting task to stop
        it (see the module docstring)."""
        ...

    async def aclose(self) -> None:
        """Cancel waiting requests, let running ones finish, release the engine."""
        ...


def isolates(engine: object) -> bool:
    """Whether ``engine`` keeps cache namespaces apart (see the module docstring)."""
    return bool(getattr(engine, "cache_namespaces", False))


def match_in(view: PrefixCacheView, prompt_ids: Sequence[int], namespace: str | None) -> int:
    """``view.match`` within ``namespace`` (None: the shared cache). A namespace on a view
    that does not isolate matches nothing (never another namespace's blocks)."""
    if namespace is None:
        return view.match(prompt_ids)
    if not isolates(view):
        return 0
    match = view.match
    return int(match(prompt_ids, namespace=namespace))  # type: ignore[call-arg]


class EngineFacade:
    """What an async wrapper of an engine (``worker.ThreadedEngine``, ``batched.BatchedEngine``)
    passes through unchanged: the engine's identity and its prefix-cache view."""

    engine: Engine

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def fingerprint(self) -> Fingerprint:
        return self.engine.fingerprint

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def cache_namespaces(self) -> bool:
        return isolates(self.engine)

    def match(self, prompt_ids: Sequence[int], namespace: str | None = None) -> int:
        return match_in(self.engine, prompt_ids, namespace)

    def usage(self) -> CacheUsage:
        return self.engine.usage()

    def drain_cache_delta(self) -> CacheDelta:
        return self.engine.drain_cache_delta()

    def cache_hashes(self) -> frozenset[int]:
        return self.engine.cache_hashes()
