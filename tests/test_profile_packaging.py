"""The shipped step-time profiles are package data: a built wheel installs and loads them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_profiles_load_from_an_installed_wheel(tmp_path: Path) -> None:
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    wheels, target, project = tmp_path / "wheels", tmp_path / "site", tmp_path / "project"
    # a copy: the build writes build/ and *.egg-info beside the sources
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "src", project / "src", ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, project / name)
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(project)],
        check=True,
        timeout=240,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("radixmesh-*.whl")
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        timeout=120,
    )
    code = (
        "import radixmesh, radixmesh.core.profile as p; "
        "print(radixmesh.__file__); print(*p.shipped()); "
        "print(p.resolve('h100-llama3-8b').model)"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.splitlines()
    assert out[0].startswith(str(target))  # the installed copy, not the source tree
    assert set(out[1].split()) == {
        "cpu-tiny",
        "h100-llama3-8b",
        "a100-llama3-8b",
        "a10g-llama3-8b",
        "h100-qwen2.5-0.5b",
        "vllm-cpu-tiny",
    }
    assert out[2].startswith("meta-llama/Llama-3.1-8B")
