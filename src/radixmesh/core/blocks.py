"""Token blocks and their chained 64-bit hashes.

Theory of operation
-------------------
Peers never exchange token ids or KV tensors; they exchange *block hashes*. A prompt's token
ids are cut into fixed blocks of ``block_size`` tokens (the last partial block is dropped: it
can never be shared at block granularity). Block ``i``'s hash covers its own tokens and is
seeded with block ``i-1``'s hash, so a hash names a whole prefix, not a block in isolation::

    seed ──▶ h0 = H(t[0:16], seed) ──▶ h1 = H(t[16:32], h0) ──▶ h2 = H(t[32:48], h1) ...

The chain's seed is a :class:`Fingerprint` digest of model + tokenizer + block size, so nodes
serving different models (or cutting blocks differently) can never match each other's blocks;
they are refused at join instead of silently matching 0%.

Hash: XXH3-64 over the little-endian uint32 encoding of the block's token ids.

Cache namespaces (tenants): a request may name a namespace (a tenant, a ``cache_salt``); its
chain then starts from :func:`namespace_seed` instead of the fingerprint's digest, so two
namespaces never name a prefix alike and no tenant can match, or learn of, another's blocks.
The seed is the hash of a *virtual first block* (:func:`namespace_block`: ``block_size`` ids
at or above ``NAMESPACE_TOKEN_BASE`` = 2**31, which no tokenizer produces) chained on the
fingerprint seed. So an engine with a token-keyed prefix tree isolates a namespace by putting
that block in front of the prompt: the tree keeps the namespaces apart (their first blocks
differ), and the hashes of the real blocks that follow are exactly
``block_hashes(prompt, block_size, namespace_seed(...))``, the mesh's names for them. No
namespace (``None``) is today's seed: such requests share the cache as before.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

DEFAULT_BLOCK_SIZE = 16
_MAX_TOKEN_ID = 2**32 - 1
NAMESPACE_TOKEN_BASE = 2**31  # virtual-block ids start here; real token ids stay below
_UINT32 = next(code for code in ("I", "L") if array(code).itemsize == 4)


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """Identity of what a node computes: two nodes can share cache state only if equal."""

    model: str  # model identity, e.g. "preset:tiny:seed0" or a digest of a model directory
    tokenizer: str  # tokenizer identity, e.g. "bytes" or a digest of tokenizer.json
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if not self.model or not self.tokenizer:
            raise ValueError("model and tokenizer identities must be non-empty")

    @property
    def digest(self) -> int:
        """64-bit digest, used as the seed of every hash chain."""
        text = f"radixmesh/v1|{self.model}|{self.tokenizer}|{self.block_size}"
        return int(xxhash.xxh3_64_intdigest(text.encode("utf-8")))


def _token_bytes(tokens: Sequence[int]) -> bytes:
    try:
        packed = array(_UINT32, tokens)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, {_MAX_TOKEN_ID}]") from exc
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def block_hashes(tokens: Sequence[int], block_size: int, seed: int) -> list[int]:
    """Chained hashes of the full blocks of ``tokens`` (a trailing partial block is ignored)."""
    n_blocks = len(tokens) // block_size
    if n_blocks == 0:
        return []
    raw = memoryview(_token_bytes(tokens[: n_blocks * block_size]))
    step = 4 * block_size
    digest = xxhash.xxh3_64_intdigest
    out: list[int] = []
    parent = seed
    for start in range(0, n_blocks * step, step):
        parent = digest(raw[start : start + step], parent)
        out.append(parent)
    return out


def extend_hashes(
    prefix_hashes: Sequence[int], tokens: Sequence[int], block_size: int, seed: int
) -> list[int]:
    """Hashes of ``tokens`` reusing the already known hashes of its first blocks."""
    known = len(prefix_hashes)
    n_blocks = len(tokens) // block_size
    if known >= n_blocks:
        return list(prefix_hashes[:n_blocks])
    parent = prefix_hashes[-1] if known else seed
    tail = block_hashes(tokens[known * block_size : n_blocks * block_size], block_size, parent)
    return [*prefix_hashes, *tail]


def namespace_block(namespace: str, block_size: int) -> tuple[int, ...]:
    """The virtual first block standing for ``namespace``: ``block_size`` ids in
    [2**31, 2**32) drawn from SHAKE-256 of the namespace (no real prompt can start with it)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    raw = hashlib.shake_256(b"radixmesh/namespace/v1|" + namespace.encode("utf-8"))
    data = raw.digest(4 * block_size)
    words = (int.from_bytes(data[i : i + 4], "little") for i in range(0, len(data), 4))
    return tuple(NAMESPACE_TOKEN_BASE | w for w in words)


def namespace_seed(base_seed: int, namespace: str | None, block_size: int) -> int:
    """The hash-chain seed of ``namespace`` (``None``: ``base_seed``, today's shared chain)."""
    if namespace is None:
        return base_seed
    return block_hashes(namespace_block(namespace, block_size), block_size, base_seed)[0]


class NamespaceHeads:
    """The virtual blocks an engine puts in front of namespaced prompts, and their hashes (which
    name a namespace, not a prefix: an engine leaves them out of what it reports). Bounded: the
    ``keep`` most recently used namespaces are remembered (a block is recomputed at need)."""

    def __init__(self, block_size: int, seed: int, keep: int = 65_536) -> None:
        self.block_size, self.seed, self.keep = block_size, seed, keep
        self._heads: OrderedDict[str, tuple[tuple[int, ...], int]] = OrderedDict()
        self._virtual: set[int] = set()

    def head(self, namespace: str | None) -> tuple[int, ...]:
        """The block in front of ``namespace``'s prompts (none without a namespace)."""
        if namespace is None:
            return ()
        known = self._heads.get(namespace)
        if known is None:
            block = namespace_block(namespace, self.block_size)
            known = self._heads[namespace] = block, block_hashes(block, len(block), self.seed)[0]
            self._virtual.add(known[1])
            if len(self._heads) > self.keep:
                self._virtual.discard(self._heads.popitem(last=False)[1][1])
        self._heads.move_to_end(namespace)
        return known[0]

    def real(self, hashes: Sequence[int]) -> list[int]:
        """``hashes`` without the virtual blocks' ones."""
        virtual = self._virtual
        return [h for h in hashes if h not in virtual] if virtual else list(hashes)
