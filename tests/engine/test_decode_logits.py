"""Every step's logits of the built-in engine equal a plain HF forward's: for each emitted token of
plain, namespaced and LoRA rows (PEFT scaling ``alpha / r``, rsLoRA's ``alpha / sqrt(r)``, a
``rank_pattern`` of mixed ranks) in one continuous batch, whole or cut into pieces, the row the
engine sampled from equals the stock model's (or the merged adapter's) last-position logits over
prompt + the tokens so far. Greedy tokens alone cannot show a wrong decode position (the tiny
random model often repeats one token whatever the position); logits do.

Tolerance: fp32 throughout; the engine's paged attention over a packed batch sums in another
order than HF's SDPA over one sequence: measured here, at most 9e-7 on any row. ``ATOL`` = 1e-4
leaves two orders of magnitude for other CPUs' kernels and stays far below what the faults this
guards against move a row (checked by mutating engine/batch.py and engine/lora.py: every decode
position +112 gives >= 3.7e-2 on a plain row, the same for namespaced rows only >= 2.5e-2,
rsLoRA scaled as alpha / r ~0.85)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from radixmesh.core.scheduler import Step
from radixmesh.engine import batch as batch_module
from radixmesh.engine.base import GenerateRequest, GenerateResult, SamplingParams
from radixmesh.engine.builtin import TransformersEngine
from radixmesh.engine.factory import build_engine
from radixmesh.engine.presets import build_random_model
from radixmesh.engine.testing import merge_lora, save_random_lora_dir, step_until_done

ATOL = 1e-4
MAX_NEW = 8
STEP_TOKENS = 64  # prefill chunks and decodes share steps; pieces of 37 cut them further
ADAPTERS = {  # name -> save_random_lora_dir options
    "x": {"seed": 1},
    "rs": {"seed": 2, "rank": 16, "alpha": 8.0, "use_rslora": True},
    "mixed": {"seed": 3, "rank": 8, "targets": ("q_proj", "v_proj", "down_proj"),
              "rank_pattern": {"q_proj": 4, "model.layers.1.mlp.down_proj": 2}},
}
# (request id, prompt length, namespace, adapter)
PLAN = [("plain-a", 30, None, None), ("plain-b", 150, None, None), ("ns-a", 45, "t1", None),
        ("ns-b", 100, "t2", None), ("x", 70, None, "x"), ("rs", 25, None, "rs"),
        ("mixed", 90, None, "mixed"), ("x-ns", 55, "t1", "x")]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    model = build_random_model("tiny", 0)
    return {name: save_random_lora_dir(root / name, model, **kw)  # type: ignore[arg-type]
            for name, kw in ADAPTERS.items()}


@pytest.fixture(scope="module")
def refs(folders: dict[str, Path]) -> dict[str | None, torch.nn.Module]:
    """The stock model (no paged attention, no hooks) and each adapter merged into a copy."""
    out: dict[str | None, torch.nn.Module] = {None: build_random_model("tiny", 0)}
    for name, folder in folders.items():
        out[name] = merge_lora(build_random_model("tiny", 0), folder)
    return out


@pytest.fixture(scope="module")
def engine(folders: dict[str, Path]) -> TransformersEngine:
    return build_engine("tiny", cache_tokens=8192, seed=0, step_tokens=STEP_TOKENS,
                        adapters=sorted(folders.items()))


def _requests() -> list[GenerateRequest]:
    rng = random.Random(0)
    return [GenerateRequest(rid, tuple(rng.randrange(32, 127) for _ in range(n)),
                            SamplingParams(max_tokens=MAX_NEW), cache_namespace=ns,
                            adapter=adapter)
            for rid, n, ns, adapter in PLAN]


def _run_capturing(engine: TransformersEngine, monkeypatch: pytest.MonkeyPatch
                   ) -> tuple[list[GenerateResult], dict[str, list[torch.Tensor]]]:
    """The plan run as one batch; each request's logits rows, one per emitted token, in order
    (the rows ``BatchRunner.step`` samples from, taken at ``_forward``)."""
    runner = engine.runner
    rows: dict[str, list[torch.Tensor]] = {}
    forward: Callable[[Step], torch.Tensor] = runner._forward

    def spy(step: Step) -> torch.Tensor:
        out = forward(step)
        for seq, row in zip(step.emitting, out, strict=True):
            rows.setdefault(runner._live[seq].req.request_id, []).append(row.cpu())
        return out

    monkeypatch.setattr(runner, "_forward", spy)
    engine.clear_cache()
    results = step_until_done(engine, _requests())
    monkeypatch.undo()
    assert all(isinstance(r, GenerateResult) for r in results)
    return results, rows  # type: ignore[return-value]


def _max_errors(engine: TransformersEngine, refs: dict[str | None, torch.nn.Module],
                results: list[GenerateResult], rows: dict[str, list[torch.Tensor]]
                ) -> dict[str, list[float]]:
    """Per request: max |engine - reference| of each emitted token's logits (index 0: the
    prefill's, then one per decode step)."""
    allowed = engine.tokenizer.vocab_size
    errors = {}
    for req, res in zip(_requests(), results, strict=True):
        got = rows[req.request_id]
        assert len(res.output_ids) <= len(got) <= len(res.output_ids) + 1  # (+1: a stop token)
        seq = list(req.prompt_ids) + res.output_ids
        with torch.inference_mode():
            logits = refs[req.adapter](input_ids=torch.tensor([seq])).logits[0].float()
        first = len(req.prompt_ids) - 1
        errors[req.request_id] = [
            float((row[:allowed] - logits[first + k, :allowed]).abs().max())
            for k, row in enumerate(got)]
    return errors


@pytest.mark.parametrize("piece_tokens", [None, 37])
def test_every_step_logits_equal_an_hf_forward(engine: TransformersEngine,
                                               refs: dict[str | None, torch.nn.Module],
                                               monkeypatch: pytest.MonkeyPatch,
                                               piece_tokens: int | None) -> None:
    if piece_tokens is not None:
        monkeypatch.setattr(batch_module, "PIECE_TOKENS", piece_tokens)
    results, rows = _run_capturing(engine, monkeypatch)
    assert engine.stats()["max_batch"] >= 4
    errors = _max_errors(engine, refs, results, rows)
    for rid, errs in errors.items():
        assert len(errs) > 1, rid  # decode steps were checked, not only the prefill's row
        bad = [(k, e) for k, e in enumerate(errs) if e > ATOL]
        assert not bad, f"{rid}: (step, max error) {bad}"
    print({rid: f"{max(errs):.1e}" for rid, errs in errors.items()})


def test_rslora_and_rank_pattern_change_the_answer(folders: dict[str, Path], tmp_path: Path
                                                   ) -> None:
    """The reference follows the config: rsLoRA scales by alpha / sqrt(r), not alpha / r; a
    ``rank_pattern`` layer has its own rank (and merge_lora refuses an A of another rank)."""
    import json

    model = build_random_model("tiny", 0)
    rs = folders["rs"]
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "adapter_model.safetensors").write_bytes(
        (rs / "adapter_model.safetensors").read_bytes())
    config = json.loads((rs / "adapter_config.json").read_text())
    (plain / "adapter_config.json").write_text(json.dumps({**config, "use_rslora": False}))
    layer = "model.layers.0.self_attn.q_proj"
    base = dict(model.named_modules())[layer].weight
    d_rs = dict(merge_lora(build_random_model("tiny", 0), rs).named_modules())[layer].weight
    d_plain = dict(merge_lora(build_random_model("tiny", 0), plain).named_modules())[layer].weight
    assert torch.allclose(d_rs - base, (d_plain - base) * 4.0, atol=1e-6)  # sqrt(16) / 1
    ranks = {name: tuple(a.shape) for name, a in _lora_a(folders["mixed"]).items()}
    assert ranks["model.layers.0.self_attn.q_proj"][0] == 4
    assert ranks["model.layers.1.mlp.down_proj"][0] == 2
    assert ranks["model.layers.0.mlp.down_proj"][0] == ranks["model.layers.0.self_attn.v_proj"][
        0] == 8
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "adapter_model.safetensors").write_bytes(
        (folders["mixed"] / "adapter_model.safetensors").read_bytes())
    config = json.loads((folders["mixed"] / "adapter_config.json").read_text())
    (wrong / "adapter_config.json").write_text(json.dumps({**config, "rank_pattern": {}}))
    with pytest.raises(ValueError, match="q_proj: lora_A has rank 4, the config 8"):
        merge_lora(build_random_model("tiny", 0), wrong)


def _lora_a(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "adapter_model.safetensors"))
    return {k.removeprefix("base_model.model.").removesuffix(".lora_A.weight"): t
            for k, t in tensors.items() if k.endswith(".lora_A.weight")}
