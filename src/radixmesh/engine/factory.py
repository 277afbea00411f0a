"""``build_engine``: the built-in engine from a preset or a local Hugging Face model directory.

Two ways in:

* ``build_engine(preset="mini", seed=0)`` — a Qwen2-architecture model with seeded random
  weights and the preset's tokenizer (see :mod:`radixmesh.engine.presets`: the shipped BPE for
  ``mini``, bytes for the others). Model identity: ``preset:<name>:seed<seed>:<dtype>``.
* ``build_engine(model_path="/models/Qwen2.5-0.5B-Instruct")`` — the path real users take:
  ``config.json`` + ``*.safetensors`` + ``tokenizer.json`` (+ ``tokenizer_config.json`` for
  EOS and the chat template), loaded with ``local_files_only=True`` — never the network.
  Model identity: ``dir:<digest>:<dtype>``, the digest covering config.json, the safetensors
  index and every weight file's size, first and last MiB (cheap, yet distinguishes fine-tunes).

A model directory is checked before anything is served: every ``*.safetensors`` file must
be readable (a truncated or corrupt one is refused, named), and the weights must be exactly
the ones the architecture in ``config.json`` expects — a weight missing from the checkpoint
(which transformers would silently initialise at random) or one the architecture has no place
for (e.g. ``model_type: gpt2`` over Qwen2 weights) refuses to start, naming them. Both are
``ValueError``: ``radixmesh serve`` answers "cannot build the engine: ...", no traceback.

Only full-attention decoder models are supported (Qwen2, Llama, Mistral without sliding
window, ...): radix KV reuse needs one K/V tensor per layer covering every position.

LoRA adapters (``adapters``: (served name, folder) pairs, ``--adapters NAME=DIR``): PEFT
folders loaded onto the model (``engine/lora.py``); the built-in engine needs the folder, a
bare digest (``NAME=DIGEST``, enough for an external engine that loads it) is refused.

``device`` is any torch device string: ``cpu`` (default), ``cuda``, ``cuda:1``, ``mps``.
Weights are created/loaded on the CPU and moved, so a preset is bit-identical on all devices
before the dtype cast. ``threads`` calls ``torch.set_num_threads`` (process-wide!): a local
multi-node cluster passes 1 per node.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from radixmesh.core.adapters import given_digest, parse_adapter_spec
from radixmesh.core.blocks import DEFAULT_BLOCK_SIZE
from radixmesh.engine.base import Tokenizer
from radixmesh.engine.builtin import STEP_TOKENS, EngineSpec, TransformersEngine
from radixmesh.engine.presets import DEFAULT_PRESET, build_random_model, get_preset
from radixmesh.engine.tokenizers import ByteTokenizer, HFTokenizer

DEFAULT_CACHE_TOKENS = 32_768
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MIB = 1 << 20


def resolve_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device 'mps' requested but MPS is not available")
    return dev


def resolve_dtype(dtype: str) -> torch.dtype:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}") from None


def build_engine(
    preset: str | None = DEFAULT_PRESET,
    *,
    model_path: str | Path | None = None,
    cache_tokens: int = DEFAULT_CACHE_TOKENS,
    block_size: int = DEFAULT_BLOCK_SIZE,
    device: str = "cpu",
    seed: int = 0,
    dtype: str = "float32",
    threads: int | None = None,
    model_name: str | None = None,
    tokenizer: Tokenizer | None = None,
    prefix_aware: bool = True,
    step_tokens: int = STEP_TOKENS,
    adapters: Sequence[tuple[str, str | Path]] = (),
) -> TransformersEngine:
    """Build the built-in engine (``model_path`` wins over ``preset``). ``prefix_aware=False``:
    FCFS admission; ``step_tokens``: tokens per step (vLLM's ``max_num_batched_tokens``);
    ``adapters``: LoRA (name, folder) pairs (module docstring)."""
    engine = _build(preset, model_path, cache_tokens, block_size, device, seed, dtype, threads,
                    model_name, tokenizer, prefix_aware, step_tokens)
    for name, folder in adapters:
        engine.load_adapter(name, folder)
    return engine


def adapter_folders(spec: str) -> list[tuple[str, Path]]:
    """``--adapters NAME=DIR,...`` for the built-in engine: (name, folder) pairs; ValueError
    naming an adapter given by digest only or whose folder is missing."""
    out = []
    for name, value in parse_adapter_spec(spec):
        folder = Path(value)
        if not folder.is_dir():
            why = "a digest" if given_digest(value) else "not a folder"
            raise ValueError(f"--adapters {name}: {value} is {why}; the built-in engine loads "
                             "a PEFT LoRA adapter from its folder (NAME=DIR)")
        out.append((name, folder))
    return out


def _build(preset: str | None, model_path: str | Path | None, cache_tokens: int,
           block_size: int, device: str, seed: int, dtype: str, threads: int | None,
           model_name: str | None, tokenizer: Tokenizer | None, prefix_aware: bool,
           step_tokens: int) -> TransformersEngine:
    if threads is not None:
        if threads < 1:
            raise ValueError("threads must be >= 1")
        torch.set_num_threads(threads)
    if cache_tokens < 0:
        raise ValueError("cache_tokens must be >= 0")
    dev, tdtype = resolve_device(device), resolve_dtype(dtype)
    if model_path is not None:
        return _from_dir(Path(model_path), cache_tokens, block_size, dev, dtype, model_name,
                         tokenizer, prefix_aware, step_tokens)
    if preset is None:
        raise ValueError("give a preset or a model_path")
    spec = get_preset(preset)
    model = build_random_model(spec, seed).to(device=dev, dtype=tdtype)
    engine_spec = EngineSpec(model_name or preset, f"preset:{preset}:seed{seed}:{dtype}",
                             spec.max_position_embeddings, block_size, cache_tokens,
                             step_tokens=step_tokens, prefix_aware=prefix_aware)
    return TransformersEngine(model, tokenizer or _preset_tokenizer(spec.tokenizer),
                              engine_spec, dev)


def preset_tokenizer(preset: str) -> Tokenizer:
    """The tokenizer a preset's engine uses (without building the model)."""
    return _preset_tokenizer(get_preset(preset).tokenizer)


def _preset_tokenizer(kind: str) -> Tokenizer:
    if kind == "bpe8k":
        from radixmesh.engine import bpe

        return bpe.load()
    return ByteTokenizer()


def _from_dir(
    root: Path,
    cache_tokens: int,
    block_size: int,
    dev: torch.device,
    dtype: str,
    model_name: str | None,
    tokenizer: Tokenizer | None,
    prefix_aware: bool,
    step_tokens: int,
) -> TransformersEngine:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # server logs, not a terminal
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root} is not a model directory (no config.json)")
    config = AutoConfig.from_pretrained(root, local_files_only=True)
    _check_full_attention(config)
    _check_weight_files(root)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            root, local_files_only=True, dtype=resolve_dtype(dtype), output_loading_info=True
        )
    except SafetensorError as exc:
        raise ValueError(f"{root}: cannot read the weights: {exc}") from exc
    _check_loading_info(root, getattr(config, "model_type", "?"), info)
    model = model.to(dev).eval()
    text_cfg = config.get_text_config()
    spec = EngineSpec(
        model_name=model_name or root.resolve().name,
        model_identity=f"dir:{model_dir_digest(root)}:{dtype}",
        max_context=int(text_cfg.max_position_embeddings),
        block_size=block_size,
        cache_tokens=cache_tokens,
        prefix_aware=prefix_aware,
        step_tokens=step_tokens,
    )
    return TransformersEngine(model, tokenizer or HFTokenizer(root), spec, dev)


def _check_weight_files(root: Path) -> None:
    """Every safetensors file's header is readable and its data complete (cheap: the header
    only, memory-mapped) — a truncated download is named here, not deep in a traceback."""
    for path in sorted(root.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                f.keys()
        except SafetensorError as exc:
            raise ValueError(f"{path} is not a complete safetensors file ({exc}); "
                             "re-download it") from exc


def _names(keys: object, limit: int = 8) -> str:
    names = sorted(str(k) for k in keys)  # type: ignore[attr-defined]
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _check_loading_info(root: Path, model_type: str, info: dict[str, object]) -> None:
    """Refuse a checkpoint whose weights are not exactly the architecture's."""
    problems = []
    for kind, what in (("missing_keys", "missing from the checkpoint (would be random)"),
                       ("unexpected_keys", "in the checkpoint but not in the architecture"),
                       ("mismatched_keys", "of the wrong shape")):
        keys = info.get(kind) or ()
        if keys:
            problems.append(f"{len(keys)} weights {what}: {_names(keys)}")  # type: ignore[arg-type]
    if problems:
        raise ValueError(
            f"{root}: the weights do not match config.json (model_type {model_type!r}): "
            + "; ".join(problems)
        )


def _check_full_attention(config: object) -> None:
    text_cfg = config.get_text_config()  # type: ignore[attr-defined]
    kinds = set(getattr(text_cfg, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(f"unsupported attention layer types {sorted(kinds)}: need full attention")


def model_dir_digest(root: Path) -> str:
    """Identity of a model directory's weights and config (not a full-content hash)."""
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        path = root / name
        if path.is_file():
            h.update(name.encode() + b"\0" + path.read_bytes())
    for path in sorted(root.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            h.update(f.read(_MIB))
            f.seek(max(size - _MIB, 0))
            h.update(f.read(_MIB))
    return h.hexdigest()[:16]


def describe(engine: TransformersEngine) -> dict[str, object]:
    """A JSON-able summary (for logs and ``/v1/models``)."""
    fp = engine.fingerprint
    return {
        "model": engine.model_name,
        "model_identity": fp.model,
        "tokenizer": fp.tokenizer,
        "block_size": fp.block_size,
        "fingerprint": f"{fp.digest:016x}",
        "max_context": engine.max_context,
        "cache_tokens": engine.spec.cache_tokens,
        "device": str(engine.device),
        "kv_bytes_per_token": engine.kv_bytes_per_token,
        "model_type": getattr(engine.model.config, "model_type", None),
        "adapters": list(engine.adapters),
    }
