from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from radixmesh.engine.tokenizers import ByteTokenizer, HFTokenizer, StreamDecoder

TEXTS = ["", "hello world", "Ünïcödé ✓ 日本語 🚀", "a\nb\tc  d", "Answer: B\n\nQuestion:"]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trips(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_tokenizer_never_parses_special_strings() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("<|im_end|><|endoftext|>")
    assert all(i < 256 for i in ids)
    assert tok.eos_token_id not in ids


def test_byte_chat_template_is_deterministic_and_marks_roles() -> None:
    tok = ByteTokenizer()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = tok.apply_chat_template(msgs)
    assert ids == tok.apply_chat_template(msgs)
    start, end = tok.special_id("<|im_start|>"), tok.special_id("<|im_end|>")
    assert ids[:2] == [start, tok.special_id("<|system|>")]
    assert ids[-2:] == [start, tok.special_id("<|assistant|>")]
    assert ids.count(end) == 2
    assert tok.render(ids).endswith("<|im_start|><|assistant|>")
    assert tok.decode(ids) == "be briefhi"  # decode skips special tokens
    assert tok.stop_ids == {tok.eos_token_id, end}


@pytest.mark.parametrize("messages", [[], [{"role": "wizard", "content": "x"}], [{"role": "user"}]])
def test_bad_chat_messages_raise_value_error(messages: list[dict[str, str]]) -> None:
    with pytest.raises(ValueError):
        ByteTokenizer().apply_chat_template(messages)


def test_byte_fingerprint_is_stable() -> None:
    assert ByteTokenizer().fingerprint == ByteTokenizer().fingerprint
    assert ByteTokenizer().fingerprint.startswith("bytes-v1:")


@pytest.mark.parametrize("text", TEXTS)
def test_hf_tokenizer_round_trips(micro_model_dir: Path, text: str) -> None:
    tok = HFTokenizer(micro_model_dir)
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_text_no_utf8_holds_is_a_value_error_in_both_tokenizers(micro_model_dir: Path) -> None:
    """A lone surrogate (JSON's "\\ud800" decodes to one): a ValueError, as the byte
    tokenizer's, which the servers answer with a 400 (the library raised a TypeError: 500)."""
    hf = HFTokenizer(micro_model_dir)
    for tok in (hf, ByteTokenizer()):
        with pytest.raises(ValueError):
            tok.encode("a\ud800b")
    with pytest.raises(ValueError):
        hf.apply_chat_template([{"role": "user", "content": "\ud800"}])


def test_hf_tokenizer_compresses_trained_text(micro_model_dir: Path) -> None:
    tok = HFTokenizer(micro_model_dir)
    text = "The following are multiple choice questions (with answers) about physics."
    assert len(tok.encode(text)) < len(text.encode("utf-8")) / 2


def test_hf_chat_template_from_config(micro_model_dir: Path) -> None:
    tok = HFTokenizer(micro_model_dir)
    assert tok.has_chat_template
    assert tok.eos_token_id == 0  # "<|endoftext|>" is the first special token
    assert tok.stop_ids == {0}
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.render_chat(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(msgs)
    assert ids[0] == 1  # <|im_start|> is one special token, not its characters
    assert ids.count(2) == 1  # <|im_end|>


def _copy_with_config(src: Path, dst: Path, config: dict[str, object]) -> Path:
    dst.mkdir()
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_hf_template_fallback_and_fingerprints(micro_model_dir: Path, tmp_path: Path) -> None:
    bare = _copy_with_config(micro_model_dir, tmp_path / "bare", {"eos_token": "<|im_end|>"})
    tok = HFTokenizer(bare)
    assert not tok.has_chat_template
    assert tok.eos_token_id == 2
    assert tok.stop_ids == {2}  # no generation_config.json in this copy
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.fingerprint != HFTokenizer(micro_model_dir).fingerprint
    assert HFTokenizer(micro_model_dir).fingerprint == HFTokenizer(micro_model_dir).fingerprint


def test_hf_named_template_list_and_raise_exception(micro_model_dir: Path, tmp_path: Path) -> None:
    templates = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{{ raise_exception('no chat here') }}"},
    ]
    tok = HFTokenizer(
        _copy_with_config(micro_model_dir, tmp_path / "t", {"chat_template": templates})
    )
    with pytest.raises(ValueError, match="no chat here"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_hf_tokenizer_needs_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        HFTokenizer(tmp_path)


def test_stream_decoder_holds_back_partial_characters() -> None:
    tok = ByteTokenizer()
    text = "aé✓🚀b"
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in tok.encode(text)]
    assert "".join(pieces) + dec.flush() == text
    assert all("\ufffd" not in p for p in pieces)
