"""``report.md`` shows what was run and nothing else: no rows, sections, targets or figures
for configurations that did not run; a figure needs at least two points."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from radixmesh.bench.report import write_report
from radixmesh.results.run_summary import mean, percentile

Run = tuple[dict[str, Any], list[dict[str, Any]]]


def _run(policy: str, delay_ms: float, nodes: int, n: int, speed: float) -> Run:
    name = f"{policy}-uniform-d{delay_ms:g}ms-g200ms-c100000-n{nodes}"
    rng = random.Random(f"{name}")
    records, served = [], {f"n{i}": 0 for i in range(nodes)}
    for seq in range(n):
        node = f"n{seq % nodes}" if policy == "none" else f"n{(seq // 3) % nodes}"
        served[node] += 1
        latency = speed * (0.5 + rng.random())
        records.append({
            "run": name, "policy": policy, "seq": seq, "id": f"g{seq % 5}/{seq}",
            "group": f"g{seq % 5}", "entry": seq % nodes, "entry_node": f"n{seq % nodes}",
            "t_send": float(seq), "t_done": seq + latency, "latency_s": latency,
            "served_by": node, "route": "local", "expected_cached_tokens": 0,
            "cached_tokens": 50, "prompt_tokens": 100, "completion_tokens": 1,
            "server_timing": {"queue": 0.0, "service": latency}, "status": 200, "error": None,
            "output": "x", "finish_reason": "length"})
    lat = [r["latency_s"] for r in records]
    run = {
        "name": name, "policy": policy, "nodes": nodes, "workload": "synthetic",
        "skew": "uniform", "net_delay_ms": delay_ms, "gossip_interval_ms": 200.0,
        "cache_tokens": 100_000, "requests": n, "errors": 0, "mean_latency_s": mean(lat),
        "p50_latency_s": percentile(lat, 50), "p99_latency_s": percentile(lat, 99),
        "expected_hit_rate": 0.0 if policy == "none" else 0.4, "actual_hit_rate": 0.5,
        "ideal_hit_rate": 0.55, "hotspot_share": max(served.values()) / n,
        "forwarded_share": 0.0, "fallbacks": 0, "served_per_node": served,
        "group": "t1", "schedule": "sequential", "concurrency": 1, "batch": name, "seed": 0,
    }
    return run, records


def _folder(tmp: Path, runs: list[tuple[str, float, int, int, float]]) -> Path:
    summary, lines = [], []
    for spec in runs:
        run, recs = _run(*spec)
        summary.append(run)
        lines += [json.dumps(r) for r in recs]
    (tmp / "summary.json").write_text(json.dumps({"runs": summary}))
    (tmp / "requests.jsonl").write_text("\n".join(lines) + "\n")
    return tmp


def test_one_point_shows_only_its_rows_and_no_curve(tmp_path: Path) -> None:
    out = _folder(tmp_path, [("none", 2.0, 2, 40, 0.7), ("cost", 2.0, 2, 40, 0.4)])
    text = write_report(out).read_text()
    for absent in ("not run", "| 200ms |", "| 1s |", "skewed", "Memory pressure", "Open loop",
                   "served nothing", "oracle's gain", "sglang", "hotspot ≤", "actual hit ≥",
                   "fig2_latency_vs_comm", "fig3_share_over_time"):
        assert absent not in text, absent
    assert "| 2ms |" in text and "cost/none ≤ 0.90 (2ms)" in text  # what ran is there
    assert "| uniform, cost |" in text and "| uniform, paper |" not in text
    assert not (out / "fig2_latency_vs_comm.png").exists()
    assert not (out / "fig3_share_over_time.png").exists()  # 40 requests: under two windows
    assert (out / "fig_hit_rates.png").exists() and "fig_hit_rates.png" in text
    above = text.split("## All runs")[0]
    assert "—; —" not in above  # no column of a policy that did not run
    assert "paper (s)" not in text and "cost (s)" in text


def test_two_delays_draw_the_curve_and_four_nodes_judge_the_hotspot(tmp_path: Path) -> None:
    out = _folder(tmp_path, [("none", 2.0, 4, 120, 0.7), ("cost", 2.0, 4, 120, 0.4),
                             ("cost", 200.0, 4, 120, 0.6)])
    text = write_report(out).read_text()
    assert "| 2ms |" in text and "| 200ms |" in text and "| 1s |" not in text
    assert (out / "fig2_latency_vs_comm.png").read_bytes()[:4] == b"\x89PNG"
    assert "fig2_latency_vs_comm.png" in text
    assert (out / "fig3_share_over_time.png").exists()  # 120 requests: several windows
    assert "hotspot ≤ 35%" in text  # 4 nodes: a 35 % share is reachable, so it is judged
    assert "actual hit ≥" not in text  # this sequence's ceiling (55 %) is below the target


def test_a_summary_from_before_the_rename_reads_as_today(tmp_path: Path) -> None:
    """``comm_delay_ms`` became ``net_delay_ms`` with ``--net-delay``: an old folder gives
    the same report, and its runs read with the new key."""
    from radixmesh.results.run_summary import load_summary

    (tmp_path / "new").mkdir(), (tmp_path / "old").mkdir()
    new = _folder(tmp_path / "new", [("none", 2.0, 2, 40, 0.7), ("cost", 2.0, 2, 40, 0.4)])
    old = _folder(tmp_path / "old", [("none", 2.0, 2, 40, 0.7), ("cost", 2.0, 2, 40, 0.4)])
    summary = json.loads((old / "summary.json").read_text())
    for run in summary["runs"]:
        run["comm_delay_ms"] = run.pop("net_delay_ms")
    (old / "summary.json").write_text(json.dumps(summary))
    assert [r["net_delay_ms"] for r in load_summary(old / "summary.json")["runs"]] == [2.0, 2.0]
    assert "comm_delay_ms" not in load_summary(old / "summary.json")["runs"][0]
    assert write_report(old).read_text() == write_report(new).read_text()


def test_a_pressure_batch_alone_is_reported_as_pressure_with_its_figure(tmp_path: Path) -> None:
    out = _folder(tmp_path, [("none", 2.0, 4, 400, 0.7), ("cost", 2.0, 4, 400, 0.4),
                             ("paper", 2.0, 4, 400, 0.6)])
    summary = json.loads((out / "summary.json").read_text())
    for run in summary["runs"]:  # as `bench --sweep paper --only pressure` writes them
        run["group"], run["cache_tokens"] = "pressure", 20_000
    (out / "summary.json").write_text(json.dumps(summary))
    text = write_report(out).read_text()
    above = text.split("## All runs")[0]
    assert "cost/none ≤ 0.60 under memory pressure" in above and "## Memory pressure" in above
    for absent in ("cost/none ≤ 0.90", "Table 1", "hotspot ≤"):  # not the abundant point's
        assert absent not in above, absent
    assert (out / "fig4_specialization_eviction.png").read_bytes()[:4] == b"\x89PNG"


def test_second_copies_are_judged_on_the_measured_requests_tags(tmp_path: Path) -> None:
    """The nodes' counters also count the warm-up prompts (one per node, sharing a short
    header, so the later ones are second copies of it); the target is judged on the tags the
    measured requests carry, and falls back to the counters only for untagged records."""
    run, recs = _run("cost", 2.0, 4, 40, 0.4)
    base, base_recs = _run("none", 2.0, 4, 40, 0.7)
    run["placements"] = {"hit": 30.0, "first": 11.0, "second_copy": 3.0}  # 4 warm-ups in

    def report(name: str) -> str:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "summary.json").write_text(json.dumps({"runs": [base, run]}))
        lines = [json.dumps(r) for r in base_recs + recs]
        (folder / "requests.jsonl").write_text("\n".join(lines) + "\n")
        return write_report(folder).read_text()

    for i, r in enumerate(recs):
        r["placement"] = "first" if i < 10 else "hit"
    assert ("0 accidental second cold copies (cost, uniform 2 ms; tags of the measured "
            "requests) | second copies 0, deliberate replicas 0 of 40 placed | **met**"
            ) in report("tagged")
    for r in recs:
        del r["placement"]
    assert ("(cost, uniform 2 ms; router's counters, warm-ups included) | second copies 3, "
            "deliberate replicas 0 of 44 placed | **missed**") in report("untagged")


def test_ttft_cdf_only_for_open_loop_runs_with_ttfts(tmp_path: Path) -> None:
    out = _folder(tmp_path, [("none", 2.0, 2, 40, 0.7), ("cost", 2.0, 2, 40, 0.4)])
    assert "fig_ttft_cdf.png" not in write_report(out).read_text()  # sequential: no CDF
    summary = json.loads((out / "summary.json").read_text())
    for run in summary["runs"]:
        run["schedule"] = "bursty"
    (out / "summary.json").write_text(json.dumps(summary))
    recs = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    for r in recs:
        r["ttft_s"] = r["latency_s"] / 2
    (out / "requests.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    assert "fig_ttft_cdf.png" in write_report(out).read_text()
    assert (out / "fig_ttft_cdf.png").exists()
