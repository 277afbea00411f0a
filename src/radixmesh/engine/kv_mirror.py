"""The paged KV blocks kept in step with the core scheduler's plan and cache journal.

Theory of operation
-------------------
:class:`KvMirror` is the part of ``BatchRunner`` (``engine/batch.py``) that touches blocks,
never the model: before a step's forward, :meth:`~KvMirror._prepare` applies the plan to
:class:`~radixmesh.engine.paged_kv.PagedKV` (preempted sequences' tables dropped, evicted
blocks freed, admissions mapped onto cached blocks, blocks for the step's tokens, the pool's
shortage met by evicting the least recently used cache entry: ``_reclaim``); after
``complete``, :meth:`~KvMirror._settle` applies its journal (a sequence whose prompt finished
or that ended has its blocks' hashes chained and the cache's new blocks adopted; an ended one's
table dropped). ``_journal`` folds every add and remove into the node's net delta
(``drain_cache_delta``). All of it runs under the runner's ``lock``.
"""

from __future__ import annotations

import time
from typing import Protocol

from radixmesh.core.blocks import extend_hashes
from radixmesh.core.scheduler import Finished, Scheduler, SchedulerConfig, Step
from radixmesh.engine.paged_kv import PagedKV


class LiveView(Protocol):
    """What the bookkeeping reads and writes of a request in the engine (``batch.Live``)."""

    tokens: list[int]
    output: list[int]
    budget: int  # its max new tokens (with the prompt: where its blocks are placed)
    hashes: list[int]
    admitted: float | None
    seed: int


class KvMirror:
    """The block bookkeeping of ``BatchRunner`` (module docstring); the runner owns the
    state."""

    config: SchedulerConfig
    sched: Scheduler
    kv: PagedKV
    stats: dict[str, int]
    _live: dict[int, LiveView]
    _admitted: int
    _added: set[int]
    _removed: set[int]

    def _prepare(self, step: Step) -> None:
        """Mirror the scheduler's plan in the blocks (under the lock)."""
        for seq in step.preempted:
            self.kv.drop(seq)
        added, removed = self.sched.drain_cache_delta()
        self.kv.forget(removed)
        self._journal(added, removed)
        now = time.perf_counter()
        for chunk in step.prefills:
            live = self._live[chunk.seq]
            if not self.kv.has(chunk.seq):  # admitted (again, after a preemption)
                live.hashes = self._hashes(live, len(live.tokens))
                self.kv.admit(chunk.seq, live.hashes, chunk.start,
                              len(live.tokens) - len(live.output) + live.budget - 1)
                if live.admitted is None:
                    live.admitted = now
                    self._admitted += 1
            self.kv.ensure(chunk.seq, chunk.start + chunk.tokens, self._reclaim)
        for slot in step.decodes:
            self.kv.ensure(slot.seq, slot.context, self._reclaim)

    def _reclaim(self) -> bool:
        """Evict the least recently used unlocked cache entry (``paged_kv``: the pool is short
        of physical blocks); False if there is none."""
        freed = self.sched.cache.evict(1)
        added, removed = self.sched.drain_cache_delta()
        self.kv.forget(removed)
        self._journal(added, removed)
        self.stats["reclaims"] += 1
        return freed > 0

    def _hashes(self, live: LiveView, n_tokens: int) -> list[int]:
        bs = self.config.block_size
        return extend_hashes(live.hashes, live.tokens[:n_tokens], bs, live.seed)

    def _settle(self, step: Step, finished: list[Finished]) -> None:
        """Apply the cache journal of ``complete`` to the blocks (under the lock)."""
        kv_len = {c.seq: c.start + c.tokens for c in step.prefills if c.last}
        kv_len.update((d.seq, d.context) for d in step.decodes)
        added, removed = self.sched.drain_cache_delta()
        fresh = set(added)
        ended = {f.seq for f in finished}
        for seq, n in kv_len.items():
            live = self._live[seq]
            last = any(c.seq == seq and c.last for c in step.prefills)
            if not (last or seq in ended):
                continue
            live.hashes = self._hashes(live, n)
            if fresh:
                self.kv.adopt(seq, live.hashes, fresh)
            if seq in ended:
                self.kv.drop(seq)
            else:
                self.kv.dedupe(seq, live.hashes)
        self.kv.forget(removed)
        self._journal(added, removed)

    def _journal(self, added: list[int], removed: list[int]) -> None:
        for h in removed:
            if h in self._added:
                self._added.discard(h)
            else:
                self._removed.add(h)
        for h in added:
            if h in self._removed:
                self._removed.discard(h)
            else:
                self._added.add(h)
