"""scripts/dump-decisions.py: it wraps the router without changing what it decides."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from radixmesh.cli import main

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "dump-decisions.py"
SIM = ["sim", "--nodes", "2", "--requests", "40", "--seed", "3"]


def _summary(out: Path) -> dict[str, object]:
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert len(runs) == 1
    return dict(runs[0])


def test_the_dump_shows_the_decisions_asked_for_and_changes_no_result(tmp_path: Path) -> None:
    dumped = subprocess.run(
        [sys.executable, str(SCRIPT), "--tag", "all", "--limit", "3", "--",
         *SIM, "--out", str(tmp_path / "dumped")],
        capture_output=True, text=True, timeout=120, check=True,
    )
    assert main([*SIM, "--out", str(tmp_path / "plain")]) == 0

    blocks = re.findall(r"^--- (n\d) request (\d+)(?: \(re-ranked\))? at [\d.]+: (\d+) prompt "
                        r"tokens, owners (\S+), held at \S+ tokens -> (n\d) \((\w+)\)$",
                        dumped.stderr, re.M)
    assert len(blocks) == 3  # --limit
    candidates = re.findall(r"^ +\d+ n\d[* ] cached +\d+ +queue", dumped.stderr, re.M)
    assert len(candidates) == 3 * 2  # every candidate of a 2-node mesh, each decision
    tally = re.search(r"^decisions by placement tag: (.*)$", dumped.stderr, re.M)
    assert tally is not None
    counts = {k: int(v) for k, v in (p.split(": ") for p in tally.group(1).split(", "))}
    assert sum(counts.values()) >= 40  # one per request, more where a refusal re-routes it

    # the wrapped router decided exactly as the plain one: same placements, same latencies
    a, b = _summary(tmp_path / "dumped"), _summary(tmp_path / "plain")
    assert a["request_placements"] == b["request_placements"]
    assert a["mean_latency_s"] == b["mean_latency_s"]
    placements = a["request_placements"]
    assert isinstance(placements, dict) and sum(placements.values()) == 40


def test_an_unknown_tag_is_refused(tmp_path: Path) -> None:
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), "--tag", "bogus", "--", *SIM, "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )
    assert bad.returncode == 2
    assert "unknown tag(s) ['bogus']" in bad.stderr
