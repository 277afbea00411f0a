"""Tokenization for the simulator: the built-in engine's own tokenizer, so token counts (and
therefore block hashes, cache sizes and hit rates) match a real cluster fed the same prompts.

Completion prompts go through ``encode``, chat requests through ``apply_chat_template`` —
what the node does with ``/v1/completions`` and ``/v1/chat/completions``.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable

from radixmesh.core.byte_tokenizer import ByteTokenizer
from radixmesh.workload.request import Request

Tokenize = Callable[[Request], list[int]]


def byte_tokenize() -> tuple[Tokenize, str]:
    """The preset engines' byte tokenizer and its fingerprint."""
    tok = ByteTokenizer()

    def tokenize(req: Request) -> list[int]:
        if req.prompt is not None:
            return tok.encode(req.prompt)
        assert req.messages is not None
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        return tok.apply_chat_template(messages)

    return tokenize, tok.fingerprint


_WORD = re.compile(r"\s?\w+|\s?[^\w\s]|\s+")
WORD_VOCAB = 50_000


def word_tokenize() -> tuple[Tokenize, str]:
    """BPE-like token *counts* without a vocabulary: one token per word (with its leading
    space), punctuation mark or run of whitespace, id = CRC32 of the piece mod 50,000.

    A request's known shared prefix (``prefix_chars``) is cut on its own, so pieces never span
    it and it is tokenized once per group. On MMLU-shaped text this gives ~5.5 characters per
    token — the paper's ~540 tokens per prompt, where the byte tokenizer gives ~3,000. Scale
    experiments use it: what a real deployment with a real tokenizer gossips and caches, at a
    fifth of the simulation cost.
    """

    prefixes: dict[str, list[int]] = {}

    def encode(text: str) -> list[int]:
        return [zlib.crc32(m.encode("utf-8")) % WORD_VOCAB for m in _WORD.findall(text)]

    def tokenize(req: Request) -> list[int]:
        if req.prompt is not None:
            cut = req.prefix_chars or 0
            if not 0 < cut <= len(req.prompt):
                return encode(req.prompt)
            # The shared prefix is tokenized once per group (pieces never span the cut).
            head = req.prompt[:cut]
            cached = prefixes.get(head)
            if cached is None:
                if len(prefixes) > 4096:
                    prefixes.clear()
                cached = prefixes[head] = encode(head)
            return cached + encode(req.prompt[cut:])
        assert req.messages is not None
        ids: list[int] = []
        for m in req.messages:
            ids += encode(f"<|{m.role}|>") + encode(m.content)
        return ids + encode("<|assistant|>")

    return tokenize, f"words-crc32-{WORD_VOCAB}"


TOKENIZERS = {"bytes": byte_tokenize, "words": word_tokenize}
