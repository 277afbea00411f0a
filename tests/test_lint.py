"""Lint and types are part of the test suite: ruff on everything, mypy --strict on core."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)


def test_ruff() -> None:
    out = _run(str(BIN / "ruff"), "check", "src", "tests")
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_strict_core() -> None:
    out = _run(str(BIN / "mypy"))  # files and strictness come from pyproject.toml
    assert out.returncode == 0, out.stdout + out.stderr
