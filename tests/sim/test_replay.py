"""Mixed hardware in the simulator and ``sim --validate`` replaying an emulated run's trace.

The recorded run folder is a fixture made by the simulator itself (a real emulated mesh needs
32 processes): a simulated run written in the bench's format, marked ``engine: emulated``.
Replaying a run's own records into the same mesh must then give back that run's figures — the
replay adds nothing of its own (no regenerated times, entries or output lengths).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import pytest

from radixmesh.core.config import GossipConfig
from radixmesh.core.router import Policy, RouterConfig
from radixmesh.sim import replay
from radixmesh.sim.network import NetworkConfig, parse_regions
from radixmesh.sim.runner import SimSpec, run
from radixmesh.sim.shell import ClusterConfig, SimCluster
from radixmesh.sim.sweep import batched_rate, cluster_cost, profile_costs
from radixmesh.sim.tokens import byte_tokenize
from radixmesh.workload import schedule
from radixmesh.workload.build import corpus_for, generate
from radixmesh.workload.schedule import bursty

MIX = "h100-llama3-8b:1,a10g-llama3-8b:2"
REGIONS = ("us,eu", "1,40;40,1")


def test_profiles_are_dealt_in_order_and_each_node_gets_its_own_engine() -> None:
    node_costs = profile_costs(MIX, 3)
    assert [c.name for c in node_costs] == ["profile:h100-llama3-8b"] + [
        "profile:a10g-llama3-8b"
    ] * 2
    cfg = ClusterConfig(nodes=3, cost=cluster_cost(argparse.Namespace(profiles=MIX), node_costs),
                        node_costs=node_costs)  # fmt: skip
    cluster = SimCluster(cfg)
    cluster.start()
    cluster.loop.run(until=0.1)
    pools = [n.engine.sched.config.kv_blocks for n in cluster.nodes if n.engine is not None]
    assert pools == [29205, 2192, 2192]  # each profile's own KV pool
    with pytest.raises(ValueError, match="counts add up"):
        profile_costs(MIX, 4)


def test_an_h100_sustains_several_times_an_a10gs_rate() -> None:
    h100, a10g = (c.profile for c in profile_costs(MIX, 3)[:2])
    assert h100 is not None and a10g is not None
    assert batched_rate(h100, 2000, 1700, 64) > 3 * batched_rate(a10g, 2000, 1700, 64)


def test_bursty_arrivals_offer_the_rate_with_the_asked_spread() -> None:
    reqs = generate("rag", 2000, 0, corpus_for(None), 0.2)
    timed = bursty(reqs, 4, 10.0, 3.0, 0)
    times = [r.t or 0.0 for r in timed]
    assert times == sorted(times) and times[-1] == pytest.approx(1999 / 10.0)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    mean = sum(gaps) / len(gaps)
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert 2.0 < cv < 4.0  # Poisson would be ~1


def _recorded_folder(tmp: Path, regions: bool, warm: int = 0) -> Path:
    """A simulated run in the bench's output format, marked as an emulated mesh's (its first
    ``warm`` requests left out of its figures, as ``--exclude-warmup``)."""
    reqs = schedule.poisson(generate("rag", 60, 3, corpus_for(None), 0.3), 3, 40.0, 3)
    node_costs = profile_costs(MIX, 3)
    names, matrix = parse_regions(*REGIONS) if regions else ((), ())
    tokenize, tok_fp = byte_tokenize()
    runs, lines = [], []
    for policy in ("none", "cost"):
        cfg = ClusterConfig(
            nodes=3, cost=cluster_cost(argparse.Namespace(profiles=MIX), node_costs),
            node_costs=node_costs, router=RouterConfig(policy=Policy.parse(policy)),
            network=NetworkConfig(delay_s=0.002, regions=names, region_delay_s=matrix), seed=3,
            tokenizer=tok_fp,
        )  # fmt: skip
        res = run(SimSpec(policy, cfg, "rag", "uniform", "poisson", excluded=(warm, 0.0)), reqs,
                  tokenize)
        runs.append(res.summary | {
            "engine": "emulated", "profiles": MIX, "workload_kind": "rag", "seed": 3,
            "planned_requests": 60,
            **({"regions": REGIONS[0], "region_delays": REGIONS[1]} if regions else {}),
        })  # fmt: skip
        lines += [json.dumps(r.to_json()) for r in res.records]
    (tmp / "summary.json").write_text(json.dumps({"runs": runs}))
    (tmp / "requests.jsonl").write_text("\n".join(lines) + "\n")
    return tmp


def _args(folder: Path, out: Path) -> argparse.Namespace:
    return argparse.Namespace(validate=str(folder), out=str(out), trace=None, mmlu_dir=None,
                              synthetic_scale=0.3, synthetic_groups=57, regions="",
                              region_delays="")  # fmt: skip


@pytest.mark.parametrize("regions", [False, True])
def test_replaying_a_runs_own_trace_gives_back_its_figures(tmp_path: Path, regions: bool) -> None:
    folder = _recorded_folder(tmp_path, regions)
    assert replay.is_emulated(folder)
    assert replay.main(_args(folder, tmp_path / "out")) == 0
    rows = json.loads((tmp_path / "out" / "validation.json").read_text())["rows"]
    assert [r["policy"] for r in rows] == ["none", "cost"]
    for r in rows:
        assert r["hit_diff_points"] == pytest.approx(0.0, abs=1.0)
        assert r["sim_mean_ttft_s"] == pytest.approx(r["real_mean_ttft_s"], rel=0.05)
        assert r["sim_p99_ratio"] == pytest.approx(r["real_p99_ratio"], rel=0.05)
    assert "| cost |" in (tmp_path / "out" / "validation.md").read_text()


def test_the_replay_writes_its_records_and_with_decisions_what_each_router_saw(
    tmp_path: Path,
) -> None:
    """``requests.jsonl`` beside the comparison: the same requests as the run's, routed by
    the simulator; with ``--decisions`` each carries the node that served it as its entry
    node's router saw it (what ``scripts/why.py``-style reading and ``ttft-learn.py`` need)."""
    folder = _recorded_folder(tmp_path, False)
    args = _args(folder, tmp_path / "out")
    args.decisions = True
    assert replay.main(args) == 0
    real = [json.loads(line) for line in (folder / "requests.jsonl").read_text().splitlines()]
    out = (tmp_path / "out" / "requests.jsonl").read_text().splitlines()
    replayed = [json.loads(line) for line in out]
    def ids(rows: list[dict[str, str]]) -> list[tuple[str, str]]:
        return sorted((r["run"], r["id"]) for r in rows)

    assert ids(replayed) == ids(real)
    served = [r for r in replayed if r["policy"] == "cost" and r["status"] == 200]
    assert served and all(r["considered"]["node_id"] == r["served_by"] for r in served)
    args.no_records, args.out = True, str(tmp_path / "bare")
    assert replay.main(args) == 0 and not (tmp_path / "bare" / "requests.jsonl").exists()


def test_a_runs_warm_up_is_left_out_of_the_replays_figures_too(tmp_path: Path) -> None:
    """The records flagged ``warmup`` are replayed (they warm the caches) but not counted, as
    in the real run: counted, the replay's hit rate kept the cold start (4 emulated RAG
    nodes: 6-7 points under the real run's for every policy)."""
    folder = _recorded_folder(tmp_path, False, warm=15)
    records = [json.loads(line) for line in (folder / "requests.jsonl").read_text().splitlines()]
    assert sum(bool(r.get("warmup")) for r in records) == 30  # 15 in each of the two runs
    assert replay.main(_args(folder, tmp_path / "out")) == 0
    rows = json.loads((tmp_path / "out" / "validation.json").read_text())["rows"]
    for r in rows:
        assert r["requests"] == 45
        assert r["hit_diff_points"] == pytest.approx(0.0, abs=1.0)
        assert r["sim_mean_ttft_s"] == pytest.approx(r["real_mean_ttft_s"], rel=0.05)


def test_a_scaled_runs_forwards_cost_its_http_work_divided_by_the_scale() -> None:
    """At time scale S the real hop's HTTP work ran on the wall clock: 1/S of the run's time."""
    real = {"nodes": 3, "profiles": MIX, "policy": "cost", "net_delay_ms": 2.0}
    args = argparse.Namespace(regions="", region_delays="")
    plain = replay.cluster_like(real, args, "bytes").cost.forward_overhead_s
    scaled = replay.cluster_like(real | {"time_scale": 50.0}, args, "bytes").cost
    assert plain > 0 and scaled.forward_overhead_s == pytest.approx(plain / 50)


def test_the_replay_gossips_at_the_runs_rhythm() -> None:
    """A run's interval and announcement gap (unscaled; ``null``: none) are the replay's; a run
    summary without them (an older one) gets the defaults its nodes ran."""
    real = {"nodes": 3, "profiles": MIX, "policy": "cost", "net_delay_ms": 2.0}
    args = argparse.Namespace(regions="", region_delays="")
    tuned = replay.cluster_like(real | {"gossip_interval_ms": 50.0, "gossip_announce_ms": 10.0},
                                args, "bytes").gossip  # fmt: skip
    assert tuned.interval_s == pytest.approx(0.05) and tuned.announce_gap_s == pytest.approx(0.01)
    off = replay.cluster_like(real | {"gossip_announce_ms": None}, args, "bytes").gossip
    assert off.announce_gap_s is None and off.interval_s == GossipConfig().interval_s
    assert replay.cluster_like(real, args, "bytes").gossip == GossipConfig()


def test_a_record_the_workload_lacks_is_refused_by_id(tmp_path: Path) -> None:
    folder = _recorded_folder(tmp_path, False)
    path = folder / "requests.jsonl"
    lines = path.read_text().splitlines()
    rec = json.loads(lines[0]) | {"id": "not-in-the-workload"}
    path.write_text("\n".join([json.dumps(rec), *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match="not-in-the-workload"):
        replay.main(_args(folder, tmp_path / "out"))


def test_the_regime_tables_give_ratios_to_none_and_their_geometric_mean() -> None:
    from radixmesh.sim.regimes import REGIMES, _row, condensed, markdown

    regime = REGIMES[1]
    none = {"policy": "none", "requests": 10, "errors": 0, "mean_ttft_s": 0.4,
            "p99_ttft_s": 2.0, "mean_tpot_s": 0.02, "goodput": 0.5, "actual_hit_rate": 0.5}
    rows = []
    for i, (mean, p99) in enumerate(((0.1, 1.0), (0.4, 4.0))):
        cost = none | {"policy": "cost", "mean_ttft_s": mean, "p99_ttft_s": p99}
        rows += [_row(regime, "rag", 0.8, "poisson" if i else "bursty", s, none)
                 for s in (none, cost)]  # fmt: skip
    assert [r["mean_ratio"] for r in rows] == [1.0, 0.25, 1.0, 1.0]
    assert "| mixed-16 | cost | 2 | 0.50 (1.00) | 1.00 (2.00) | 50.0 | 50.0 |" in condensed(rows)
    assert "### mixed-16 (simulated)" in markdown(rows)
