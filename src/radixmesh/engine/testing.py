"""Local stand-ins for a downloaded model: save a random preset as a Hugging Face model dir.

``save_random_model_dir(path, preset="tiny", seed=0)`` writes ``config.json``,
``model.safetensors`` (the preset's seeded random weights), a ``tokenizer.json`` — a small
byte-level BPE trained right here on a few sentences with the ``tokenizers`` library, so it
needs no download — and a ``tokenizer_config.json`` with EOS and a ChatML chat template.
Loading the directory with ``build_engine(model_path=path)`` goes through exactly the code a
real model takes. Used by tests and demos; never fetches anything.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers.utils import logging as hf_logging

from radixmesh.engine.base import GenerateRequest, GenerateResult
from radixmesh.engine.builtin import TransformersEngine
from radixmesh.engine.presets import build_random_model, get_preset
from radixmesh.engine.tokenizers import CHATML_FALLBACK

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_CORPUS = (
    "The following are multiple choice questions (with answers) about high school physics.",
    "Question: What is the unit of force? A. joule B. newton C. watt D. pascal Answer: B",
    "Find all c in Z_3 such that Z_3[x]/(x^2 + c) is a field. Answer: B",
    "Statement 1 | Every element of a group generates a cyclic subgroup. Answer: C",
    "The quick brown fox jumps over the lazy dog. Peer-to-peer serving with radix caches.",
    "user assistant system: hello, how are you? I am fine, thank you. Ünïcödé ✓ 日本語",
)


def train_tokenizer(vocab_size: int = 400, corpus: Iterable[str] | None = None) -> Tokenizer:
    """A byte-level BPE (lossless on any UTF-8 text) with ChatML special tokens, trained on
    ``corpus`` (default: a few built-in sentences, enough for tests)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS) * 4 if corpus is None else corpus, trainer=trainer)
    return tok


def save_random_model_dir(
    path: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    vocab_size: int = 400,
    corpus: Iterable[str] | None = None,
) -> Path:
    """Write a random-weight model + tokenizer (trained on ``corpus``, see
    :func:`train_tokenizer`) as a local HF model directory; returns it."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    spec = get_preset(preset)
    if vocab_size > spec.vocab_size:
        raise ValueError(f"tokenizer vocab {vocab_size} exceeds the model's {spec.vocab_size}")
    model = build_random_model(spec, seed)
    eos_id = SPECIAL_TOKENS.index("<|endoftext|>")
    model.config.eos_token_id = eos_id
    hf_logging.disable_progress_bar()
    model.save_pretrained(root)
    train_tokenizer(vocab_size, corpus).save(str(root / "tokenizer.json"))
    config = {
        "eos_token": "<|endoftext|>",
        "chat_template": CHATML_FALLBACK,
        "model_max_length": spec.max_position_embeddings,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (root / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return root


def step_until_done(engine: TransformersEngine, reqs: Sequence[GenerateRequest],
                    max_steps: int = 100_000) -> list[GenerateResult | BaseException]:
    """Submit every request to ``engine``'s runner at once and step it until each has ended;
    each one's result (or the exception it ended with), in order. At most ``max_steps`` steps
    (then ``RuntimeError``)."""
    done: dict[int, GenerateResult | BaseException] = {}
    for i, r in enumerate(reqs):
        engine.runner.submit(r, engine.budget(r), None,
                             lambda res, i=i: done.__setitem__(i, res))
    for _ in range(max_steps):
        if len(done) == len(reqs):
            return [done[i] for i in range(len(reqs))]
        engine.runner.step()
    raise RuntimeError(f"{len(reqs) - len(done)} requests still running after {max_steps} steps")


def uncached_logits(engine: TransformersEngine, prompt: Sequence[int]) -> torch.Tensor:
    """Reference: last-position fp32 logits of one plain forward pass, no cache involved."""
    with torch.inference_mode():
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=engine.device)
        return engine.model(input_ids=ids).logits[0, -1].float().cpu()


class ScriptedEngine:
    """Engine proxy for tests: generates the bytes of ``text`` (one token each, ``token_s``
    apart) whatever the prompt, obeying the engine contract (``on_token`` raising stops it);
    everything else (cache view, tokenizer, fingerprint) is the wrapped engine's. ``generated``
    counts the tokens it produced. It ignores penalties and logprobs, so it says so
    (``extended_sampling``) instead of passing the wrapped engine's flag through."""

    extended_sampling = False

    def __init__(self, engine: Any, text: str, token_s: float) -> None:
        self._engine = engine
        self._tokens = text.encode()
        self._token_s = token_s
        self.generated = 0

    def generate(self, req: GenerateRequest, on_token: Callable[[int], None] | None = None
                 ) -> GenerateResult:
        out: list[int] = []
        for tok in self._tokens[: req.sampling.max_tokens]:
            time.sleep(self._token_s)
            if on_token is not None:
                on_token(tok)  # raises once the request was stopped
            out.append(tok)
            self.generated += 1
        return GenerateResult(req.request_id, out, "length", len(req.prompt_ids), 0,
                              0.0, 0.0, 0.0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class SlowTokens:
    """Engine proxy for tests: the wrapped engine's real output, each generated token
    ``token_s`` later than it would be (the ``on_token`` callback still runs, so stopping and
    cancelling behave as with a slow model); everything else is the wrapped engine's."""

    def __init__(self, engine: Any, token_s: float) -> None:
        self._engine = engine
        self._token_s = token_s

    def generate(self, req: GenerateRequest, on_token: Callable[[int], None] | None = None
                 ) -> GenerateResult:
        def slow(tok: int) -> None:
            time.sleep(self._token_s)
            if on_token is not None:
                on_token(tok)

        result: GenerateResult = self._engine.generate(req, slow)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


LORA_TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")


def save_random_lora_dir(path: Path, model: torch.nn.Module, seed: int = 0, rank: int = 8,
                         alpha: float = 16.0, targets: Sequence[str] = LORA_TARGETS,
                         std: float = 0.05, use_rslora: bool = False,
                         rank_pattern: Mapping[str, int] | None = None) -> Path:
    """A PEFT LoRA adapter folder (``engine/lora.py``'s format: ``adapter_config.json`` +
    ``adapter_model.safetensors``) for ``model``, with seeded random non-zero A and B on the
    linear layers named ``targets`` (PEFT initialises B to zero; a trained adapter is not).
    ``rank_pattern`` (PEFT's: module name or regex -> rank) gives matching layers another rank;
    ``use_rslora`` is written to the config (scaling ``alpha / sqrt(r)``)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules":
              list(targets), "bias": "none", "use_rslora": use_rslora, "use_dora": False,
              "rank_pattern": dict(rank_pattern or {}), "fan_in_fan_out": False,
              "modules_to_save": None, "task_type": "CAUSAL_LM"}
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            key = f"base_model.model.{name}"
            r = _layer_rank(config, name)
            tensors[f"{key}.lora_A.weight"] = torch.randn(
                r, module.in_features, generator=gen) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(
                module.out_features, r, generator=gen) * std
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path


def _layer_rank(config: Mapping[str, Any], name: str) -> int:
    """A layer's rank under PEFT's config: the first ``rank_pattern`` key matching the module
    path's tail (``(.*\\.)?(key)$``, peft/utils/other.py ``get_pattern_key``), else ``r``."""
    for key, r in (config.get("rank_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return int(r)
    return int(config["r"])


def merge_lora(model: torch.nn.Module, folder: Path) -> torch.nn.Module:
    """``model`` with ``folder``'s adapter merged in place, ``W += scaling B @ A`` per layer,
    ``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``; ``r`` the layer's
    ``rank_pattern`` rank, else the config's): a reference for tests, read from the config
    independently of ``engine/lora.py`` (a layer whose A has another rank is an error)."""
    from safetensors.torch import load_file

    config = json.loads((folder / "adapter_config.json").read_text())
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    modules = dict(model.named_modules())
    with torch.no_grad():
        for key, a in tensors.items():
            if key.endswith(".lora_A.weight"):
                name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = tensors[key.replace(".lora_A.", ".lora_B.")]
                r = _layer_rank(config, name)
                if a.shape[0] != r:
                    raise ValueError(f"{name}: lora_A has rank {a.shape[0]}, the config {r}")
                root = math.sqrt(r) if config.get("use_rslora") else r
                modules[name].weight += config["lora_alpha"] / root * (b @ a)
    return model
