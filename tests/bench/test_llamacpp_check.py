"""The pure parts of ``make llamacpp-check`` (the mismatch classifier, the KV size), and a
small run where a built ``llama-server`` and a python with ``gguf`` are here
(``RADIXMESH_LLAMA_SERVER`` / ``RADIXMESH_GGUF_PYTHON``, else the Makefile's venv): CI has
none, so it skips there."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from radixmesh.bench.llamacpp_check import kv_bytes_per_token, main
from radixmesh.bench.llamacpp_mismatch import classify

LLAMA_SERVER = os.environ.get("RADIXMESH_LLAMA_SERVER", ".venv-llamacpp/bin/llama-server")
GGUF_PYTHON = os.environ.get("RADIXMESH_GGUF_PYTHON", ".venv-llamacpp/bin/python")


def row(seq: int, t: float, predicted: int, actual: int) -> dict[str, object]:
    return {"seq": seq, "served_by": "n0", "t_send": t, "t_done": t + 0.5,
            "prompt_tokens": None, "completion_tokens": 1, "predicted": predicted,
            "actual": actual}


def test_each_mismatch_gets_its_class_from_the_replayed_slot() -> None:
    a, b = list(range(100)), list(range(1000, 1100))
    prompts = {0: a, 1: b, 2: [*a[:90], 7, 7], 3: [*b[:40], 8], 4: [*a[:50], 9]}
    rows = [row(0, 0, 0, 0), row(1, 1, 0, 0),
            row(2, 2, 90, 90),  # b saved, a restored: right
            row(3, 3, 48, 40),  # predicted over: llama.cpp restored b, which shares 40
            row(4, 4, 48, 50)]  # under by less than a block
    out = classify(rows, prompts, block_size=16)
    assert out["slot_model_equal"] == 5
    assert out["classes"] == {"over: slot held another prompt": 1, "under: whole blocks": 1}
    rows[4]["actual"] = 20  # nothing the slot rule gives
    assert classify(rows, prompts, 16)["classes"]["not explained: over"] == 1


def test_kv_bytes_per_token_counts_k_and_v_in_f16(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256,
        "num_hidden_layers": 4}))
    assert kv_bytes_per_token(tmp_path) == 2 * 2 * 4 * 2 * 64


@pytest.mark.skipif(not (Path(LLAMA_SERVER).exists() and Path(GGUF_PYTHON).exists()),
                    reason="no llama-server / gguf python here (make llamacpp-check builds them)")
def test_a_small_run_predicts_what_llama_cpp_reuses(tmp_path: Path) -> None:
    assert main(["--llama-server", LLAMA_SERVER, "--gguf-python", GGUF_PYTHON, "--out",
                 str(tmp_path), "--requests", "12", "--policies", "cost"]) == 0
    res = json.loads((tmp_path / "llamacpp_check.json").read_text())
    cost = res["policies"][0]
    assert cost["summary"]["errors"] == 0
    assert cost["mismatches"]["slot_model_equal"] == cost["compared"]
