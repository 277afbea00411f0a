"""The router's predicted TTFT for the node that served each request, against the TTFT met:
carried by the core's actions, recorded by the simulator, summarized once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixmesh.cli import main
from radixmesh.results.run_summary import prediction_errors


def test_prediction_errors_is_relative_to_the_actual_time() -> None:
    e = prediction_errors([(1.0, 1.0), (1.5, 1.0), (1.0, 2.0), (3.0, 0.0)])
    assert e["n"] == 3  # an actual time of 0 has no relative error
    assert e["abs_p50"] == pytest.approx(0.5)
    assert e["abs_p90"] == pytest.approx(0.5)
    assert e["abs_mean"] == pytest.approx(1.0 / 3.0)
    assert e["signed_mean"] == pytest.approx(0.0)
    assert prediction_errors([]) == {"n": 0, "abs_p50": None, "abs_p90": None,
                                     "abs_mean": None, "signed_mean": None}


def test_the_simulator_records_and_summarizes_the_routers_prediction(tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = main(["sim", "--nodes", "4", "--profiles", "h100-llama3-8b", "--workload", "rag",
                 "--requests", "40", "--schedule", "sequential", "--policy", "cost",
                 "--out", str(out), "--quiet"])
    assert code == 0
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    served = [r for r in records if r["ttft_s"] is not None]
    assert served and all(r["predicted_ttft_s"] > 0 for r in served)
    local = [r for r in served if r["route"] == "local"]
    assert local and len(local) < len(served)  # both routes are exercised
    err = json.loads((out / "summary.json").read_text())["runs"][0]["sim"]
    err = err["ttft_prediction_error"]
    assert err["all"]["n"] == len(served)
    assert err["local"]["n"] == len(local)
    assert err["forwarded"]["n"] == len(served) - len(local)
    # one request at a time an engine's own state is exact: its prediction is the profile's
    # time (but for the cached prefix estimated by blocks); a peer's adds a learned round trip
    assert err["local"]["abs_p50"] < 0.02
    assert err["forwarded"]["abs_p50"] < 0.25
