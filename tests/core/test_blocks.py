"""Block hashes: chaining, prefix property, fingerprints, extend_hashes, bad input."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from radixmesh.core.blocks import Fingerprint, block_hashes, extend_hashes

tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=80)
bs_st = st.integers(1, 8)
SEED = Fingerprint("m", "t", 4).digest


@settings(max_examples=150, deadline=None)
@given(tokens=tokens_st, cut=st.integers(0, 80), bs=bs_st)
def test_hashes_of_a_prefix_are_a_prefix_of_the_hashes(
    tokens: list[int], cut: int, bs: int
) -> None:
    full = block_hashes(tokens, bs, SEED)
    assert len(full) == len(tokens) // bs
    assert block_hashes(tokens[:cut], bs, SEED) == full[: min(cut, len(tokens)) // bs]


@settings(max_examples=150, deadline=None)
@given(a=tokens_st, cut=st.integers(0, 80), tail=tokens_st, bs=bs_st)
def test_a_block_hash_names_the_whole_prefix(
    a: list[int], cut: int, tail: list[int], bs: int
) -> None:
    # b shares a prefix of a, so both equal and differing blocks occur (independent random
    # lists would almost never share a block, and the equality side would go untested).
    b = a[:cut] + tail
    ha, hb = block_hashes(a, bs, SEED), block_hashes(b, bs, SEED)
    for i, (x, y) in enumerate(zip(ha, hb, strict=False)):
        assert (x == y) == (a[: (i + 1) * bs] == b[: (i + 1) * bs])
    shared = min(cut, len(a)) // bs
    assert ha[:shared] == hb[:shared]


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 255), min_size=16, max_size=80))
def test_different_fingerprints_never_match(tokens: list[int]) -> None:
    prints = [
        Fingerprint("model-a", "bytes", 4),
        Fingerprint("model-b", "bytes", 4),
        Fingerprint("model-a", "bpe", 4),
        Fingerprint("model-a", "bytes", 8),
    ]
    chains = [set(block_hashes(tokens, fp.block_size, fp.digest)) for fp in prints]
    for i in range(len(chains)):
        for j in range(i + 1, len(chains)):
            assert not chains[i] & chains[j]


@settings(max_examples=150, deadline=None)
@given(tokens=tokens_st, known=st.integers(0, 80), bs=bs_st)
def test_extend_hashes_equals_block_hashes(tokens: list[int], known: int, bs: int) -> None:
    full = block_hashes(tokens, bs, SEED)
    prefix = block_hashes(tokens[:known], bs, SEED)
    assert extend_hashes(prefix, tokens, bs, SEED) == full


def test_fingerprint_digest_is_stable_and_distinct() -> None:
    a = Fingerprint("m", "t", 16)
    assert a.digest == Fingerprint("m", "t", 16).digest
    assert a.digest != Fingerprint("m", "t", 8).digest
    assert 0 <= a.digest < 2**64


@pytest.mark.parametrize("bad", [[-1], [2**32], [1, 2, 3, -5], [1.5], ["a"], [None]])
def test_bad_token_ids_raise_value_error(bad: list[object]) -> None:
    with pytest.raises(ValueError):
        block_hashes(bad * 4, 4, SEED)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("model", "tok", "bs"), [("", "t", 16), ("m", "", 16), ("m", "t", 0), ("m", "t", -1)]
)
def test_bad_fingerprint(model: str, tok: str, bs: int) -> None:
    with pytest.raises(ValueError):
        Fingerprint(model, tok, bs)


def test_short_input_has_no_blocks() -> None:
    assert block_hashes([1, 2, 3], 4, SEED) == []
    assert extend_hashes([], [1, 2, 3], 4, SEED) == []
