"""Model presets: Qwen2-architecture configs built with seeded, deterministic random weights.

``mini`` (the default: ``radixmesh serve`` / ``demo`` / ``cluster`` without a model): the
``tiny`` architecture with the shipped 8,192-id BPE tokenizer (``engine/bpe.py``) and 32,768
positions, so agent and RAG prompts of 10-30k characters fit (~3 characters per token on English
text against 1 for bytes) — 6.0M parameters, 4 KiB of fp32 KV per token, small enough for two
CPU cores.

``tiny`` (tests): hidden 256, 4 layers, 4 heads, 2 KV heads,
MLP 1024, vocab 32,768, 4,096 positions — 12.2M parameters, 4 KiB of fp32 KV per token. The
vocabulary is sized like a real small model's (so the LM head costs what it would), not like
the byte tokenizer's 263 ids; the engine masks logits above the tokenizer's vocabulary, so a
byte-tokenized preset never samples an id the tokenizer cannot decode.

``qwen2.5-0.5b``: the Qwen2.5-0.5B architecture (hidden 896, 24 layers, 14 heads, 2 KV heads,
vocab 151,936) with random weights — for benchmarks only (fp32 prefill of 3k tokens takes
seconds on a CPU; ~2 GB of weights).

``micro``: an even smaller config (hidden 64, 2 layers) for fast unit tests.

Weights are created on the CPU under a forked, seeded torch RNG, so the same (preset, seed)
gives bit-identical weights on every machine, and the global RNG is left untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tokenizer: str = "byte"  # "byte" (core/byte_tokenizer.py) | "bpe8k" (engine/bpe.py)

    def config(self) -> Qwen2Config:
        return Qwen2Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=True,
            use_sliding_window=False,
            bos_token_id=None,
            eos_token_id=None,
        )


DEFAULT_PRESET = "mini"
PRESETS: dict[str, Preset] = {
    "mini": Preset("mini", 256, 1024, 4, 4, 2, 8192, 32_768, tokenizer="bpe8k"),
    "tiny": Preset("tiny", 256, 1024, 4, 4, 2, 32_768, 4096),
    "qwen2.5-0.5b": Preset("qwen2.5-0.5b", 896, 4864, 24, 14, 2, 151_936, 32_768),
    "micro": Preset("micro", 64, 128, 2, 4, 2, 512, 4096),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None


def build_random_model(preset: str | Preset, seed: int) -> Qwen2ForCausalLM:
    """The preset's model with deterministic random weights (fp32, CPU, eval mode)."""
    spec = get_preset(preset) if isinstance(preset, str) else preset
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(spec.config())
    model.generation_config.eos_token_id = None
    return model.eval()
