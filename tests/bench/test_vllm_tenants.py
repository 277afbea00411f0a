"""The pure parts of ``make vllm-tenants`` and ``make vllm-emulated`` (their runs need vLLM's
own venv: not in CI), and the tenants run itself where that venv is here
(``RADIXMESH_VLLM_PYTHON`` or ``.venv-vllm/bin/python``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgpack
import pytest

from radixmesh.bench.vllm_emulated import compare
from radixmesh.bench.vllm_tenants import STEPS, event_shapes, main, save_random_adapter, verdict

VLLM_PYTHON = os.environ.get("RADIXMESH_VLLM_PYTHON", ".venv-vllm/bin/python")


def test_the_adapter_is_a_peft_folder_shaped_for_the_model(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128,
        "vocab_size": 256}))
    folder = save_random_adapter(tmp_path / "ad", model, rank=4)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 2 * 2  # layers x (q, v) x (A, B)
    v_b = tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    assert tuple(v_b.shape) == (2 * 16, 4) and float(v_b.abs().sum()) > 0  # not PEFT's zero B


def test_the_verdict_counts_cross_namespace_hits_and_repeats() -> None:
    rows = [{"predicted": p, "actual": a, "error": None}
            for p, a in [(0, 0), (512, 512), (0, 0), (512, 512), (0, 128), (512, 512)]]
    v = verdict(rows)
    assert v == {"requests": 6, "answered": 6, "index_equals_engine": 5,
                 "cross_namespace_hits": 1, "repeat_hits": 3}
    assert len(STEPS) % 2 == 0  # every namespace sent twice: first, then a repeat


def test_event_shapes_read_the_extra_keys_vllm_publishes() -> None:
    stored = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
              "token_ids": list(range(256)), "block_size": 128, "lora_name": "ad1",
              "extra_keys": [["ad1", "tenant-a"], ["ad1"]]}
    frames = [(0.0, [b"", (0).to_bytes(8, "big"), msgpack.packb([0.0, [stored], 0])])]
    assert event_shapes(frames) == [{"lora_name": "ad1", "root": True,
                                     "first_block_keys": ["ad1", "tenant-a"],
                                     "later_block_keys": ["ad1"]}]


def test_compare_pairs_requests_and_reports_ratios() -> None:
    real = [{"ok": True, "ttft_s": t, "latency_s": 2 * t, "prompt_tokens": 100,
             "cached_tokens": 50} for t in (0.1, 0.2, 0.4)]
    emu = [{**r, "ttft_s": r["ttft_s"] * 1.1, "cached_tokens": 40} for r in real]
    c = compare(real, emu)
    assert c["paired"] == 3 and abs(c["ttft_s"]["ratio_median"] - 1.1) < 1e-9
    assert c["latency_s"]["ratio_median"] == pytest.approx(1.0)
    assert c["real_hit_rate"] == 0.5 and c["emulated_hit_rate"] == 0.4


@pytest.mark.slow
@pytest.mark.skipif(not Path(VLLM_PYTHON).exists(), reason="no vLLM venv (make vllm-tenants)")
def test_real_vllm_isolates_tenants_and_maps_their_events(tmp_path: Path) -> None:
    assert main(["--vllm-python", VLLM_PYTHON, "--out", str(tmp_path)]) == 0
    v = json.loads((tmp_path / "vllm_tenants.json").read_text())["verdict"]
    assert v["answered"] == v["requests"] == v["index_equals_engine"]
    assert v["cross_namespace_hits"] == 0 and v["repeat_hits"] == v["requests"] // 2
