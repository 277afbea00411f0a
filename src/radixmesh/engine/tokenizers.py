"""Tokenizers: a lossless byte-level default and a Hugging Face ``tokenizer.json`` wrapper.

Theory of operation
-------------------
Every peer of a mesh must cut text into the *same* token ids, or block hashes never match
(a silent 0 % hit rate). Each tokenizer therefore exposes a ``fingerprint``: a digest of
everything that changes the ids (vocabulary, special tokens, chat template). It goes into
:class:`~radixmesh.core.blocks.Fingerprint` and is checked when a peer joins.

``ByteTokenizer`` (the default for presets) needs no files: token ``b`` (0..255) is the byte
``b`` of the UTF-8 text, followed by a few special tokens (EOS, ChatML-style role markers).
Plain text never produces special ids (a prompt containing the string ``<|im_end|>`` is
encoded as its bytes), so users cannot inject control tokens. Its chat template is::

    <|im_start|> <|user|> "text bytes" <|im_end|> ... <|im_start|> <|assistant|>

``HFTokenizer`` wraps a model directory's ``tokenizer.json`` through the ``tokenizers``
library. Its chat template is the ``chat_template`` of ``tokenizer_config.json`` rendered
with a sandboxed Jinja environment (the variables transformers passes: ``messages``,
``add_generation_prompt``, ``bos_token``, ``eos_token``, ``raise_exception``); a directory
without a template falls back to ChatML text (``<|im_start|>role\\ncontent<|im_end|>\\n``).

``StreamDecoder`` turns generated ids into text incrementally without emitting half of a
multi-byte UTF-8 character (byte tokens split characters).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from radixmesh.core.byte_tokenizer import CHAT_ROLES, ByteTokenizer, check_messages, digest_parts
from radixmesh.engine.base import Tokenizer

__all__ = ["CHAT_ROLES", "ByteTokenizer", "HFTokenizer", "StreamDecoder"]

CHATML_FALLBACK = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _token_text(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _pick_template(raw: object) -> str | None:
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):  # [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, Mapping)}
        chosen = named.get("default") or next(iter(named.values()), None)
        return chosen if isinstance(chosen, str) else None
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template: {message}")


class HFTokenizer:
    """A model directory's ``tokenizer.json`` (+ ``tokenizer_config.json``), offline."""

    def __init__(self, model_dir: str | Path) -> None:
        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {root}")
        raw = path.read_bytes()
        self._tok = _HFTokenizer.from_str(raw.decode("utf-8"))
        config = _read_json(root / "tokenizer_config.json")
        self._template_text = _pick_template(config.get("chat_template"))
        template_file = root / "chat_template.jinja"
        if self._template_text is None and template_file.is_file():
            self._template_text = template_file.read_text(encoding="utf-8")
        self._bos = _token_text(config.get("bos_token"))
        self._eos_text = _token_text(config.get("eos_token"))
        self._eos = self._resolve_eos(root)
        self._stop_ids = self._resolve_stop_ids(root)
        self._fingerprint = "hf:" + digest_parts(
            raw, self._template_text or "<chatml-fallback>", str(self._eos)
        )
        self._template = self._compile(self._template_text or CHATML_FALLBACK)

    def _resolve_eos(self, root: Path) -> int | None:
        if self._eos_text is not None:
            found = self._tok.token_to_id(self._eos_text)
            if found is not None:
                return int(found)
        for name in ("generation_config.json", "config.json"):
            value = _read_json(root / name).get("eos_token_id")
            if isinstance(value, list) and value:
                value = value[0]
            if isinstance(value, int):
                return value
        return None

    def _resolve_stop_ids(self, root: Path) -> frozenset[int]:
        ids = {self._eos} if self._eos is not None else set()
        for name in ("generation_config.json", "config.json"):
            value = _read_json(root / name).get("eos_token_id")
            values = value if isinstance(value, list) else [value]
            ids.update(v for v in values if isinstance(v, int))
        return frozenset(ids)

    @staticmethod
    def _compile(text: str) -> Any:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        return env.from_string(text)

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    @property
    def stop_ids(self) -> frozenset[int]:
        """EOS plus every ``eos_token_id`` of generation_config.json / config.json."""
        return self._stop_ids

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def has_chat_template(self) -> bool:
        return self._template_text is not None

    def encode(self, text: str) -> list[int]:
        return self._ids(text, add_special_tokens=True)

    def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
        """``text``'s ids; text no UTF-8 can hold (a lone surrogate, as JSON's ``"\\ud800"``
        decodes to) is a ValueError, as the byte tokenizer's, not the library's TypeError."""
        try:
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        except TypeError:
            text.encode("utf-8")  # raises UnicodeEncodeError (a ValueError) for such text
            raise

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> str:
        check_messages(messages)
        try:
            return str(
                self._template.render(
                    messages=[dict(m) for m in messages],
                    add_generation_prompt=True,
                    bos_token=self._bos or "",
                    eos_token=self._eos_text or "",
                )
            )
        except ValueError:
            raise
        except Exception as exc:  # a template error is the request's problem, not a crash
            raise ValueError(f"chat template failed: {exc}") from exc

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return self._ids(self.render_chat(messages), add_special_tokens=False)


class StreamDecoder:
    """Incremental detokenization: ``push(id)`` returns only text that is final."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._emitted = 0

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for more
            return ""
        new = text[self._emitted :]
        self._emitted = len(text)
        return new

    def flush(self) -> str:
        text = self._tok.decode(self._ids)
        new = text[self._emitted :]
        self._emitted = len(text)
        return new
