"""The ``radixmesh`` console script: --version and the core micro-benchmark's JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from radixmesh import __version__

BIN = Path(sys.executable).parent / "radixmesh"


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    cmd = [str(BIN)] if BIN.exists() else [sys.executable, "-m", "radixmesh.cli"]
    return subprocess.run(
        [*cmd, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_version() -> None:
    out = _cli("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"radixmesh {__version__}"


def test_microbench_core_json() -> None:
    out = _cli("microbench", "--json", "--only", "core", "--quick")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    for key in ("hash_p50_us", "radix_match_p50_us", "radix_insert_p50_us"):
        assert isinstance(data[key], float) and data[key] > 0
    for key in ("route_p50_us", "route_p99_us"):
        assert set(data[key]) == {"4", "64", "1024"}
        assert all(v > 0 for v in data[key].values())
    assert all(data["route_p99_us"][k] >= data["route_p50_us"][k] for k in ("4", "64", "1024"))


def test_unknown_command_fails() -> None:
    out = _cli("no-such-command")
    assert out.returncode != 0
