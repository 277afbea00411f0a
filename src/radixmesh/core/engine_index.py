"""The node's exact index of an external engine's KV cache, rebuilt from its events.

Theory of operation
-------------------
An engine names its blocks by hashes that depend on its version, hash algorithm and seed, so
they are never mesh keys. The index keeps, per engine block, its token ids and its parent's
engine hash (the *store*); from these it knows the full token prefix of every block whose
chain of ancestors is all present, and names that prefix with radixmesh's own chained hashes
(:func:`radixmesh.core.blocks.block_hashes`, block size ``B``, the fingerprint seed).

A block is *rooted* when it is present, not opaque, and its parent is rooted (or it has
none). Only rooted blocks contribute hashes: radixmesh block ``j`` (tokens ``[jB, (j+1)B)``)
belongs to the rooted engine block whose tokens contain position ``(j+1)B - 1``. Each rooted
block keeps ``depth`` (tokens from the root to its end) and ``last`` (the radixmesh hash at the
last boundary at or before its end), so a child computes its hashes from its parent's
``last``, plus — when it starts mid radixmesh block (engine blocks smaller than ``B``, e.g.
SGLang pages of 1 or 4) — the missing tokens read back from its ancestors. Engine blocks of
any size that ``B`` divides, or that divide ``B``, work; other sizes are refused.

Removing an engine block un-roots it and every rooted block below it (their hashes leave the
index) but keeps the descendants in the store: an engine may evict a parent and keep the
child, and when the parent is stored again its subtree is rooted again. A root block
with a ``cache_salt`` (``EngineBlockStored.salt``: vLLM's only extra key, or SGLang's field;
``core/kv_events``) is indexed in that
namespace: its chain starts from ``namespace_seed(seed, salt)`` (``core/blocks.py``; the node
sends the namespace as the salt), so it matches only ``match(tokens, namespace=salt)``.
Blocks with a LoRA
adapter or other extra keys (images) are stored *opaque*: their KV is not named by the
tokens alone, so neither they nor anything chained below them is ever indexed. Blocks outside
device memory, of another KV group (hybrid models) or of a group that is not full attention
(vLLM's ``kv_cache_spec_kind``: sliding window, mamba, ...) are skipped without being stored.

An engine reuses whole blocks of its own size only: with engine blocks larger than the mesh's
(vLLM's CPU build defaults to 128, its kernels need multiples of 32), a prefix matched up to a
mesh boundary inside an engine block is not a hit there. :attr:`EngineIndex.reuse_block_size`
says that granularity; the engine shell floors its prediction to it.

The hash set is reference counted (two engine blocks may name the same prefix) and changes
are accumulated for :meth:`EngineIndex.drain_delta`, which feeds ``CacheChanged``. Everything
a misbehaving engine can send is counted, never raised.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

from radixmesh.core.blocks import block_hashes, namespace_seed
from radixmesh.core.kv_events import (
    EngineAllCleared,
    EngineBlockRemoved,
    EngineBlockStored,
    EngineHash,
    KvBatch,
    KvEvent,
    is_device_medium,
    is_full_attention,
)

_UINT32 = next(code for code in ("I", "L") if array(code).itemsize == 4)
# blocks the index holds at most, whatever their size (~0.6 kB each: an engine announcing
# one-token blocks, SGLang's page size 1, could otherwise fill 2**26 tokens' worth, ~39 GB);
# 2M blocks are 32M tokens at vLLM's 16 a block, beyond any one engine's KV cache
MAX_BLOCKS = 1 << 21
_COUNTS = (
    "batches",
    "events",
    "blocks_stored",
    "blocks_removed",
    "duplicate_stores",
    "replaced_stores",
    "opaque_blocks",
    "skipped_medium",
    "skipped_group",
    "skipped_kind",
    "rejected_block_size",
    "over_capacity",
    "unknown_removals",
    "unknown_events",
    "clears",
    "drops",
)


class EngineConfigError(ValueError):
    """The engine's block size and the mesh's cannot be reconciled."""


def check_block_sizes(engine_block_size: int, block_size: int) -> None:
    """Raise :class:`EngineConfigError` unless one block size divides the other."""
    if engine_block_size < 1 or block_size < 1:
        raise EngineConfigError("block sizes must be positive")
    if engine_block_size % block_size and block_size % engine_block_size:
        raise EngineConfigError(
            f"engine block size {engine_block_size} and mesh block size {block_size}: one must "
            "divide the other (set the mesh block size to a divisor or multiple of the engine's)"
        )


class _Block:
    """One engine block in the store."""

    __slots__ = ("depth", "hashes", "last", "opaque", "parent", "rooted", "salt", "tokens")

    def __init__(self, parent: EngineHash | None, tokens: array[int], opaque: bool,
                 salt: str | None = None) -> None:
        self.parent = parent
        self.tokens = tokens
        self.opaque = opaque
        self.salt = salt  # a root block's cache_salt: its chain is in that namespace
        self.rooted = False
        self.depth = 0  # tokens from the root to this block's end (while rooted)
        self.last = 0  # radixmesh hash at the last boundary <= depth (while rooted)
        self.hashes: tuple[int, ...] = ()  # radixmesh hashes this block contributes


class EngineIndex:
    """Exact radixmesh block-hash set of one engine's device cache, from its KV events."""

    def __init__(
        self,
        block_size: int,
        seed: int,
        *,
        engine_block_size: int | None = None,
        group_idx: int = 0,
        max_tokens: int = 1 << 26,
        max_blocks: int = MAX_BLOCKS,
    ) -> None:
        if engine_block_size is not None:
            check_block_sizes(engine_block_size, block_size)
        if block_size < 1 or group_idx < 0 or max_tokens < 1 or max_blocks < 1:
            raise ValueError("block_size, max_tokens and max_blocks must be positive, "
                             "group_idx >= 0")
        self.block_size = block_size
        self.seed = seed
        self.engine_block_size = engine_block_size
        self.group_idx = group_idx
        self.max_tokens = max_tokens
        self.max_blocks = max_blocks
        self.config_error: str | None = None  # set by the first refused block size
        self.observed_block_size: int | None = None  # of the last accepted BlockStored
        self._counts = dict.fromkeys(_COUNTS, 0)
        self._reset_state()
        self._added: set[int] = set()
        self._removed: set[int] = set()

    def _reset_state(self) -> None:
        self._blocks: dict[EngineHash, _Block] = {}
        self._children: dict[EngineHash, set[EngineHash]] = {}
        self._refs: dict[int, int] = {}
        self._tokens = 0

    # ------------------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._refs)

    def __contains__(self, item: object) -> bool:
        return item in self._refs

    def hashes(self) -> frozenset[int]:
        """The radixmesh block hashes the engine holds right now."""
        return frozenset(self._refs)

    @property
    def indexed_tokens(self) -> int:
        return len(self._refs) * self.block_size

    @property
    def stored_tokens(self) -> int:
        """Token ids held in the store (incl. blocks not indexable now)."""
        return self._tokens

    def match(self, tokens: Sequence[int], namespace: str | None = None) -> int:
        """Tokens of the longest indexed prefix of ``tokens`` in ``namespace`` (a multiple of
        the block size)."""
        n = 0
        seed = namespace_seed(self.seed, namespace, self.block_size)
        for h in block_hashes(tokens, self.block_size, seed):
            if h not in self._refs:
                break
            n += 1
        return n * self.block_size

    @property
    def reuse_block_size(self) -> int:
        """The granularity at which the engine reuses a cached prefix: whole engine blocks
        (vLLM blocks, SGLang pages), configured, else as seen in its events; 1 while unknown."""
        return self.engine_block_size or self.observed_block_size or 1

    def counters(self) -> dict[str, int]:
        return dict(self._counts)

    def drain_delta(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(added, removed) since the last drain, net of each other, sorted."""
        delta = (tuple(sorted(self._added)), tuple(sorted(self._removed)))
        self._added, self._removed = set(), set()
        return delta

    # ------------------------------------------------------------------------------ updates
    def apply(self, batch: KvBatch) -> None:
        self._counts["batches"] += 1
        for event in batch.events:
            self.apply_event(event)

    def apply_event(self, event: KvEvent) -> None:
        self._counts["events"] += 1
        if isinstance(event, EngineBlockStored):
            self._store(event)
        elif isinstance(event, EngineBlockRemoved):
            self._remove_event(event)
        elif isinstance(event, EngineAllCleared):
            if self._accepts(event.medium, self.group_idx, 1):
                self._counts["clears"] += 1
                self.clear()
        else:
            self._counts["unknown_events"] += 1

    def clear(self) -> None:
        """Forget everything (AllBlocksCleared); the delta removes every indexed hash."""
        for h in self._refs:
            self._note(h, present=False)
        self._reset_state()

    def drop(self) -> None:
        """Forget everything because the event stream broke (counted as a drop)."""
        self._counts["drops"] += 1
        self.clear()

    # ------------------------------------------------------------------------------ stores
    def _store(self, ev: EngineBlockStored) -> None:
        n = len(ev.block_hashes)
        if not self._accepts(ev.medium, ev.group_idx, n) or not self._size_ok(ev.block_size, n):
            return
        if not is_full_attention(ev.spec_kind):
            self._counts["skipped_kind"] += n
            return
        self.observed_block_size = ev.block_size
        # a LoRA run is named by its salt (the node's namespace holds the adapter's digest):
        # a salted root, or a child of one (rooted only if its parent is); else opaque
        lora = ev.lora_id is not None or ev.lora_name is not None
        opaque_all = lora and ev.parent_hash is None and ev.salt is None
        parent = ev.parent_hash
        size = ev.block_size
        for i, key in enumerate(ev.block_hashes):
            opaque = opaque_all or (bool(ev.keyed) and ev.keyed[i])
            salt = ev.salt if i == 0 and ev.parent_hash is None else None
            self._put(key, parent, ev.token_ids[i * size : (i + 1) * size], opaque, salt)
            parent = key

    def _accepts(self, medium: str | None, group_idx: int, n_blocks: int) -> bool:
        if not is_device_medium(medium):
            self._counts["skipped_medium"] += n_blocks
            return False
        if group_idx != self.group_idx:
            self._counts["skipped_group"] += n_blocks
            return False
        return True

    def _size_ok(self, size: int, n_blocks: int) -> bool:
        try:
            if self.engine_block_size is not None and size != self.engine_block_size:
                raise EngineConfigError(
                    f"engine sent blocks of {size} tokens, configured {self.engine_block_size}"
                )
            check_block_sizes(size, self.block_size)
        except EngineConfigError as exc:
            self._counts["rejected_block_size"] += n_blocks
            self.config_error = self.config_error or str(exc)
            return False
        return True

    def _put(
        self, key: EngineHash, parent: EngineHash | None, tokens: Sequence[int], opaque: bool,
        salt: str | None = None,
    ) -> None:
        packed = array(_UINT32, tokens)
        old = self._blocks.get(key)
        if old is not None:
            if (old.parent, old.tokens, old.opaque, old.salt) == (parent, packed, opaque, salt):
                self._counts["duplicate_stores"] += 1
                return
            self._counts["replaced_stores"] += 1
            self._unlink(key)
        if self._tokens + len(packed) > self.max_tokens or len(self._blocks) >= self.max_blocks:
            self._counts["over_capacity"] += 1
            return
        self._counts["opaque_blocks"] += int(opaque)
        self._counts["blocks_stored"] += 1
        self._link(key, _Block(parent, packed, opaque, salt))

    def _link(self, key: EngineHash, block: _Block) -> None:
        self._blocks[key] = block
        self._tokens += len(block.tokens)
        if block.parent is not None:
            self._children.setdefault(block.parent, set()).add(key)
        if self._rootable(block):
            self._root_subtree(key)

    def _rootable(self, block: _Block) -> bool:
        if block.opaque or block.rooted:
            return False
        if block.parent is None:
            return True
        parent = self._blocks.get(block.parent)
        return parent is not None and parent.rooted

    def _root_subtree(self, key: EngineHash) -> None:
        stack = [key]
        while stack:
            k = stack.pop()
            self._root(self._blocks[k])
            for child in self._children.get(k, ()):
                if self._rootable(self._blocks[child]):
                    stack.append(child)

    def _root(self, block: _Block) -> None:
        """Give ``block`` (whose parent is rooted) its radixmesh hashes."""
        parent = None if block.parent is None else self._blocks[block.parent]
        start = 0 if parent is None else parent.depth
        last = (namespace_seed(self.seed, block.salt, self.block_size) if parent is None
                else parent.last)
        lead = start % self.block_size  # tokens of a partial radixmesh block before ours
        head = self._tail_tokens(block.parent, lead) if lead else []
        buf = [*head, *block.tokens]
        hashes = block_hashes(buf, self.block_size, last)
        block.rooted, block.depth = True, start + len(block.tokens)
        block.last = hashes[-1] if hashes else last
        block.hashes = tuple(hashes)
        for h in hashes:
            self._ref(h)

    def _tail_tokens(self, key: EngineHash | None, count: int) -> list[int]:
        """The last ``count`` tokens of the prefix ending at block ``key`` (all rooted)."""
        chunks: list[array[int]] = []
        have = 0
        while have < count and key is not None:
            block = self._blocks[key]
            chunks.append(block.tokens)
            have += len(block.tokens)
            key = block.parent
        out = [t for chunk in reversed(chunks) for t in chunk]
        return out[len(out) - count :]

    # ------------------------------------------------------------------------------ removals
    def _remove_event(self, ev: EngineBlockRemoved) -> None:
        if not self._accepts(ev.medium, ev.group_idx, len(ev.block_hashes)):
            return
        for key in ev.block_hashes:
            if key in self._blocks:
                self._counts["blocks_removed"] += 1
                self._unlink(key)
            else:
                self._counts["unknown_removals"] += 1

    def _unlink(self, key: EngineHash) -> None:
        self._unroot_subtree(key)
        block = self._blocks.pop(key)
        self._tokens -= len(block.tokens)
        if block.parent is not None:
            siblings = self._children[block.parent]
            siblings.discard(key)
            if not siblings:
                del self._children[block.parent]

    def _unroot_subtree(self, key: EngineHash) -> None:
        stack = [key]
        while stack:
            k = stack.pop()
            block = self._blocks[k]
            if not block.rooted:
                continue
            block.rooted = False
            self._unref_all(block.hashes)
            block.hashes = ()
            stack.extend(c for c in self._children.get(k, ()) if self._blocks[c].rooted)

    # ------------------------------------------------------------------------------ hash set
    def _ref(self, h: int) -> None:
        count = self._refs.get(h, 0)
        self._refs[h] = count + 1
        if count == 0:
            self._note(h, present=True)

    def _unref_all(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            count = self._refs[h] - 1
            if count:
                self._refs[h] = count
            else:
                del self._refs[h]
                self._note(h, present=False)

    def _note(self, h: int, *, present: bool) -> None:
        gained, lost = (self._added, self._removed) if present else (self._removed, self._added)
        if h in lost:
            lost.discard(h)
        else:
            gained.add(h)
