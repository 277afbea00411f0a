"""A model directory whose weights are not its architecture's is refused, naming them."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixmesh.cli import main
from radixmesh.engine.factory import build_engine


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _resave(root: Path, edit: object) -> None:
    path = root / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)  # type: ignore[operator]
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_a_matching_directory_loads(micro_model_dir: Path) -> None:
    assert build_engine(model_path=micro_model_dir, cache_tokens=256).model_name


def test_another_architecture_over_the_weights_is_refused(micro_model_dir: Path,
                                                           tmp_path: Path) -> None:
    root = _copy(micro_model_dir, tmp_path / "gpt2")
    cfg = json.loads((root / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as err:
        build_engine(model_path=root, cache_tokens=256)
    text = str(err.value)
    assert "model_type 'gpt2'" in text
    assert "missing from the checkpoint" in text and "lm_head.weight" in text
    assert "not in the architecture" in text and "model.embed_tokens.weight" in text


def test_a_missing_weight_is_named(micro_model_dir: Path, tmp_path: Path) -> None:
    root = _copy(micro_model_dir, tmp_path / "missing")
    name = "model.layers.0.mlp.up_proj.weight"
    _resave(root, lambda t: t.pop(name))
    with pytest.raises(ValueError,
                       match="1 weights missing from the checkpoint.*" + re.escape(name)):
        build_engine(model_path=root, cache_tokens=256)


def test_an_unexpected_weight_is_named(micro_model_dir: Path, tmp_path: Path) -> None:
    root = _copy(micro_model_dir, tmp_path / "extra")
    _resave(root, lambda t: t.__setitem__("model.adapter.weight", torch.zeros(2, 2)))
    with pytest.raises(ValueError, match=re.escape("1 weights in the checkpoint but not in "
                                                   "the architecture: model.adapter.weight")):
        build_engine(model_path=root, cache_tokens=256)


def test_a_truncated_file_is_named(micro_model_dir: Path, tmp_path: Path) -> None:
    root = _copy(micro_model_dir, tmp_path / "truncated")
    path = root / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors is not a complete safetensors"):
        build_engine(model_path=root, cache_tokens=256)


def test_serve_answers_cannot_build_without_a_traceback(
        micro_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _copy(micro_model_dir, tmp_path / "truncated")
    path = root / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    assert main(["serve", "--model", str(root), "--port", "18993"]) == 2
    err = capsys.readouterr().err
    assert "radixmesh serve: cannot build the engine:" in err and "model.safetensors" in err
    assert "Traceback" not in err
