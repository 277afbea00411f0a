"""Decode runs: many identical decode-only steps of the scheduler planned and applied at once.

Theory of operation
-------------------
Between two changes of a batch's make-up (an admission, a prefill chunk, a finish, a block that
must be evicted for or a preemption) a continuous-batching engine repeats the same decode step,
each sequence attending to one more KV token each time. A simulator on virtual time need not
visit each of them: ``decode_run`` says how many of the next steps are exactly that,
``decode_step(j)`` is the ``j``-th of them (so a step-time model can time them; for a model
linear in the KV tokens, as ``core/profile.Profile.step_s`` is, two of them give all), and
``apply_decodes`` applies them as ``schedule`` + ``complete`` would have, one by one. Blocks
the run grows into are taken only if free already: a run never evicts or preempts, so those
steps stay with ``schedule``.

A mixin of :class:`~radixmesh.core.scheduler.Scheduler` (kept apart so that module stays
under 400 lines); it reads and changes the scheduler's state directly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from radixmesh.core.kv_pool import KvPool
from radixmesh.core.step import DecodeSlot, Finished, SchedulerConfig, SeqId, SeqState, Step


class DecodeRuns:
    """Decode-run planning over the scheduler's state (declared here, set by it)."""

    config: SchedulerConfig
    steps: int
    _pool: KvPool
    _running: list[SeqState]
    _waiting: deque[SeqState]
    _pending: Step | None

    def _finish(self, s: SeqState, reason: str, now: float) -> Finished:
        raise NotImplementedError

    def decode_run(self, limit: int) -> int:
        """How many of the next steps (at most ``limit``) ``schedule`` would plan as the same
        pure-decode batch: no prefill, no admission possible (nothing waiting, or
        ``max_running`` reached), no finish before the last of them, and the blocks they take
        already free (no eviction, no preemption). 0 when the next step is not one."""
        if self._waiting and len(self._running) < self.config.max_running:
            return 0
        return self._run_bound(limit)

    def _run_bound(self, limit: int) -> int:
        """``decode_run`` but for admissions: the most decode steps the running batch can take
        as one run (requests that arrived since a run was planned wait for its end)."""
        run = self._running
        if self._pending is not None or not run or not all(s.prefilled for s in run):
            return 0
        hi = min(limit, *(s.max_tokens - len(s.tokens) + s.prompt_len for s in run))
        lo, free = 0, self._pool.free_blocks
        while lo < hi:  # the most steps whose new blocks fit the free ones
            mid = (lo + hi + 1) // 2
            if sum(self._run_blocks(s, mid) for s in run) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def decode_step(self, j: int) -> Step:
        """Step ``j`` (0 = the next) of a decode run: what ``schedule`` would plan then."""
        slots = tuple(DecodeSlot(s.id, len(s.tokens) + j) for s in self._running)
        return Step((), slots, ())

    def apply_decodes(
        self, k: int, tokens: Mapping[SeqId, Sequence[int]], now: float
    ) -> list[Finished]:
        """Plan and complete ``k`` decode steps at once, as ``k`` rounds of ``schedule`` +
        ``complete`` would (each sequence gets its ``k`` tokens in order). ``k`` was at most
        ``decode_run`` when the run was planned; requests added since wait for its end (a
        caller on a clock cuts the run at the step during which one arrived)."""
        if k < 1 or self._run_bound(k) < k:
            raise ValueError(f"k: the next {k} steps are not one decode run")
        emitting = list(self._running)
        short = [s.id for s in emitting if len(tokens.get(s.id, ())) < k]
        if short:
            raise ValueError(f"tokens: fewer than {k} for seq {short[0]}")
        for s in emitting:
            extra = self._run_blocks(s, k)
            if not self._pool.grow(extra, ()):
                raise RuntimeError("KV pool accounting broke in a decode run")
            s.private += extra
            s.computed += k
            s.tokens.extend(tokens[s.id][:k])
        self.steps += k
        done = []
        for s in emitting:
            if len(s.tokens) - s.prompt_len >= s.max_tokens:
                done.append(self._finish(s, "length", now))
        return done

    def _run_blocks(self, s: SeqState, k: int) -> int:
        """New private blocks ``s`` takes over ``k`` decode steps."""
        return max(self._pool.blocks_for(s.computed + k, s.cached) - s.private, 0)
