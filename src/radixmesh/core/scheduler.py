"""The continuous-batching engine scheduler: waiting queue, running batch, one shared KV pool.

Theory of operation
-------------------
One scheduler, in the style of vLLM's V1 scheduler (vllm/v1/core/sched/scheduler.py), for every
engine of the project (the emulated engine on the wall clock, the simulator on virtual time).
Pure: ``now`` is passed in, nothing is random. A caller loops::

    step = sched.schedule(now)        # who computes what in the next forward pass
    ... run it (or time it: core/profile.Profile.step_s(step)) ...
    done = sched.complete(step, {seq: token for seq in step.emitting}, now)

``schedule`` plans a step within a token budget (``step_tokens``, vLLM's
``max_num_batched_tokens``), in this order:

1. running sequences, oldest admission first: each decoding one gets a decode slot (its token
   is reserved from the budget first), each still prefilling gets its next prompt chunk
   (chunked prefill) from what budget is left;
2. if nothing was preempted in this step (as vLLM), waiting requests are admitted in queue order
   while budget, ``max_running`` (vLLM's ``max_num_seqs``) and KV blocks allow; an admitted
   request reuses its cached prefix (whole blocks, ``core/kv_pool.py``) and its first chunk
   starts there. Admission stops at the first request that does not fit.

KV blocks come from ``core/kv_pool.KvPool``: free blocks, then LRU cache entries no queued
request would reuse, then any unlocked entry; when that is not enough, the most recently
admitted running sequence not yet planned in this step is preempted (vLLM's recompute
preemption: its KV freed, its outputs kept, it goes back to the FRONT of waiting and later
recomputes prompt + outputs as its prompt). A sequence preempting itself leaves the step.

``complete`` applies the step: each emitting sequence (decodes and last chunks) gets its token;
a sequence finishes at ``max_tokens`` outputs ("length") or when listed in ``stop``. When a
prompt's prefill completes its whole blocks enter the prefix cache at once, so followers hit
while the pioneer decodes; a finished sequence commits prompt +
output[:-1] (the last token's KV was never computed).

``cache_rule="vllm"`` (an engine emulating vLLM 0.32; read from its source, vllm/v1/core/):
a chunk's whole blocks enter the cache when it is *scheduled* (``kv_cache_manager.py``
``allocate_slots`` -> ``cache_blocks``), so a request admitted later in the same step hits them
(each layer writes the step's KV before its attention reads it); a request is admitted only if
its whole prompt fits (``scheduler_reserve_full_isl``, on by default); the pool counts distinct
blocks and evicts block by block, the least recently freed first and a request's tail before its
head, sparing nothing (``block_pool.py``, ``single_type_kv_cache_manager.py`` ``free``); a block
computed again though cached stays the sequence's own; a preempted request reports its first
admission's hit (``sched/scheduler.py``: ``prefill_stats``). vLLM has no "pioneers first": its
profiles also say ``prefix_aware=False``.

Prefix-aware admission ("pioneers first", as SGLang's in-batch prefix caching in
python/sglang/srt/managers/schedule_policy.py deprioritises a waiting request whose prefix an
earlier request in the batch will compute): a waiting request whose prompt shares at least one
whole block beyond its own cached prefix with a running sequence still prefilling is deferred
until that prefill completes — it then hits the cache instead of computing the prefix twice.
Later requests may pass it, but each admission that passes a waiting request counts against it
and a request passed ``max_overtake`` times is no longer deferred. Shared blocks are found by
chained block hashes (``core/blocks.py``): the running prefilling sequences' hashes are counted
in a multiset, and since hashes chain, a waiting request's matching hashes are a prefix of its
own. ``prefix_aware=False`` is strict FCFS.

Cache namespaces (``add(..., namespace=)``, ``core/blocks.py``): a namespaced request runs as
its namespace's virtual block + its prompt, so the cache keeps namespaces apart under the mesh's
namespaced hashes; the block is reported nowhere (``Finished``, ``drain_cache_delta``).

Cost: a step is O(running + admitted + 64): at most the first ``WINDOW`` waiting requests are
looked at, so a long queue costs nothing per step.
Why 400 lines: plan, admit, preempt and complete share one SeqState book (the rest is split).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from itertools import islice

from radixmesh.core.blocks import NamespaceHeads, block_hashes, extend_hashes
from radixmesh.core.decode_run import DecodeRuns
from radixmesh.core.kv_pool import KvPool
from radixmesh.core.prefix_cache import PrefixCache
from radixmesh.core.step import (
    DecodeSlot,
    Finished,
    PrefillChunk,
    SchedulerConfig,
    SeqId,
    SeqState,
    SeqView,
    Step,
)

__all__ = [
    "DecodeSlot",
    "Finished",
    "PrefillChunk",
    "Scheduler",
    "SchedulerConfig",
    "SeqId",
    "Step",
]

WINDOW = 64  # waiting requests looked at per step (admission, eviction sparing)


class Scheduler(DecodeRuns):
    """Continuous batching over one KV pool; see the module docstring."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._vllm = config.cache_rule == "vllm"
        self._pool = KvPool(config.kv_blocks, config.block_size, config.hash_seed, self._vllm)
        self.cache: PrefixCache[None] = self._pool.cache  # read it only
        self._seqs: dict[SeqId, SeqState] = {}
        self._waiting: deque[SeqState] = deque()
        self._running: list[SeqState] = []  # admission order
        self._prefilling: Counter[int] = Counter()  # block hashes of prefilling sequences
        self._heads = NamespaceHeads(config.block_size, config.hash_seed)
        self._pending: Step | None = None
        self._copies: dict[SeqId, int] = {}  # cache_rule "vllm": blocks a sequence computed
        # again although cached (vLLM keeps such a copy as the sequence's own block)
        self.prefill_tokens_computed = 0
        self.cached_tokens_hit = 0
        self.preemptions = 0
        self.steps = 0

    # ------------------------------------------------------------------------- read-only
    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_used_blocks(self) -> int:
        """Blocks in use: the whole prefix cache plus running sequences' own blocks."""
        return self._pool.used_blocks

    @property
    def kv_usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: blocks held by running sequences (their own and
        the cached prefixes they lock) over the pool; unlocked cached blocks count as free."""
        return self._pool.held_blocks / self.config.kv_blocks

    def cached_prefix(self, prompt: Sequence[int], namespace: str | None = None) -> int:
        """Prompt tokens a request added now would reuse (whole blocks, never the last)."""
        head = self._heads.head(namespace)
        return max(self._pool.reusable([*head, *prompt]) - len(head), 0)

    def sequences(self) -> Iterator[SeqView]:
        """The running sequences (admission order), then the first ``WINDOW`` waiting ones
        (what a report of the engine's state reads: ``core/shadow.py``)."""
        for s in self._running:
            yield SeqView(s.id, s.prompt_len if s.prefilled else len(s.tokens),
                          min(s.computed, len(s.tokens)), len(s.tokens) - s.prompt_len,
                          s.max_tokens, True)
        for s in islice(self._waiting, WINDOW):
            yield SeqView(s.id, len(s.tokens), self._pool.reusable(s.tokens),
                          len(s.tokens) - s.prompt_len, s.max_tokens, False)

    def seq_tokens(self, seq: SeqId) -> Sequence[int]:
        """Prompt + output so far of a live sequence (behind its namespace's virtual block)."""
        return tuple(self._live(seq).tokens)

    def cache_hashes(self) -> frozenset[int]:
        """Every block hash cached now (namespaces' virtual blocks left out)."""
        return frozenset(self._heads.real(list(self.cache.block_hashes())))

    def drain_cache_delta(self) -> tuple[list[int], list[int]]:
        """Block hashes (added, removed) in the prefix cache since the previous call
        (namespaces' virtual blocks left out)."""
        added, removed = self.cache.drain_delta()
        return self._heads.real(added), self._heads.real(removed)

    # ------------------------------------------------------------------------- requests
    def add(self, seq: SeqId, prompt: Sequence[int], max_tokens: int, now: float, *,
            namespace: str | None = None) -> None:
        """Queue a request at the back of waiting (in ``namespace``'s cache, if given)."""
        if seq in self._seqs:
            raise ValueError(f"seq: duplicate id {seq}")
        if len(prompt) == 0:
            raise ValueError("prompt: must not be empty")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        tokens = [*self._heads.head(namespace), *prompt]
        if self._pool.blocks_for(len(tokens) + max_tokens - 1, 0) > self.config.kv_blocks:
            raise ValueError(
                f"prompt + max_tokens: {len(tokens)} + {max_tokens} tokens never fit the KV "
                f"pool of {self.config.kv_blocks} x {self.config.block_size} tokens"
            )
        hashes = block_hashes(tokens, self.config.block_size, self.config.hash_seed)
        s = SeqState(seq, tokens, len(tokens), max_tokens, hashes, now,
                     hidden=len(tokens) - len(prompt))
        self._seqs[seq] = s
        self._waiting.append(s)

    def abort(self, seq: SeqId, now: float) -> Finished | None:
        """End a request wherever it is; None if unknown or already finished."""
        s = self._seqs.get(seq)
        if s is None:
            return None
        if s.lease is None:
            self._waiting.remove(s)
            del self._seqs[seq]
            return self._record(s, "abort")
        return self._finish(s, "abort", now)

    # ------------------------------------------------------------------------- stepping
    def schedule(self, now: float) -> Step:
        """Plan the next step (may preempt); an empty step when there is nothing to run."""
        if self._pending is not None:
            raise RuntimeError("complete() the previous step before scheduling another")
        budget = self.config.step_tokens - sum(1 for s in self._running if s.prefilled)
        prefills: list[PrefillChunk] = []
        decodes: list[DecodeSlot] = []
        preempted: list[SeqId] = []
        i = 0
        while i < len(self._running):
            s = self._running[i]
            n = 1 if s.prefilled else min(len(s.tokens) - s.computed, budget)
            if n <= 0:
                i += 1
                continue
            if not self._reserve(s, s.computed + n, preempted, now):
                continue  # it preempted itself: it was the last of the list
            if s.prefilled:
                decodes.append(DecodeSlot(s.id, len(s.tokens)))
            else:
                prefills.append(PrefillChunk(s.id, s.computed, n, s.computed + n == len(s.tokens)))
                budget -= n
                self._cache_scheduled(s, s.computed + n, now)
            i += 1
        if not preempted:
            self._admit(budget, prefills, now)
        step = Step(tuple(prefills), tuple(decodes), tuple(preempted))
        self._pending = None if step.empty else step
        return step

    def complete(
        self,
        step: Step,
        tokens: Mapping[SeqId, int],
        now: float,
        stop: Collection[SeqId] = (),
    ) -> list[Finished]:
        """Apply a step planned by ``schedule``: compute its KV, append each emitting
        sequence's token, finish those at ``max_tokens`` or in ``stop``."""
        if step.empty:
            return []
        if step is not self._pending:
            raise RuntimeError("complete() takes the step the last schedule() returned")
        emitting = [s for s in map(self._seqs.get, step.emitting) if s is not None]
        missing = [s.id for s in emitting if s.id not in tokens]
        if missing:
            raise ValueError(f"tokens: no token for emitting seq {missing[0]}")
        self._pending = None
        self.steps += 1
        for chunk in step.prefills:
            s = self._seqs.get(chunk.seq)
            if s is not None:
                s.computed += chunk.tokens
                self.prefill_tokens_computed += chunk.tokens
                if chunk.last:
                    self._prefill_done(s, now)
        for slot in step.decodes:
            s = self._seqs.get(slot.seq)
            if s is not None:
                s.computed += 1
        return self._emit(emitting, tokens, stop, now)

    # ------------------------------------------------------------------------- helpers
    def _live(self, seq: SeqId) -> SeqState:
        s = self._seqs.get(seq)
        if s is None:
            raise ValueError(f"seq: unknown or finished id {seq}")
        return s

    def _reserve(self, s: SeqState, kv_tokens: int, preempted: list[SeqId], now: float) -> bool:
        """Give ``s`` the blocks for ``kv_tokens`` KV tokens, preempting from the tail of
        running (never one planned earlier in this step); False if ``s`` itself went."""
        need = self._pool.blocks_for(kv_tokens, s.cached) - s.private
        while not self._pool.grow(need, self._spare(islice(self._waiting, WINDOW))):
            victim = self._running[-1]
            self._preempt(victim)
            preempted.append(victim.id)
            if victim is s:
                return False
        s.private += need
        return True

    def _spare(self, waiting: Iterable[SeqState]) -> list[list[int]]:
        """The prompts eviction should keep for ``waiting`` (none under vLLM's rules)."""
        return [] if self._vllm else [w.tokens for w in waiting]

    def _admit(self, budget: int, prefills: list[PrefillChunk], now: float) -> None:
        """Admit from the first ``WINDOW`` waiting requests in order, skipping deferred ones;
        each admission counts against every skipped one ahead of it, and once one of them has
        been passed ``max_overtake`` times the scan restarts at it (it is no longer deferred)."""
        window = deque(self._waiting.popleft() for _ in range(min(WINDOW, len(self._waiting))))
        spare = self._spare(window)
        skipped: list[SeqState] = []
        while window and budget > 0 and len(self._running) < self.config.max_running:
            c = window.popleft()
            if self._defers(c):
                skipped.append(c)
                continue
            chunk = self._try_admit(c, budget, spare, now)
            if chunk is None:
                window.appendleft(c)
                break
            prefills.append(chunk)
            budget -= chunk.tokens
            for passed in skipped:
                passed.overtaken += 1
            if any(p.overtaken >= self.config.max_overtake for p in skipped):
                window.extendleft(reversed(skipped))
                skipped = []
        self._waiting.extendleft(reversed(skipped + list(window)))

    def _defers(self, c: SeqState) -> bool:
        """A running prefill will compute >= 1 whole real block of ``c`` beyond its cached
        prefix (a namespace's virtual block alone costs nothing: no deferral for it)."""
        cfg = self.config
        if not cfg.prefix_aware or not self._prefilling or c.overtaken >= cfg.max_overtake:
            return False
        shared = 0
        for h in c.hashes:
            if h not in self._prefilling:
                break
            shared += 1
        return shared * self.config.block_size > max(self._pool.reusable(c.tokens), c.hidden)

    def _try_admit(
        self, c: SeqState, budget: int, spare: list[list[int]], now: float
    ) -> PrefillChunk | None:
        lease = self._pool.lock(c.tokens, now)
        cached = lease.cached
        n = min(len(c.tokens) - cached, budget)
        need = self._pool.blocks_for(cached + n, cached)
        whole = self._pool.blocks_for(len(c.tokens), cached) if self._vllm else need
        if whole > self._pool.room or not self._pool.grow(need, spare):
            self.cache.release(lease)
            return None
        c.lease, c.cached, c.computed, c.private = lease, cached, cached, need
        if not (self._vllm and c.preemptions):  # vLLM reports a request's first admission's
            c.hit = cached  # hit (vllm/v1/core/sched/scheduler.py: prefill_stats)
        c.admitted_at, c.overtaken = now, 0
        self._running.append(c)
        self._prefilling.update(c.hashes)
        self.cached_tokens_hit += cached
        self._cache_scheduled(c, cached + n, now)
        return PrefillChunk(c.id, cached, n, cached + n == len(c.tokens))

    def _prefill_done(self, s: SeqState, now: float) -> None:
        """Its prompt is computed: move its whole blocks into the cache, shared from now."""
        assert s.lease is not None
        self._unmark_prefilling(s)
        s.prefilled = True
        s.lease = self._pool.publish(s.lease, s.tokens[: s.computed], s.private, now)
        s.cached = s.lease.cached
        s.private = self._pool.blocks_for(s.computed, s.cached)
        if not self._pool.grow(s.private, ()):
            raise RuntimeError("KV pool accounting broke while caching a prompt")

    def _cache_scheduled(self, s: SeqState, kv_tokens: int, now: float) -> None:
        """``cache_rule="vllm"``: the whole blocks of the first ``kv_tokens`` tokens enter the
        cache as soon as the chunk computing them is scheduled (its KV is written before any
        attention of the step reads it), locked for ``s``; its private blocks shrink to the
        partial last block."""
        if not self._vllm or kv_tokens < s.cached + self.config.block_size:
            return
        assert s.lease is not None
        bs = self.config.block_size
        there = min(self._pool.cache.match(s.tokens[:kv_tokens]), kv_tokens) // bs * bs
        copies = max(there - s.cached, 0) // bs  # computed again, cached already
        s.lease = self._pool.publish(s.lease, s.tokens[:kv_tokens], s.private, now)
        s.cached = s.lease.cached
        s.private = self._pool.blocks_for(kv_tokens, s.cached)
        self._copies[s.id] = self._copies.get(s.id, 0) + copies
        if not self._pool.grow(s.private + copies, ()):
            raise RuntimeError("KV pool accounting broke while caching a scheduled chunk")

    def _unmark_prefilling(self, s: SeqState) -> None:
        if not s.prefilled:
            self._prefilling.subtract(s.hashes)
            for h in s.hashes:
                if self._prefilling.get(h, 0) <= 0:
                    self._prefilling.pop(h, None)

    def _emit(
        self,
        emitting: list[SeqState],
        tokens: Mapping[SeqId, int],
        stop: Collection[SeqId],
        now: float,
    ) -> list[Finished]:
        done: list[Finished] = []
        for s in emitting:
            s.tokens.append(tokens[s.id])
            if s.first_token_at is None:
                s.first_token_at = now
            if len(s.tokens) - s.prompt_len >= s.max_tokens:
                done.append(self._finish(s, "length", now))
            elif s.id in stop:
                done.append(self._finish(s, "stop", now))
        return done

    def _preempt(self, s: SeqState) -> None:
        """Recompute preemption: free its KV, keep its outputs, back to the front of waiting."""
        self._unmark_prefilling(s)
        assert s.lease is not None
        self._pool.release(s.lease, s.private + self._copies.pop(s.id, 0), None, 0.0)
        s.lease, s.private, s.computed, s.cached, s.prefilled = None, 0, 0, 0, False
        s.preemptions += 1
        s.overtaken = 0
        s.hashes = extend_hashes(s.hashes, s.tokens, self.config.block_size, self.config.hash_seed)
        self._running.remove(s)
        self._waiting.appendleft(s)
        self.preemptions += 1

    def _finish(self, s: SeqState, reason: str, now: float) -> Finished:
        assert s.lease is not None
        self._unmark_prefilling(s)
        commit = None if reason == "abort" else s.tokens[: s.computed]
        self._pool.release(s.lease, s.private + self._copies.pop(s.id, 0), commit, now)
        s.lease, s.private = None, 0
        self._running.remove(s)
        del self._seqs[s.id]
        return self._record(s, reason)

    @staticmethod
    def _record(s: SeqState, reason: str) -> Finished:
        return Finished(
            s.id,
            s.prompt_len - s.hidden,
            max(s.hit - s.hidden, 0),
            tuple(s.tokens[s.prompt_len :]),
            reason,
            s.preemptions,
            s.admitted_at,
            s.first_token_at,
        )
