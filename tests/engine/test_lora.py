"""PEFT LoRA adapters on the built-in engine (engine/lora.py): an adapter's greedy answer is the
merged model's (``W + scaling B A`` in a copy, HF ``generate``), differs from the base model's;
a batch mixing adapters answers what each request alone answers; an adapter never reuses
another's or the base model's KV; a malformed folder is refused naming what is wrong."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixmesh.engine.base import GenerateRequest, SamplingParams
from radixmesh.engine.builtin import TransformersEngine
from radixmesh.engine.factory import adapter_folders, build_engine
from radixmesh.engine.lora import read_adapter
from radixmesh.engine.presets import build_random_model
from radixmesh.engine.testing import merge_lora, save_random_lora_dir, step_until_done

MAX_NEW = 10


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    model = build_random_model("tiny", 0)
    return {"x": save_random_lora_dir(root / "x", model, seed=1),
            "y": save_random_lora_dir(root / "y", model, seed=2, rank=4, alpha=4.0,
                                      targets=("k_proj", "gate_proj", "up_proj"))}


@pytest.fixture(scope="module")
def engine(folders: dict[str, Path]) -> TransformersEngine:
    return build_engine("tiny", cache_tokens=8192, seed=0, adapters=sorted(folders.items()))


def _req(prompt: list[int], adapter: str | None, ns: str | None = None,
         **kw: Any) -> GenerateRequest:
    kw.setdefault("max_tokens", MAX_NEW)
    return GenerateRequest("r", tuple(prompt), SamplingParams(**kw), cache_namespace=ns,
                           adapter=adapter)


def _prompt(seed: int, n: int = 50) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(n)]


def _first_logits(engine: TransformersEngine, req: GenerateRequest) -> torch.Tensor:
    got: list[torch.Tensor] = []
    done: list[Any] = []
    engine.runner.submit(req, engine.budget(req), None, done.append, got)
    while not done:
        engine.runner.step()
    return got[0][: engine.tokenizer.vocab_size]


def test_an_adapter_answers_as_the_merged_model(engine: TransformersEngine,
                                                folders: dict[str, Path]) -> None:
    allowed = engine.tokenizer.vocab_size
    differ = 0
    for name in ("x", "y"):
        ref = merge_lora(build_random_model("tiny", 0), folders[name])
        for seed in range(2):
            p = _prompt(seed)
            engine.clear_cache()
            got = _first_logits(engine, _req(p, name))
            with torch.inference_mode():
                want = ref(input_ids=torch.tensor([p])).logits[0, -1, :allowed]
                out = ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p)),
                                   max_new_tokens=MAX_NEW, do_sample=False,
                                   suppress_tokens=list(range(allowed, 32_768)))
            assert torch.allclose(got, want, atol=2e-4), float((got - want).abs().max())
            answer = engine.generate(_req(p, name)).output_ids
            assert answer == out[0, len(p):].tolist(), (name, seed)
            base = _first_logits(engine, _req(p, None))
            assert float((got - base).abs().max()) > 0.05  # the adapter counts
            differ += answer != engine.generate(_req(p, None)).output_ids
    assert differ >= 2  # (the random base model often repeats one token: so may its adapter)


def test_a_batch_mixing_adapters_answers_as_each_alone(engine: TransformersEngine) -> None:
    prompts = [_prompt(10 + i, 120 + 60 * i) for i in range(3)]  # > 512 tokens a step
    plan = [(0, None), (0, "x"), (0, "y"), (1, "x"), (1, None), (2, "y"), (2, "x"), (1, "y")]
    alone = {}
    for i, name in set(plan):
        engine.clear_cache()
        alone[i, name] = engine.generate(_req(prompts[i], name)).output_ids
    engine.clear_cache()
    results = step_until_done(engine, [_req(prompts[i], name, logprobs=2) for i, name in plan])
    assert engine.stats()["max_batch"] >= 4
    for k, (i, name) in enumerate(plan):
        assert results[k].output_ids == alone[i, name], (k, i, name)
    assert {tuple(alone[0, n]) for n in (None, "x", "y")} != {tuple(alone[0, None])}


def test_an_adapter_never_reuses_other_kv(engine: TransformersEngine) -> None:
    """Without a namespace (the engine used directly) an adapter is its own namespace; the node
    passes one holding the adapter's digest (core/tenants.py)."""
    engine.clear_cache()
    p = _prompt(5, 70)
    cached = [engine.generate(_req(p, name)).cached_tokens
              for name in (None, "x", "y", "x", None, "y")]
    assert cached == [0, 0, 0, 64, 64, 64]
    ns = engine.generate(_req(p, "x", ns="tenant+x")).cached_tokens
    assert ns == 0  # a namespace of its own (the node's includes the digest)


def test_prompt_logprobs_run_with_the_adapter(engine: TransformersEngine,
                                              folders: dict[str, Path]) -> None:
    p = _prompt(3, 20)
    got = engine.generate(_req(p, "x", prompt_logprobs=0, max_tokens=1)).prompt_logprobs
    ref = merge_lora(build_random_model("tiny", 0), folders["x"])
    allowed = engine.tokenizer.vocab_size
    with torch.inference_mode():
        logits = ref(input_ids=torch.tensor([p])).logits[0, :, :allowed].float()
    want = torch.log_softmax(logits, -1)
    for i in range(1, len(p)):
        entry = got[i]
        assert entry is not None
        assert abs(entry.logprob - float(want[i - 1, p[i]])) < 1e-3


def test_unknown_adapter_and_bad_folders_are_refused(engine: TransformersEngine,
                                                     folders: dict[str, Path],
                                                     tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'nope' is not loaded"):
        engine.budget(_req([1, 2, 3], "nope"))
    model = build_random_model("tiny", 0)
    good = folders["x"]
    config = json.loads((good / "adapter_config.json").read_text())
    tensors = load_file(str(good / "adapter_model.safetensors"))
    key = next(iter(tensors))

    def variant(name: str, cfg: dict[str, Any] | None = None,
                weights: dict[str, torch.Tensor] | None = None) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps({**config, **(cfg or {})}))
        if weights is not None:
            save_file(weights, str(d / "adapter_model.safetensors"))
        return d

    cases = [
        (variant("dora", {"use_dora": True}, tensors), "use_dora"),
        (variant("bias", {"bias": "all"}, tensors), "bias"),
        (variant("ia3", {"peft_type": "IA3"}, tensors), "IA3"),
        (variant("alpha", {"lora_alpha": 0}, tensors), "lora_alpha"),
        (variant("none"), "no adapter_model.safetensors"),
        (variant("shape", None, {**tensors, key: torch.zeros(3, 3)}), "do not fit"),
        (variant("head", None, {"base_model.model.lm_head.lora_A.weight": torch.zeros(2, 256),
                                "base_model.model.lm_head.lora_B.weight": torch.zeros(9, 2)}),
         "output head"),
        (variant("half", None, {key: tensors[key]}), "lacks lora_A or lora_B"),
        (variant("emb", None, {"base_model.model.model.embed_tokens.lora_embedding_A":
                               torch.zeros(2, 9)}), "not a LoRA A/B weight"),
    ]
    for folder, message in cases:
        with pytest.raises(ValueError, match=message):
            read_adapter("bad", folder, model)
    with pytest.raises(ValueError, match="is a digest"):
        adapter_folders("sql=" + "a" * 64)
    assert adapter_folders(f"sql={good}") == [("sql", good)]


def test_a_step_run_in_pieces_gives_each_row_its_adapter(folders: dict[str, Path]) -> None:
    """``bound`` hands consecutive forwards (a step cut into pieces) the next rows: a layer's
    output row is its merged adapter's (or the base weight's) product, across a piece's edge."""
    from radixmesh.core.scheduler import DecodeSlot, PrefillChunk, Step
    from radixmesh.engine.lora import LoraSet, bound

    model = build_random_model("tiny", 0)
    lora = LoraSet(model)
    for name, folder in sorted(folders.items()):
        lora.load(name, folder)
    layer_name = "model.layers.1.self_attn.q_proj"  # adapted by x only (y: k, gate, up)
    layer = dict(model.named_modules())[layer_name]
    merged = merge_lora(build_random_model("tiny", 0), folders["x"])
    w_x = dict(merged.named_modules())[layer_name].weight

    class Live:
        def __init__(self, adapter: str | None) -> None:
            self.req = _req([1], adapter)

    live = {1: Live("x"), 2: Live(None), 3: Live("x"), 4: Live("y")}
    step = Step((PrefillChunk(1, 0, 10, True), PrefillChunk(2, 0, 6, True),
                 PrefillChunk(3, 4, 3, False)), (DecodeSlot(4, 9),), ())
    rows = [1] * 10 + [2] * 6 + [3] * 3 + [4]
    x = torch.randn(len(rows), layer.in_features)
    with torch.inference_mode(), bound(lora, step, live):  # type: ignore[arg-type]
        outs = []
        for a, b in ((0, 7), (7, 13), (13, 20)):  # three forwards, cut inside chunks
            lora._next_forward(model, (), {"input_ids": torch.zeros(1, b - a)})
            outs.append(layer(x[a:b].unsqueeze(0))[0])
        got = torch.cat(outs)
    bias = 0 if layer.bias is None else layer.bias
    want = torch.stack([x[i] @ (w_x if live[seq].req.adapter == "x" else layer.weight).t()
                        + bias for i, seq in enumerate(rows)])
    assert torch.allclose(got, want, atol=1e-5)
    assert not lora.groups and not lora.pending  # unbound afterwards
