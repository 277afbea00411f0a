"""The scheduler's vocabulary: its configuration, the steps it plans and what a finished
sequence reports (``core/scheduler.py`` has the theory of operation).

A :class:`Step` is what one forward pass of the engine computes: prompt chunks (chunked
prefill; ``start`` is where the chunk begins in the sequence's KV, so a step-time model can
charge attention over ``start + tokens``) and decode slots (one new token attending to
``context`` KV tokens). Frozen and hashable: a step model may memoise on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixmesh.core.prefix_cache import Lease

SeqId = int
CACHE_RULES = ("radix", "vllm")  # SchedulerConfig.cache_rule


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    block_size: int = 16  # KV block size in tokens
    kv_blocks: int = 4096  # KV pool in blocks: prefix cache + running sequences' KV
    max_running: int = 256  # vLLM max_num_seqs
    step_tokens: int = 8192  # vLLM max_num_batched_tokens: tokens computed per step
    max_overtake: int = 8  # K: the most admissions that may pass a waiting request
    prefix_aware: bool = True  # "pioneers first"; False = plain FCFS admission
    hash_seed: int = 0  # seed of the prefix cache's chained block hashes
    # "radix": a prompt's blocks are cached when its prefill completes; eviction takes whole
    # LRU leaves, sparing queued requests' prefixes. "vllm": vLLM 0.32's rule (an engine that
    # emulates vLLM): a chunk's whole blocks are cached when it is scheduled, so a request
    # admitted later in the same step hits them; eviction takes LRU blocks, tail first, and
    # spares nothing (core/scheduler.py's docstring cites the source)
    cache_rule: str = "radix"

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_blocks", "max_running", "step_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.max_overtake, bool) or not isinstance(self.max_overtake, int):
            raise ValueError(f"max_overtake must be an integer >= 0, got {self.max_overtake!r}")
        if self.max_overtake < 0:
            raise ValueError(f"max_overtake must be an integer >= 0, got {self.max_overtake!r}")
        if self.step_tokens < self.max_running:
            raise ValueError("step_tokens must be >= max_running (one decode token each)")
        if not isinstance(self.prefix_aware, bool):
            raise ValueError(f"prefix_aware must be a bool, got {self.prefix_aware!r}")
        if isinstance(self.hash_seed, bool) or not isinstance(self.hash_seed, int):
            raise ValueError(f"hash_seed must be an integer, got {self.hash_seed!r}")
        if self.cache_rule not in CACHE_RULES:
            raise ValueError(f"cache_rule must be one of {', '.join(CACHE_RULES)}, "
                             f"got {self.cache_rule!r}")


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    seq: SeqId
    start: int  # prompt tokens already in KV before this chunk (cached + earlier chunks)
    tokens: int  # new prompt tokens computed in this chunk (>= 1)
    last: bool  # completes the prompt: the step samples this sequence's first output token


@dataclass(frozen=True, slots=True)
class DecodeSlot:
    seq: SeqId
    context: int  # KV tokens the new token attends to (prompt + outputs so far)


@dataclass(frozen=True, slots=True)
class Step:
    prefills: tuple[PrefillChunk, ...]
    decodes: tuple[DecodeSlot, ...]
    preempted: tuple[SeqId, ...]  # running sequences sent back to waiting (recompute)

    @property
    def prefill_tokens(self) -> int:
        return sum(chunk.tokens for chunk in self.prefills)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def emitting(self) -> tuple[SeqId, ...]:
        """Sequences that get a token from this step: decodes and last prefill chunks."""
        last = tuple(chunk.seq for chunk in self.prefills if chunk.last)
        return last + tuple(slot.seq for slot in self.decodes)


@dataclass(frozen=True, slots=True)
class Finished:
    seq: SeqId
    prompt_tokens: int
    cached_tokens: int  # prompt tokens reused from the cache when it was (last) admitted
    output: tuple[int, ...]  # token ids generated
    reason: str  # "length" | "stop" | "abort"
    preemptions: int
    admitted_at: float  # `now` of its (last) admission (its arrival if never admitted)
    first_token_at: float | None


@dataclass(frozen=True, slots=True)
class SeqView:
    """A live sequence as a reader of the scheduler's state sees it (``Scheduler.sequences``)."""

    seq: SeqId
    prompt: int  # tokens it prefills (its prompt, + outputs to recompute after a preemption)
    computed: int  # of those, in KV (running) or reusable from the cache now (waiting)
    emitted: int  # tokens generated so far
    max_tokens: int
    admitted: bool  # running (False: waiting)


@dataclass(slots=True, eq=False)
class SeqState:
    """The scheduler's state of one sequence (``core/scheduler.py`` only: not for callers)."""

    id: SeqId
    tokens: list[int]  # prompt + outputs so far
    prompt_len: int
    max_tokens: int
    hashes: list[int]  # chained hashes of the whole blocks of what it prefills
    admitted_at: float
    lease: Lease[None] | None = None  # its lock on its cached prefix, while running
    computed: int = 0  # tokens whose KV is in the pool
    cached: int = 0  # leading tokens shared with the cache (whole blocks)
    private: int = 0  # KV blocks of its own
    hit: int = 0  # tokens reused at its last admission
    prefilled: bool = False  # decoding (prefill done since its last admission)
    preemptions: int = 0
    overtaken: int = 0  # admissions that passed it in its current wait
    first_token_at: float | None = None
    hidden: int = 0  # leading tokens of its namespace's virtual block (core/blocks.py)
