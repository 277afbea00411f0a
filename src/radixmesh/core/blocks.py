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
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

DEFAULT_BLOCK_SIZE = 16
_MAX_TOKEN_ID = 2**32 - 1
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
