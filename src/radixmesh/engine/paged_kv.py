"""The built-in engine's KV memory: one pool of fixed-size blocks, shared by reference.

Theory of operation
-------------------
The core scheduler (``core/scheduler.py``) decides *how many* KV blocks each sequence and the
prefix cache hold (``core/kv_pool.py`` counts them); this module decides *which* physical
blocks, and holds the tensors::

    k, v : [layers, kv_heads, kv_blocks * block_size, head_dim]     (slot = block * bs + offset)

Every physical block has exactly one owner: the free pool, one running sequence (its private
blocks), or the prefix cache (``_cached``: chained block hash -> block, the same hashes as the
scheduler's cache and the node's index). A sequence's *table* lists its blocks in position order:
first the cached blocks of its reused prefix (owned by the cache: shared, read by reference,
never copied), then its own. The scheduler's cache journal (``drain_cache_delta``: net added and
removed hashes) moves ownership:

* admitted with ``start`` cached tokens: its table starts with the cache's blocks for the first
  ``start / block_size`` hashes of its prompt (``admit``);
* a hash *added* by a sequence whose prefill completed or which finished is one of that
  sequence's own blocks: ownership moves to the cache (``adopt``), no copy; a block it computed
  that another sequence already cached is swapped for the cached one and freed (``dedupe``),
  as the scheduler's ``publish`` does for its block count;
* a hash *removed* (LRU eviction) frees its block (``forget``): the scheduler only evicts
  entries no running sequence locks, so no table still reads it.

The scheduler's private blocks of a sequence are ``ceil((kv - cached) / block_size)``, this
table's length minus its shared head. Its cache count, ``ceil(cached tokens / block_size)``, is a
lower bound of the blocks here: where two cached prefixes part inside a block, each branch's
block is a whole physical block (one per block hash, as in vLLM) though the tree counts the
shared tokens once. So the pool has ``slack`` blocks beyond the scheduler's ``kv_blocks``, and
when ``ensure`` still finds none free it asks ``reclaim`` (the runner evicts the least recently
used unlocked entry through the scheduler's cache, so the journal and the node's index stay
exact) before it gives up.
``kv_bytes_copied`` counts KV bytes ever copied from one slot to another: the executor has no
such path (a prefix hit reads the cached blocks in place), so it stays 0; it is reported so a
regression would show.

Placement: which free block a sequence gets is free to choose, and the decode step's attention
(``engine/paged_attention.py``) reads a context that is one run of consecutive slots as a view
of the pool, where a scattered one must first be gathered (a copy of all of its KV per layer
and step: at 8 x 500 tokens a sixth of a decode step's time). So each sequence is admitted with
the length it expects to reach (prompt + max new tokens) and its first private block opens an
*extent* (``_new_extent``): the first run of that many free blocks (at most an eighth of the
pool; else the longest free run), the rest of it *reserved* for its later blocks (state
``RESERVED`` in ``_state``, one byte a block, so a run is found by ``bytearray.find``).
Reservations only place: they are free blocks (``free_blocks`` counts them) that another
sequence takes when nothing unreserved is left, and the owner then continues after its last
block or in a new extent. A sequence whose table starts with cached blocks continues right
after them when that block is free (often: the extent of the sequence that computed them).
A step's batch (``batch``) lists each decode with a one-run context as a view, every other
decode with its padded slots. A step's forward runs in pieces of at most ``PIECE_TOKENS``
prefill tokens (:func:`pieces`): the KV a piece writes is in the pool before the next reads it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from radixmesh.core.step import PrefillChunk, SeqId, Step

PIECE_TOKENS = 1024  # prefill tokens per model call (``pieces``)
VIEW_MIN_CONTEXT = 64  # a decode reads a one-run context of at least this many as a view ...
VIEW_MAX_BATCH = 16  # ... when the step has at most this many decodes, or its context is long:
VIEW_LONG_CONTEXT = 2048  # on the engine's thread, 2 threads, 8 x 500-token prompts: 8 views
# 3.06-3.22x the tokens/s of one at a time, one gather 2.82x (with 1,024-token pieces; 2.91-3.06
# against 2.82x with 512); a decode step of 4, 8 or 16 with 100-1,500 tokens of context each no
# slower as views, one of 32 x 500 tokens slower (25.98-26.74 against 23.05-24.61 ms)
FREE, RESERVED, USED = 1, 2, 0  # a physical block's state (``PagedKV._state``)
_FREE_RUN = re.compile(rb"\x01+")


def pieces(step: Step, budget: int) -> list[Step]:
    """``step`` cut into consecutive pieces of at most ``budget`` prefill tokens (a chunk split
    across two: its second part reads the first's KV, already written to the pool), the decodes
    with the last piece; their emitting sequences, concatenated, are ``step.emitting``. The same
    tokens and KV as one forward; what changes is the activations' size: a 2,048-token step's MLP
    activations (8 MiB each) spill the CPU's caches: on the 2-core box 8 x 500-token prompts
    went fastest in 1,024-token pieces (the ratio above ``VIEW_LONG_CONTEXT``: 3.06-3.22x
    against 2.91-3.06x in 512-token pieces; 2,048 was slower than either)."""
    out: list[list[PrefillChunk]] = [[]]
    room = budget
    for c in step.prefills:
        start, left = c.start, c.tokens
        while left:
            if room == 0:
                out.append([])
                room = budget
            n = min(left, room)
            out[-1].append(PrefillChunk(c.seq, start, n, c.last and n == left))
            start, left, room = start + n, left - n, room - n
    last = len(out) - 1
    return [Step(tuple(p), step.decodes if i == last else (), ()) for i, p in enumerate(out)]


def slack_blocks(kv_blocks: int) -> int:
    """Physical blocks beyond the scheduler's count (module docstring): 1/16 more, >= 4."""
    return max(kv_blocks // 16, 4)


@dataclass(slots=True)
class StepBatch:
    """What one packed forward attends over (built by ``PagedKV.batch``)."""

    kv: PagedKV
    prefills: list[tuple[int, int, int, torch.Tensor | int]] = field(default_factory=list)
    # (row, tokens, start, context) per prefill chunk: its context's slots [start + tokens],
    # or the first of them when they are one run (read as a view)
    write_runs: list[tuple[int, int, int]] = field(default_factory=list)
    # (row, tokens, first slot): rows whose new K/V go to consecutive slots (a slice copy)
    writes: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # (row, slots): rows ``row ..`` whose new K/V go to these scattered slots
    decode_rows: torch.Tensor | None = None  # [B] rows of the decode tokens
    decode_slots: torch.Tensor | None = None  # [B, Lmax] context slots, padded
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, Lmax] True where a real slot
    decode_views: list[tuple[int, int, int]] = field(default_factory=list)
    # (row, first slot, context) per decode whose context is one run of consecutive slots


class PagedKV:
    """Physical KV blocks; see the module docstring. Not thread-safe (the engine thread's)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, kv_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        kv_blocks += slack_blocks(kv_blocks)
        # torch.empty: a page is committed only when a token is first written there (a big pool
        # costs no memory up front); one more slot, zeroed, pads the decode batch's contexts
        # (garbage there could be NaN, and NaN x a zero attention weight is still NaN).
        shape = (layers, kv_heads, kv_blocks * block_size + 1, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.null_slot = kv_blocks * block_size
        self.k[:, :, self.null_slot].zero_()
        self.v[:, :, self.null_slot].zero_()
        self.block_size = block_size
        self.kv_blocks = kv_blocks
        self.device = device
        self._state = bytearray([FREE]) * kv_blocks  # FREE / RESERVED (also free) / USED
        self._n_free = kv_blocks
        self._expect: dict[SeqId, int] = {}  # blocks a sequence expects to hold at its end
        self._extent: dict[SeqId, tuple[int, int]] = {}  # its reserved blocks [next, end)
        self._cached: dict[int, int] = {}  # block hash -> block
        self._owner: dict[int, int] = {}  # cached block -> its hash
        self._tables: dict[SeqId, list[int]] = {}
        self.kv_bytes_copied = 0

    # ------------------------------------------------------------------------- read-only
    @property
    def free_blocks(self) -> int:
        return self._n_free

    @property
    def cached_blocks(self) -> int:
        return len(self._cached)

    def private_blocks(self, seq: SeqId) -> int:
        return sum(1 for b in self._tables.get(seq, ()) if b not in self._owner)

    def table(self, seq: SeqId) -> list[int]:
        return self._tables[seq]

    def has(self, seq: SeqId) -> bool:
        return seq in self._tables

    # ------------------------------------------------------------------------- ownership
    def admit(self, seq: SeqId, hashes: Sequence[int], cached_tokens: int,
              expect_tokens: int = 0) -> None:
        """A sequence starts (again) reusing the cached blocks of its first ``cached_tokens``;
        it expects to hold ``expect_tokens`` positions at its end (where its blocks go)."""
        if seq in self._tables:
            raise RuntimeError(f"paged KV: seq {seq} admitted twice")
        n = cached_tokens // self.block_size
        self._tables[seq] = [self._cached[h] for h in hashes[:n]]
        self._expect[seq] = -(-expect_tokens // self.block_size)

    def ensure(self, seq: SeqId, kv_tokens: int, reclaim: Callable[[], bool]) -> None:
        """Give ``seq`` blocks for ``kv_tokens`` positions (``reclaim`` frees cached ones)."""
        table = self._tables[seq]
        while len(table) * self.block_size < kv_tokens:
            if not self._n_free and not reclaim():
                raise RuntimeError("paged KV: out of blocks with nothing left to evict")
            if self._n_free:
                table.append(self._take(seq, table))

    def adopt(self, seq: SeqId, hashes: Sequence[int], added: set[int]) -> None:
        """The cache now holds the ``added`` hashes among ``seq``'s blocks: move them."""
        table = self._tables.get(seq, ())
        for i, h in enumerate(hashes[: len(table)]):
            b = table[i]
            if h in added and h not in self._cached and b not in self._owner:
                self._cached[h], self._owner[b] = b, h

    def dedupe(self, seq: SeqId, hashes: Sequence[int]) -> None:
        """Read the cached copy of every leading block the cache holds; free our duplicate."""
        table = self._tables[seq]
        for i, h in enumerate(hashes[: len(table)]):
            b = self._cached.get(h)
            if b is None:
                return
            if table[i] != b:
                self._release_block(table[i])
                table[i] = b

    def drop(self, seq: SeqId) -> None:
        """A sequence left (finished, aborted, preempted): free its own blocks."""
        for b in self._tables.pop(seq, ()):
            self._release_block(b)
        self._unreserve(seq)
        self._expect.pop(seq, None)

    def forget(self, removed: Sequence[int]) -> None:
        """The cache evicted these hashes: free their blocks."""
        for h in removed:
            b = self._cached.pop(h, None)
            if b is not None:
                del self._owner[b]
                self._state[b] = FREE
                self._n_free += 1

    def clear(self) -> list[int]:
        """Drop every cached block (no sequence may be running); the hashes dropped."""
        if self._tables:
            raise RuntimeError("paged KV: cannot clear while sequences hold blocks")
        hashes = list(self._cached)
        self.forget(hashes)
        return hashes

    def _release_block(self, b: int) -> None:
        if b not in self._owner:
            self._state[b] = FREE
            self._n_free += 1

    # ------------------------------------------------------------------------- placement
    def _take(self, seq: SeqId, table: list[int]) -> int:
        """A free block for ``seq``'s next position (one exists), placed to keep its table one
        run of consecutive blocks (module docstring): the next of its reserved extent, else the
        block after its last, else the start of a new extent (``_new_extent``)."""
        state = self._state
        nxt, end = self._extent.get(seq, (0, 0))
        if nxt < end and state[nxt] == RESERVED:
            self._extent[seq] = (nxt + 1, end)
            return self._use(nxt)
        after = table[-1] + 1 if table else self.kv_blocks
        if after < self.kv_blocks and state[after] == FREE:
            return self._use(after)
        self._unreserve(seq)
        start, size = self._new_extent(max(self._expect.get(seq, 0) - len(table), 1))
        for b in range(start + 1, start + size):
            state[b] = RESERVED
        self._extent[seq] = (start + 1, start + size)
        return self._use(start)

    def _new_extent(self, want: int) -> tuple[int, int]:
        """(start, size) of free blocks for a new run: the first ``want`` free in a row
        (capped at an eighth of the pool), else the longest free run, else one reserved
        block (taken from a reservation: reservations only place, never hold)."""
        want = min(want, max(self.kv_blocks // 8, 1))
        start = self._state.find(bytes([FREE]) * want)
        if start >= 0:
            return start, want
        run = max(_FREE_RUN.finditer(self._state), key=lambda m: m.end() - m.start(),
                  default=None)
        if run is not None:
            return run.start(), run.end() - run.start()
        return self._state.index(RESERVED), 1

    def _unreserve(self, seq: SeqId) -> None:
        nxt, end = self._extent.pop(seq, (0, 0))
        for b in range(nxt, end):
            if self._state[b] == RESERVED:
                self._state[b] = FREE

    def _use(self, b: int) -> int:
        self._state[b] = USED
        self._n_free -= 1
        return b

    # ------------------------------------------------------------------------- a step
    def slots(self, seq: SeqId, start: int, stop: int) -> torch.Tensor:
        """Slots of ``seq``'s positions ``start .. stop - 1``."""
        pos = torch.arange(start, stop)
        blocks = torch.tensor(self._tables[seq], dtype=torch.long)
        return (blocks[pos // self.block_size] * self.block_size + pos % self.block_size).to(
            self.device)

    def batch(self, prefills: Sequence[tuple[SeqId, int, int]],
              decodes: Sequence[tuple[SeqId, int]]) -> StepBatch:
        """The packed step: prefill chunks ``(seq, start, n)`` then decodes ``(seq, context)``."""
        out = StepBatch(self)
        row = 0
        for seq, start, n in prefills:
            first = self._run_start(seq, start + n)
            if first is None:
                ctx = self.slots(seq, 0, start + n)
                out.prefills.append((row, n, start, ctx))
                out.writes.append((row, ctx[start:]))
            else:
                out.prefills.append((row, n, start, first))
                out.write_runs.append((row, n, first + start))
            row += n
        gathered: list[tuple[SeqId, int]] = []
        rows: list[int] = []
        few = len(decodes) <= VIEW_MAX_BATCH
        for i, (seq, context) in enumerate(decodes):
            viewed = context >= (VIEW_MIN_CONTEXT if few else VIEW_LONG_CONTEXT)
            first = self._run_start(seq, context) if viewed else None
            if first is None:
                gathered.append((seq, context))
                rows.append(row + i)
            else:
                out.decode_views.append((row + i, first, context))
        if gathered:
            idx, mask, _ = self._decode_slots(gathered)
            out.decode_rows = torch.tensor(rows, device=self.device)
            out.decode_slots, out.decode_mask = idx, mask
        if decodes:
            out.writes.append((row, self._last_slots(decodes)))
        return out

    def _run_start(self, seq: SeqId, ctx: int) -> int | None:
        """The first slot of ``seq``'s context of ``ctx`` positions when they are one run of
        consecutive slots (attention reads them as a view, no gather), else None."""
        table = self._tables[seq]
        n = -(-ctx // self.block_size)
        first = table[0]
        if table[n - 1] - first != n - 1 or table[:n] != list(range(first, first + n)):
            return None
        return first * self.block_size

    def _last_slots(self, decodes: Sequence[tuple[SeqId, int]]) -> torch.Tensor:
        """Each decode's new token's slot (its context's last)."""
        bs = self.block_size
        return torch.tensor([self._tables[seq][(c - 1) // bs] * bs + (c - 1) % bs
                             for seq, c in decodes], device=self.device)

    def _decode_slots(self, decodes: Sequence[tuple[SeqId, int]]
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decodes' context slots ``[B, Lmax]`` (``null_slot`` past each context), their
        mask ``[B, 1, 1, Lmax]`` and each one's last slot ``[B]`` (its new token's), from one
        padded block table: a few tensor ops for the whole batch, not a loop of them."""
        bs = self.block_size
        ctx = torch.tensor([c for _, c in decodes])
        width = -(-int(ctx.max()) // bs)
        rows = [self._tables[seq][:width] for seq, _ in decodes]
        tables = torch.tensor([t + [0] * (width - len(t)) for t in rows])
        pos = torch.arange(width * bs)
        valid = pos < ctx[:, None]
        idx = torch.where(valid, tables[:, pos // bs] * bs + pos % bs, self.null_slot)
        last = idx.gather(1, (ctx - 1)[:, None])[:, 0]
        dev = self.device
        return idx.to(dev), valid[:, None, None, :].to(dev), last.to(dev)
