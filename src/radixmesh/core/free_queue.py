"""Which cached blocks an engine will evict before a request is scheduled: vLLM's free block
queue, estimated from what a node in front of it sees.

Theory of operation
-------------------
vLLM v1 (``vllm/v1/core/block_pool.py`` and ``kv_cache_utils.py`` ``FreeKVCacheBlockQueue``,
as of 0.32) keeps every block whose reference count is 0 in one queue. Allocation pops from
its head; a popped block that still holds a cached prefix is evicted then (``BlockRemoved``).
A finished request frees its blocks in reverse order (its deepest block first): those still
naming a cached prefix are appended to the tail (LRU), the others are prepended to the head
(reused first). A prefix hit takes a block out of the queue (``touch``). One block of
``num_gpu_blocks`` is the null block and never allocated. So the queue is::

    head: [uncached free blocks] [cached free blocks, least recently freed first] :tail

and a request scheduled after ``n`` allocations evicts nothing until the uncached ones run
out, then the cached blocks in the order they were freed, the deepest block of each request
first (its prefix chain is cut from the end).

A node knows most of this: the cached blocks (its index, from the engine's events), the
requests it sent and their prompts (so the blocks each holds while it runs), and the order in
which they finished (:class:`FreeOrder`: a cached block's place is the finish of the last
request that held it, deepest first). Blocks cached by requests the node never saw are put at
the head (oldest). When it accepts a request it knows the requests ahead of it that the engine
has not scheduled yet (sent, their blocks not yet stored; :class:`EngineQueue` keeps them).
:func:`surviving_blocks` plays the
queue forward: each waiting request in turn touches the leading blocks of its chain still
cached, allocates the rest of its blocks (the uncached free ones first, then the queue's
head), and caches its full blocks; what is left of the new request's chain is what the engine
will find.

What it cannot know: requests that finish in between (their uncached blocks go back to the
head and delay evictions: the estimate is then an upper bound on evictions), and the precise
moment the engine schedules a request (the node sees its events after the step). Keys are the
mesh's block hashes, one per engine block (the mesh block equals the engine block in front of
vLLM: ``engine/http_engine.py`` ``mesh_block_size``). Pure: no I/O, no clock.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass

Key = Hashable


@dataclass(frozen=True, slots=True)
class Held:
    """A request as the engine will hold it: the keys of its prompt's full blocks (root
    first; the last one left out when it ends the prompt exactly, since the engine computes at
    least one token) and every block it allocates (its prompt's, the last partial one
    included)."""

    chain: tuple[Key, ...]
    blocks: int

    def __post_init__(self) -> None:
        if self.blocks < len(self.chain):
            raise ValueError(f"blocks ({self.blocks}) must be at least the chain's length "
                             f"({len(self.chain)})")

    @classmethod
    def of_prompt(cls, keys: Sequence[Key], prompt_tokens: int, block_size: int) -> Held:
        """From the prompt's full-block keys (``block_hashes`` at the engine's block size)."""
        if block_size < 1 or prompt_tokens < 0:
            raise ValueError("block_size must be positive and prompt_tokens >= 0")
        full = max(prompt_tokens - 1, 0) // block_size
        return cls(tuple(keys[:full]), -(-prompt_tokens // block_size))


class FreeOrder:
    """The order in which cached blocks became free, as far as the node saw requests finish."""

    def __init__(self) -> None:
        self._stamp: dict[Key, tuple[int, int]] = {}
        self._finished = 0

    def __len__(self) -> int:
        return len(self._stamp)

    def release(self, chain: Sequence[Key]) -> None:
        """A request holding ``chain`` finished: its blocks join the tail, deepest first (a
        block another running request still holds joins later, with that one's release)."""
        self._finished += 1
        for depth, key in enumerate(chain):
            self._stamp[key] = (self._finished, -depth)

    def free_blocks(self, cached: Collection[Key], held: Collection[Key],
                    limit: int | None = None) -> list[Key]:
        """The cached blocks not ``held``, in eviction order (the first ``limit``); blocks
        never released (cached by requests the node did not see) first. Stamps of blocks no
        longer cached are dropped."""
        for key in [k for k in self._stamp if k not in cached]:
            del self._stamp[key]
        free = [k for k in cached if k not in held]
        unknown = [k for k in free if k not in self._stamp]
        known = [k for k in free if k in self._stamp]
        if limit is None:
            return unknown + sorted(known, key=self._stamp.__getitem__)
        rest = max(limit - len(unknown), 0)
        return (unknown + heapq.nsmallest(rest, known, key=self._stamp.__getitem__))[:limit]


def uncached_free(capacity: int, cached: int, running: Iterable[Held]) -> int:
    """Free blocks that hold no cached prefix: ``capacity`` (usable blocks: vLLM's
    ``num_gpu_blocks`` less its null block) less the cached ones less the uncached blocks of
    the requests running now (their partial blocks)."""
    return max(capacity - cached - sum(r.blocks - len(r.chain) for r in running), 0)


def surviving_blocks(chain: Sequence[Key], *, free: Sequence[Key], cached: Collection[Key],
                     uncached: int, waiting: Sequence[Held]) -> int:
    """Leading blocks of ``chain`` still cached when the engine schedules the request, after
    the ``waiting`` requests ahead of it (in the engine's order). ``free``: the cached blocks
    in the queue, eviction order (:meth:`FreeOrder.free_blocks`); ``cached``: every cached
    block (free or held); ``uncached``: free blocks ahead of them (:func:`uncached_free`)."""
    if uncached < 0:
        raise ValueError("uncached must be >= 0")
    queue = dict.fromkeys(free)  # insertion-ordered: the head first
    present = set(cached) | set(queue)
    for req in waiting:
        hit = _leading(req.chain, present)
        for key in req.chain[:hit]:
            queue.pop(key, None)
        need = req.blocks - hit
        take = min(need, uncached)
        uncached -= take
        for _ in range(min(need - take, len(queue))):
            victim = next(iter(queue))
            del queue[victim]
            present.discard(victim)
        present.update(req.chain[hit:])
    return _leading(chain, present)


class EngineQueue:
    """The requests a node has in flight at one engine, in the order it sent them (running
    once their first token came, else waiting), and the order its requests finished:
    :func:`surviving_blocks` for a request sent now. A request the engine has scheduled but
    whose first token has not come yet counts as waiting: its blocks' stores (if seen) make
    it a hit of its own chain, so it allocates only what it would anyway."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 block, got {capacity}")
        self.capacity = capacity
        self.order = FreeOrder()
        self._flight: dict[Hashable, Held] = {}
        self._running: set[Hashable] = set()

    def __len__(self) -> int:
        return len(self._flight)

    def sent(self, rid: Hashable, held: Held) -> None:
        self._flight[rid] = held

    def started(self, rid: Hashable) -> None:
        """Its first token came: the engine holds its blocks."""
        if rid in self._flight:
            self._running.add(rid)

    def finished(self, rid: Hashable, chain: Sequence[Key] | None = None) -> None:
        """Request ``rid``'s stream ended: its blocks (``chain``: its prompt's and output's
        full blocks; by default its prompt's) go to the queue's tail."""
        held = self._flight.pop(rid, None)
        self._running.discard(rid)
        if chain is None:
            chain = held.chain if held is not None else ()
        self.order.release(chain)

    def surviving(self, chain: Sequence[Key], cached: Collection[Key]) -> int:
        """Leading blocks of ``chain`` (a request sent now) the engine will hold when it
        schedules it, after the requests waiting ahead of it (which may also store some)."""
        running = [h for rid, h in self._flight.items() if rid in self._running]
        waiting = [h for rid, h in self._flight.items() if rid not in self._running]
        uncached = uncached_free(self.capacity, len(cached), running)
        short = sum(h.blocks for h in waiting) - uncached
        if short <= 0:  # the uncached free blocks cover every allocation ahead
            return _leading(chain, set(cached).union(*(h.chain for h in waiting)))
        held = {k for h in running for k in h.chain}
        free = self.order.free_blocks(cached, held, short + sum(len(h.chain) for h in waiting))
        return surviving_blocks(chain, free=free, cached=cached, uncached=uncached,
                                waiting=waiting)


def _leading(chain: Sequence[Key], present: Collection[Key]) -> int:
    n = 0
    for key in chain:
        if key not in present:
            break
        n += 1
    return n
