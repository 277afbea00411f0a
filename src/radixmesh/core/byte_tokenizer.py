"""The byte-level tokenizer: UTF-8 bytes (ids 0..255) plus a few special tokens.

Pure and dependency-free, so the simulator counts exactly the tokens the built-in engine
runs (and hashes the same blocks) without importing the engine. Plain text never produces
special ids (a prompt containing the string ``<|im_end|>`` is encoded as its bytes), so users
cannot inject control tokens. Its chat template is::

    <|im_start|> <|user|> "text bytes" <|im_end|> ... <|im_start|> <|assistant|>
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

CHAT_ROLES = ("system", "user", "assistant", "tool")
_BYTE_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    *(f"<|{role}|>" for role in CHAT_ROLES),
)


def digest_parts(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8") if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:16]


def check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if not messages:
        raise ValueError("messages must not be empty")
    for m in messages:
        if not isinstance(m, Mapping) or not isinstance(m.get("content"), str):
            raise ValueError("each message needs a string 'content'")
        if m.get("role") not in CHAT_ROLES:
            raise ValueError(f"unknown role {m.get('role')!r}; expected one of {CHAT_ROLES}")


class ByteTokenizer:
    """UTF-8 bytes (ids 0..255) + special tokens (ids 256..). Lossless, deterministic."""

    def __init__(self) -> None:
        self._specials = {name: 256 + i for i, name in enumerate(_BYTE_SPECIALS)}
        self._names = {i: name for name, i in self._specials.items()}

    @property
    def fingerprint(self) -> str:
        return "bytes-v1:" + digest_parts(*_BYTE_SPECIALS, "chat:im_start+role-token+im_end")

    @property
    def eos_token_id(self) -> int:
        return self._specials["<|endoftext|>"]

    @property
    def vocab_size(self) -> int:
        return 256 + len(self._specials)

    @property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end generation: EOS and the end-of-turn marker."""
        return frozenset({self.eos_token_id, self._specials["<|im_end|>"]})

    def special_id(self, name: str) -> int:
        return self._specials[name]

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of the byte tokens; special and unknown ids are skipped (like HF's
        ``skip_special_tokens=True``)."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def render(self, ids: Sequence[int]) -> str:
        """Debug view: special tokens shown by name."""
        parts = [bytes([i]) if 0 <= i < 256 else self._names.get(i, "").encode() for i in ids]
        return b"".join(parts).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        check_messages(messages)
        start, end = self._specials["<|im_start|>"], self._specials["<|im_end|>"]
        ids: list[int] = []
        for m in messages:
            ids += [start, self._specials[f"<|{m['role']}|>"]]
            ids += self.encode(m["content"])
            ids.append(end)
        ids += [start, self._specials["<|assistant|>"]]
        return ids
