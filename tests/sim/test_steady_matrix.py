"""scripts/steady-matrix.py's sustained load: where goodput first falls below the target."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "steady-matrix.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("steady_matrix", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sustained_load_interpolates_the_first_crossing() -> None:
    sustained = _script().sustained
    curve = [(0.8, 1.0), (1.5, 0.95), (2.0, 0.85), (3.0, 0.95)]  # a dip, then recovery
    assert sustained(curve, 0.9) == pytest.approx(1.75)  # halfway from 0.95 to 0.85
    assert sustained([(0.8, 1.0), (4.0, 0.995)], 0.9) == 4.0  # never missed: a lower bound
    assert sustained([(0.8, 0.25), (1.0, 1.0)], 0.9) is None  # missed at the lowest load
    assert sustained([], 0.9) is None


def test_the_table_gives_each_policy_its_ratio_to_the_gateway() -> None:
    curves = {("mixed-16", "rag"): {"cost": [(1.0, 1.0), (2.0, 1.0)],
                                    "cache_aware": [(1.0, 1.0), (2.0, 0.8)]}}
    table = _script().sustained_table(curves, 0.9)
    cost = next(row for row in table if "| cost |" in row)
    gate = next(row for row in table if "| cache_aware |" in row)
    assert "| >= 2.00 | 1.33 |" in cost  # 2.0 (never missed) / 1.5
    assert "| 1.50 | 1.00 |" in gate
