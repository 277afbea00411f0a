"""The interface between a node and the engine that executes requests.

An :class:`Engine` is two interfaces, as cache management is separate from the model:

* :class:`PrefixCacheView` — what the node sees of the engine's prefix cache (the budgeted
  radix tree of ``core.prefix_cache``): ``match`` (read-only, for routing), ``usage``, the
  cache changes since last asked (``drain_cache_delta``, block hashes added/removed) and a
  full snapshot (``cache_hashes``) for gossip. Callable from any thread.
* :class:`ModelRunner` — the model's identity and limits and ``generate`` (execute one
  request; blocking, one at a time — the :class:`~radixmesh.engine.worker.EngineWorker` queues
  requests in FIFO order and runs them on a thread), which reads and fills that cache.

Handles: lists returned by an engine are owned by the caller; the engine never mutates them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from radixmesh.core.blocks import Fingerprint
from radixmesh.core.prefix_cache import CacheUsage


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # besides the tokenizer's EOS

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)


FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, slots=True)
class GenerateResult:
    request_id: str
    output_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV was reused (not recomputed)
    queue_s: float  # time waiting in the engine's FIFO queue
    prefill_s: float
    decode_s: float


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
        (no LRU touch)."""
        ...

    def usage(self) -> CacheUsage: ...

    def drain_cache_delta(self) -> CacheDelta:
        """Block hashes added/removed since the previous call."""
        ...

    def cache_hashes(self) -> frozenset[int]:
        """Every block hash currently cached."""
        ...


class ModelRunner(Protocol):
    """The model: identity, limits and request execution."""

    @property
    def model_name(self) -> str: ...  # the name clients pass as "model"
    @property
    def fingerprint(self) -> Fingerprint: ...
    @property
    def max_context(self) -> int: ...
    @property
    def tokenizer(self) -> Tokenizer: ...

    def generate(
        self, req: GenerateRequest, on_token: TokenCallback | None = None
    ) -> GenerateResult:
        """Execute one request (blocking). ``on_token`` is called for each generated token."""
        ...


class Engine(PrefixCacheView, ModelRunner, Protocol):
    """What a node runs: a model over its own prefix cache."""
