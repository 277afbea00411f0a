"""An exact radix tree of token ids, SGLang-style, with LRU eviction and block-hash tracking.

Theory of operation
-------------------
Each edge holds a *segment* of token ids; a node is identified by the path from the root, i.e.
by a token prefix. Children are keyed by the first token of their segment::

    root ─[The,cat]─▶ A ─[sat]──────▶ B        "The cat sat"
                        └─[ran,off]──▶ C        "The cat ran off"

Every node may carry a *value* for its own segment (the engine hangs the KV tensors of exactly
those token positions there; the simulator hangs nothing). Values are split with the segment
when an insert or a serving match ends inside it, so a value always covers exactly its node's
segment at its original absolute positions.

Invariants
    * a node's segment is non-empty (except the root's);
    * ``lock_ref(n) > 0`` for every node on the path of a running request; such nodes are never
      evicted, and a node's lock_ref is >= the sum over locked descendants' paths;
    * ``total_tokens`` is the sum of segment lengths; ``locked_tokens`` of locked ones;
    * only leaves are evicted, least recently used first; a parent that becomes a leaf becomes
      evictable in its turn.

Block hashes: with ``block_size`` B, block ``b`` of a prefix covers positions ``[bB, (b+1)B)``.
A node stores the hashes of the blocks that *end* inside its segment, so a block is present iff
its ending node is: evicting that node removes exactly those blocks. Additions and removals are
journaled and drained by the gossip layer (``drain_delta``).

``match`` is read-only (routing); ``match_prefix`` touches LRU and splits (serving).
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from radixmesh.core.blocks import block_hashes

V = TypeVar("V")
SplitValue = Callable[[V, int], tuple[V, V]]
MakeValue = Callable[[int, int], V]


class TreeNode(Generic[V]):
    """One node; ``start`` is the absolute position of the first token of ``key``."""

    __slots__ = ("children", "hashes", "key", "last_access", "lock_ref", "parent", "start",
                 "touched", "value")

    def __init__(
        self, key: tuple[int, ...], start: int, parent: TreeNode[V] | None, value: V | None
    ) -> None:
        self.key = key
        self.start = start
        self.parent = parent
        self.value = value
        self.children: dict[int, TreeNode[V]] = {}
        self.lock_ref = 0
        self.last_access = 0.0
        self.touched = 0  # order of the last touch (ties of last_access: evict_blocks)
        self.hashes: list[int] = []

    @property
    def end(self) -> int:
        return self.start + len(self.key)

    def is_leaf(self) -> bool:
        return not self.children


@dataclass(slots=True)
class MatchResult(Generic[V]):
    """A serving match: ``length`` tokens cached, ``node`` ends exactly at ``length``."""

    length: int
    node: TreeNode[V]
    values: list[V] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Evicted(Generic[V]):
    start: int  # absolute position of the first evicted token
    tokens: int
    value: V | None
    hashes: tuple[int, ...]


def _common_prefix(a: Sequence[int], a_off: int, b: tuple[int, ...]) -> int:
    n = min(len(a) - a_off, len(b))
    if tuple(a[a_off : a_off + n]) == b[:n]:
        return n
    i = 0
    while i < n and a[a_off + i] == b[i]:
        i += 1
    return i


class RadixTree(Generic[V]):
    def __init__(
        self, block_size: int, seed: int, split_value: SplitValue[V] | None = None
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.seed = seed
        self._split_value = split_value
        self.root: TreeNode[V] = TreeNode((), 0, None, None)
        self.root.lock_ref = 1  # the root is never evicted
        self.total_tokens = 0
        self.locked_tokens = 0
        self.locked_blocks = 0  # whole blocks ending in locked nodes (len of their hashes)
        self._hash_set: set[int] = set()
        self._added: list[int] = []
        self._removed: list[int] = []
        self._tick = itertools.count()
        self._touches = itertools.count(1)

    # ----------------------------------------------------------------------------- queries
    @property
    def evictable_tokens(self) -> int:
        return self.total_tokens - self.locked_tokens

    def match(self, tokens: Sequence[int]) -> int:
        """Length of the cached prefix of ``tokens``. Read-only: no split, no LRU touch."""
        return self._walk(tokens)[1]

    def match_node(self, tokens: Sequence[int]) -> TreeNode[V]:
        """The deepest node the cached prefix of ``tokens`` reaches into (wholly or partly).
        Read-only like ``match``: no split, no LRU touch."""
        return self._walk(tokens)[0]

    def _walk(self, tokens: Sequence[int]) -> tuple[TreeNode[V], int]:
        """(the deepest node the cached prefix of ``tokens`` reaches into, wholly or partly;
        that prefix's length), read-only."""
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common_prefix(tokens, pos, child.key)
            pos += n
            node = child
            if n < len(child.key):
                break
        return node, pos

    def block_hashes(self) -> frozenset[int]:
        return frozenset(self._hash_set)

    @property
    def cached_blocks(self) -> int:
        """Whole blocks cached: one per distinct block hash (two prompts sharing a block's
        first tokens only hold two blocks, as a paged KV cache does)."""
        return len(self._hash_set)

    def drain_delta(self) -> tuple[list[int], list[int]]:
        """Block hashes added and removed since the previous call: exactly the set difference
        of the hashes cached then and now, each listed once."""
        added, removed = self._added, self._removed
        self._added, self._removed = [], []
        both = set(added) & set(removed)
        if both:  # a hash is added only while absent, removed only while present: the net
            net = Counter(h for h in added if h in both)  # change is #added - #removed
            net.subtract(h for h in removed if h in both)
            added = [h for h in dict.fromkeys(added) if h not in both or net[h] > 0]
            removed = [h for h in dict.fromkeys(removed) if h not in both or net[h] < 0]
        return added, removed

    # ----------------------------------------------------------------------------- serving
    def match_prefix(self, tokens: Sequence[int], now: float) -> MatchResult[V]:
        """Match for serving: splits so the result ends on a node boundary, touches LRU."""
        node, pos = self.root, 0
        values: list[V] = []
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common_prefix(tokens, pos, child.key)
            node = self._split(child, n) if n < len(child.key) else child
            pos += n
            if node.value is not None:
                values.append(node.value)
        self._touch(node, now)
        return MatchResult(pos, node, values)

    def insert(
        self,
        tokens: Sequence[int],
        now: float,
        make_value: MakeValue[V] | None = None,
        hashes: Sequence[int] | None = None,
    ) -> int:
        """Insert ``tokens``; returns how many were already cached.

        New nodes covering positions ``[s, e)`` get ``make_value(s, e)``. ``hashes``, if given,
        must be ``block_hashes(tokens, block_size, seed)`` (or a longer prefix chain of it).
        """
        matched = self.match_prefix(tokens, now)
        pos = matched.length
        if pos >= len(tokens):
            return pos
        if hashes is None:
            hashes = block_hashes(tokens, self.block_size, self.seed)
        parent = matched.node
        key = tuple(tokens[pos:])
        value = make_value(pos, len(tokens)) if make_value is not None else None
        leaf: TreeNode[V] = TreeNode(key, pos, parent, value)
        leaf.last_access = now
        parent.children[key[0]] = leaf
        self.total_tokens += len(key)
        self._assign_hashes(leaf, hashes)
        self._touch(leaf, now)
        return pos

    def lock(self, node: TreeNode[V]) -> None:
        """Pin ``node`` and its ancestors (a running request uses their KV)."""
        cur: TreeNode[V] | None = node
        while cur is not None and cur is not self.root:
            if cur.lock_ref == 0:
                self.locked_tokens += len(cur.key)
                self.locked_blocks += len(cur.hashes)
            cur.lock_ref += 1
            cur = cur.parent

    def unlock(self, node: TreeNode[V]) -> None:
        cur: TreeNode[V] | None = node
        while cur is not None and cur is not self.root:
            if cur.lock_ref <= 0:
                raise RuntimeError("unlock of a node that is not locked")
            cur.lock_ref -= 1
            if cur.lock_ref == 0:
                self.locked_tokens -= len(cur.key)
                self.locked_blocks -= len(cur.hashes)
            cur = cur.parent

    def evict(self, n_tokens: int) -> list[Evicted[V]]:
        """Evict least-recently-used unlocked leaves until ``n_tokens`` are freed (or none left)."""
        heap = [(leaf.last_access, next(self._tick), leaf) for leaf in self._evictable_leaves()]
        heapq.heapify(heap)
        out: list[Evicted[V]] = []
        freed = 0
        while freed < n_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            out.append(self._remove_leaf(leaf))
            freed += len(leaf.key)
            parent = leaf.parent
            if parent is not None and parent is not self.root and self._evictable(parent):
                heapq.heappush(heap, (parent.last_access, next(self._tick), parent))
        return out

    def evict_blocks(self, n_blocks: int) -> list[Evicted[V]]:
        """Evict whole blocks until ``n_blocks`` are freed (or none left): the least recently
        used unlocked leaf (ties by the order of touches) loses its tail blocks, as many as
        still needed, and keeps its place. This is vLLM's free queue, where a finished
        request's blocks are queued tail first after those freed before it
        (vllm/v1/core/single_type_kv_cache_manager.py ``free``) and taken one at a time
        (vllm/v1/core/block_pool.py ``get_new_blocks``). For trees of whole blocks (an insert's
        end on a block boundary, as ``core/kv_pool.py`` inserts)."""
        heap = [(leaf.last_access, leaf.touched, next(self._tick), leaf)
                for leaf in self._evictable_leaves()]
        heapq.heapify(heap)
        out: list[Evicted[V]] = []
        freed = 0
        while freed < n_blocks and heap:
            *_, leaf = heapq.heappop(heap)
            cut = leaf.end // self.block_size * self.block_size
            cut -= (n_blocks - freed) * self.block_size
            if cut > leaf.start and len(leaf.hashes) > n_blocks - freed:
                upper = self._split(leaf, cut - leaf.start)
                heapq.heappush(heap, (upper.last_access, upper.touched, next(self._tick), upper))
            out.append(self._remove_leaf(leaf))
            freed += len(out[-1].hashes)
            parent = leaf.parent
            if parent is not None and parent is not self.root and self._evictable(parent):
                heapq.heappush(heap, (parent.last_access, parent.touched, next(self._tick),
                                      parent))
        return out

    # ----------------------------------------------------------------------------- helpers
    def _evictable(self, node: TreeNode[V]) -> bool:
        return node.is_leaf() and node.lock_ref == 0

    def _evictable_leaves(self) -> list[TreeNode[V]]:
        out: list[TreeNode[V]] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root and self._evictable(node):
                out.append(node)
            stack.extend(node.children.values())
        return out

    def _remove_leaf(self, leaf: TreeNode[V]) -> Evicted[V]:
        parent = leaf.parent
        assert parent is not None
        del parent.children[leaf.key[0]]
        self.total_tokens -= len(leaf.key)
        for h in leaf.hashes:
            self._hash_set.discard(h)
        self._removed.extend(leaf.hashes)
        return Evicted(leaf.start, len(leaf.key), leaf.value, tuple(leaf.hashes))

    def _touch(self, node: TreeNode[V], now: float) -> None:
        cur: TreeNode[V] | None = node
        while cur is not None:
            cur.last_access = now
            cur.touched = next(self._touches)
            cur = cur.parent

    def _assign_hashes(self, node: TreeNode[V], hashes: Sequence[int]) -> None:
        # Blocks ending in (start, end]: b from start // bs up to (excluding) end // bs.
        bs = self.block_size
        own = list(hashes[node.start // bs : min(node.end // bs, len(hashes))])
        node.hashes = own
        self._hash_set.update(own)
        self._added.extend(own)

    def _split(self, node: TreeNode[V], at: int) -> TreeNode[V]:
        """Split ``node`` after ``at`` tokens; returns the new upper node."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node.key)
        upper_value: V | None = None
        lower_value: V | None = None
        if node.value is not None:
            if self._split_value is None:
                raise RuntimeError("tree holds values but has no split_value")
            upper_value, lower_value = self._split_value(node.value, at)
        upper: TreeNode[V] = TreeNode(node.key[:at], node.start, parent, upper_value)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.touched = node.touched
        boundary = node.start + at
        n_upper = boundary // self.block_size - node.start // self.block_size
        upper.hashes, node.hashes = node.hashes[:n_upper], node.hashes[n_upper:]
        parent.children[upper.key[0]] = upper
        node.key = node.key[at:]
        node.start = boundary
        node.value = lower_value
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper
