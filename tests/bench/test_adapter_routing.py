"""bench/adapter_routing.py's harness runs when each adapter has a single holder (as many nodes
as adapters): its setup waited for every node to know every adapter from its *peers*, which
never happens there (a node's own adapter is served by no peer), and timed out at --nodes 4."""

from __future__ import annotations

import json

import pytest

from radixmesh.bench.adapter_routing import main


def test_one_holder_per_adapter_sets_up_and_serves_every_request(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--nodes", "2", "--adapters", "2", "--requests", "4", "--concurrency", "2",
                 "--system-chars", "300", "--time-scale", "1"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["routing"] for r in rows] == ["aware", "blind"]
    assert all(r["requests"] == 4 and r["nodes"] == 2 for r in rows)
    assert rows[0]["adapter_loads"] == 0  # aware: each request ran where its adapter lives
