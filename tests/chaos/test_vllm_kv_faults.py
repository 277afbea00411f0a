"""The KV-event faults on a real vLLM (``chaos/kv_socket.py``, ``make vllm-kv-faults``): a short
run of every phase, when vLLM's own venv is here (``RADIXMESH_VLLM_PYTHON`` or
``.venv-vllm/bin/python``); CI has none and skips it. Every mismatch must be explained (a loss
the node could not yet see, or the burst beyond the replay buffer under-reporting): 0 index
errors; after each phase the index is the fault-free reference's size, or smaller where the
replay could not cover a gap (the burst), never larger."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from radixmesh.chaos.kv_socket import classify, main

VLLM_PYTHON = os.environ.get("RADIXMESH_VLLM_PYTHON", ".venv-vllm/bin/python")


def test_a_mismatch_is_explained_or_an_index_error() -> None:
    assert classify("drop", 256, 256, hidden=False) == "match"
    assert classify("drop", 0, 256, hidden=True) == "unseen"
    assert classify("burst", 0, 256, hidden=False) == "beyond_buffer"
    assert classify("burst", 384, 256, hidden=False) == "index_error"  # over: never excused
    assert classify("stale", 0, 256, hidden=False) == "index_error"
    # the engine's own stream explains it (cache changed after acceptance): timing, not index
    assert classify("stale", 1408, 128, hidden=False, timing="evicted") == "timing"
    assert classify("stale", 1408, 128, hidden=False, timing="index_error") == "index_error"


@pytest.mark.slow
@pytest.mark.skipif(not Path(VLLM_PYTHON).exists(), reason="no vLLM venv (make vllm-kv-faults)")
def test_real_vllm_behind_the_fault_proxy_has_no_index_error(tmp_path: Path) -> None:
    assert main(["--vllm-python", VLLM_PYTHON, "--out", str(tmp_path), "--requests", "6"]) == 0
    doc = json.loads((tmp_path / "vllm_kv_faults.json").read_text())
    for phase in doc["phases"]:
        assert phase["index_error"] == phase["error"] == 0, phase
        assert phase["flush_requests"] > 0, phase
        assert phase["index_blocks"] <= phase["reference_blocks"], phase  # never over
        if not phase["node"]["resets"]:  # replayed, or nothing lost: exact
            assert phase["index_blocks"] == phase["reference_blocks"], phase
