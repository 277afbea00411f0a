"""Per-node load over time and the run's processes' CPU use (bench/usage.py)."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixmesh.bench import usage
from radixmesh.results.records import Record


def rec(node: str | None, t_send: float, t_done: float) -> Record:
    return Record(run="r", policy="none", seq=0, id="x", group=None, entry=0, entry_node="n0",
                  t_send=t_send, t_done=t_done, served_by=node)  # fmt: skip


spans = st.lists(st.tuples(st.sampled_from(["n0", "n1", "n2"]),
                           st.floats(0, 100), st.floats(0.01, 50)), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(spans)
def test_the_windows_hold_every_request_second_and_every_answer(
        got: list[tuple[str, float, float]]) -> None:
    records = [rec(n, a, a + d) for n, a, d in got]
    width, rows = usage.load_over_time(records, ["n0", "n1", "n2"], windows=7)
    for node in ("n0", "n1", "n2"):
        mine = [r for r in rows if r[1] == node]
        assert len(mine) == 7
        busy = sum(x for _, _, x, _ in mine) * width  # in flight x window = busy seconds
        want = sum(d for n, _, d in got if n == node)
        assert busy == pytest.approx(want, rel=1e-6, abs=1e-6)
        assert sum(k for *_, k in mine) == sum(1 for n, *_ in got if n == node)


def test_a_node_serving_two_at_once_shows_two_in_flight(tmp_path: Path) -> None:
    records = [rec("n0", 0.0, 10.0), rec("n0", 0.0, 10.0), rec("n1", 5.0, 10.0),
               rec(None, 0.0, 10.0)]  # a failed request: served by nobody, not counted
    width, rows = usage.load_over_time(records, ["n0", "n1"], windows=2)
    assert width == 5.0
    assert rows == [(0.0, "n0", 2.0, 0), (0.0, "n1", 0.0, 0),
                    (5.0, "n0", 2.0, 2), (5.0, "n1", 1.0, 1)]
    info = usage.write_load(tmp_path / "load" / "r.csv", records, ["n0", "n1"])
    assert info is not None and info["peak_in_flight"] == {"n0": 2.0, "n1": 1.0}
    with (tmp_path / "load" / "r.csv").open() as fh:
        lines = list(csv.DictReader(fh))
    assert len(lines) == usage.WINDOWS * 2 and lines[0].keys() == {"t_s", "node", "in_flight",
                                                                   "served"}
    assert usage.write_load(tmp_path / "none.csv", [], ["n0"]) is None


def _stat(root: Path, pid: int, ppid: int, utime: int, stime: int) -> None:
    (root / str(pid)).mkdir(exist_ok=True)
    rest = ["S", str(ppid)] + ["0"] * 9 + [str(utime), str(stime)] + ["0"] * 10
    (root / str(pid) / "stat").write_text(f"{pid} (python -m x) " + " ".join(rest) + "\n")


def test_cpu_of_nodes_their_engines_and_the_gateway(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    tick = os.sysconf("SC_CLK_TCK")
    monkeypatch.setattr(usage, "PROC", tmp_path)
    _stat(tmp_path, 10, 1, 100, 0)  # node n0
    _stat(tmp_path, 11, 10, 0, 0)  # its emulated engine
    _stat(tmp_path, 20, 1, 5, 5)  # the gateway
    meter = usage.CpuMeter({"n0": 10, "gateway": 20, "relay": None})
    meter.start()
    _stat(tmp_path, 10, 1, 100 + 2 * tick, tick)  # 3 s of node CPU
    _stat(tmp_path, 11, 10, 4 * tick, 0)  # 4 s of engine CPU
    _stat(tmp_path, 20, 1, 5 + tick, 5)  # 1 s of gateway CPU
    got = meter.stop()
    assert got is not None
    assert got["cpu_s"] == {"gateway": 1.0, "n0": 3.0, "n0/children": 4.0}
    assert {k: v["cpu_s"] for k, v in got["by_kind"].items()} == {
        "children": 4.0, "gateway": 1.0, "nodes": 3.0}
    assert usage.cpu_seconds(99) is None  # gone
    assert usage.CpuMeter({"n0": None}).stop() is None  # never started
