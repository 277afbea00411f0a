"""A GGUF file from a random-weight Qwen2 model directory, for llama.cpp (``make llamacpp-check``).

Theory of operation
-------------------
Runs in the llama.cpp virtual environment (``gguf`` and ``numpy``; nothing of radixmesh's own
is imported, so it also runs as a plain script). The weights are read straight from
``model.safetensors`` (an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw data: the safetensors format) and written
as F32 under llama.cpp's names for the ``qwen2`` architecture (``token_embd``,
``blk.N.attn_{norm,q,k,v,output}``, ``blk.N.ffn_{norm,gate,up,down}``, ``output_norm``; no
``output``: tied embeddings). Qwen2 uses NeoX RoPE in llama.cpp, so Q and K are written as
they are (llama.cpp's converter permutes them only for the ``llama`` architecture). The
tokenizer is the directory's byte-level BPE: ``tokenizer.ggml.model`` ``gpt2``, pre-tokenizer
``qwen2`` (one llama.cpp knows: its converter refuses a BPE whose pre-tokenizer it does not
recognise), the vocabulary by id, added tokens as control tokens, the merges, EOS id from
``config.json``, no BOS. radixmesh sends llama.cpp token ids, so its tokenizer's splitting of
text never matters for the prompt.

    <llamacpp-python> src/radixmesh/bench/gguf_model.py MODEL_DIR OUT.gguf
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf: str) -> str:
    """llama.cpp's name of a Hugging Face Qwen2 tensor."""
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")
    if parts[:2] == ["model", "layers"] and ".".join(parts[3:]) in _NAMES:
        return f"blk.{parts[2]}.{_NAMES['.'.join(parts[3:])]}"
    raise ValueError(f"tensor {hf!r} has no qwen2 GGUF name")


def read_safetensors(path: Path) -> dict[str, Any]:
    import numpy as np

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] != "F32":
            raise ValueError(f"{name}: dtype {meta['dtype']}, only F32 is written")
        start, end = meta["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + start:8 + n + end], dtype=np.float32
                                  ).reshape(meta["shape"])
    return out


def write(model_dir: Path, out: Path) -> None:
    import gguf

    cfg = json.loads((model_dir / "config.json").read_text())
    w = gguf.GGUFWriter(str(out), "qwen2")
    w.add_name("radixmesh random tiny qwen2")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    rope = (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta", 1e4)
    w.add_rope_freq_base(float(rope))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _tokenizer(w, model_dir, cfg)
    for name, arr in read_safetensors(model_dir / "model.safetensors").items():
        w.add_tensor(gguf_name(name), arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tokenizer(w: Any, model_dir: Path, cfg: dict[str, Any]) -> None:
    import gguf

    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    control = {a["content"]: a["id"] for a in tok.get("added_tokens", [])}
    vocab.update(control)
    size = max(cfg["vocab_size"], max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = gguf.TokenType.CONTROL if text in control else gguf.TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(int(cfg.get("eos_token_id") or 0))
    w.add_add_bos_token(False)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.rsplit("\n\n", 1)[-1].strip())
    write(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"wrote {sys.argv[2]}")
