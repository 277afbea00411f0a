"""``sim --decisions``: each record carries its served node as its entry's router saw it, and
scripts/ttft-learn.py fits predictors on those records."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from radixmesh.cli import main

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ttft-learn.py"
SIM = ["sim", "--nodes", "4", "--profiles", "h100-llama3-8b", "--workload", "rag",
       "--requests", "300", "--load", "0.8", "--seed", "1", "--tokenizer", "bytes",
       "--policy", "cost", "--quiet"]


def _records(out: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]


def test_records_carry_the_served_node_as_the_router_saw_it_and_nothing_changes(
        tmp_path: Path) -> None:
    assert main([*SIM, "--decisions", "--out", str(tmp_path / "with")]) == 0
    assert main([*SIM, "--out", str(tmp_path / "without")]) == 0
    with_, without = _records(tmp_path / "with"), _records(tmp_path / "without")
    assert [r["ttft_s"] for r in with_] == [r["ttft_s"] for r in without]  # same routing
    assert all("considered" not in r for r in without)
    seen = [r for r in with_ if "considered" in r]
    assert len(seen) == len(with_)  # `cost` ranks every request
    for r in seen:
        c = r["considered"]
        assert isinstance(c, dict)
        assert c["node_id"] == r["served_by"]
        assert c["predicted_ttft_s"] == r["predicted_ttft_s"]
        assert c["is_self"] == (r["served_by"] == r["entry_node"])
        batch = c["batch"]  # an h100 profile batches: the batch the router priced
        assert isinstance(batch, dict) and batch["kv_tokens"] > 0


def test_ttft_learn_scores_the_forecast_as_the_records_do(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main([*SIM, "--decisions", "--out", str(out)]) == 0
    got = subprocess.run([sys.executable, str(SCRIPT), str(out), "--refit", "50"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line.split("|")[3:6]
            for line in got.splitlines() if line.startswith("| ") and "model" not in line}
    assert {m for m, _ in rows} == {"forecast", "route median", "ridge", "mlp"}
    measured = [r for r in _records(out) if not r["warmup"] and r["ttft_s"]]
    errors = [abs(float(r["predicted_ttft_s"]) - float(r["ttft_s"])) / float(r["ttft_s"])
              for r in measured]
    median, _, _ = (float(x) for x in rows[("forecast", "all")])
    assert abs(median - 100 * statistics.median(errors)) < 0.05 + 1e-9
    counted = next(line for line in got.splitlines() if line.startswith("| forecast | all"))
    assert int(counted.split("|")[-2]) == len(measured)


def test_ttft_learn_says_what_it_needs(tmp_path: Path) -> None:
    out = tmp_path / "plain"
    assert main([*SIM, "--out", str(out)]) == 0
    bad = subprocess.run([sys.executable, str(SCRIPT), str(out)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--decisions" in bad.stderr
