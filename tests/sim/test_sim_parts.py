"""Simulator parts: cost models and their fit, the simulated engine, network, event loop, CLI."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from radixmesh.cli import main
from radixmesh.core.blocks import block_hashes
from radixmesh.core.prefix_cache import PrefixCache
from radixmesh.core.units import parse_duration as core_parse_duration
from radixmesh.sim import costs
from radixmesh.sim.clock import EventLoop
from radixmesh.sim.costfit import fit_prefill
from radixmesh.sim.engine import SimEngine, SimRun
from radixmesh.sim.network import (
    Network,
    NetworkConfig,
    PartitionWindow,
    parse_duration,
    parse_fault,
    parse_partition,
    parse_regions,
)


def test_cost_model_json_round_trip(tmp_path: Path) -> None:
    model = costs.resolve("gpu-7b")
    path = tmp_path / "m.json"
    path.write_text(model.to_json())
    assert costs.resolve(str(path)) == model
    data = json.loads(model.to_json())
    data["bogus"] = 1
    with pytest.raises(ValueError, match="bogus"):
        costs.CostModel.from_dict(data)
    with pytest.raises(ValueError):
        costs.CostModel.from_dict({**json.loads(model.to_json()), "decode_s_per_token": -1})


def test_fit_recovers_a_known_model() -> None:
    truth = costs.CostModel("t", 0.01, 3e-4, 2048.0, 0.01)
    rng = random.Random(0)
    points = []
    for length in (128, 512, 1024, 2048, 3072):
        for frac in (0.0, 0.5, 0.85):
            c = int(length * frac)
            noise = 1 + rng.uniform(-0.01, 0.01)
            points.append((length - c, c, truth.prefill_s(length - c, c) * noise))
    fit = fit_prefill(points)
    assert fit["prefill_s_per_token"] == pytest.approx(3e-4, rel=0.1)
    assert fit["prefill_overhead_s"] == pytest.approx(0.01, rel=0.3)
    assert fit["rel_rmse"] < 0.03


def _serve(eng: SimEngine, seq: int, tokens: list[int], out: list[int], now: float) -> SimRun:
    """Add one request and run the engine until it finishes; its measured run."""
    eng.add(seq, tokens, out, now)
    for _ in range(1000):
        planned = eng.plan(now, coalesce=True)
        assert planned is not None
        now += planned.duration_s
        done = eng.apply(planned, now)
        if done:
            return done[0][1]
    raise AssertionError("did not finish")


def test_sim_engine_budget_locks_and_hits() -> None:
    cost = costs.resolve("cpu-tiny")
    eng = SimEngine(cost, cache_tokens=100, block_size=4, seed=1)
    a = list(range(60))
    run = _serve(eng, 0, a, [7], 0.0)  # one request alone: the cost model's service time
    assert run.cached_tokens == 0 and run.service_s == pytest.approx(cost.service_s(60, 0, 1))
    assert run.decode_tokens == 1 and eng.match(a) == 60
    again = _serve(eng, 1, a, [7], 2.0)
    assert again.cached_tokens == 56  # whole blocks, never the last token
    assert set(eng.drain_delta()[0]) == set(block_hashes(a, 4, 1))
    b = [1000 + i for i in range(70)]  # does not fit beside a: a is evicted (LRU)
    _serve(eng, 2, b, [7], 4.0)
    assert eng.total_tokens <= 100 and eng.match(b) == 68 and eng.match(a) == 0
    added, removed = eng.drain_delta()  # exactly what changed since the previous drain
    assert set(added) == set(block_hashes(b, 4, 1))
    assert set(removed) == set(block_hashes(a, 4, 1))


def test_sim_engine_decode_runs_are_timed_as_their_steps() -> None:
    """A decode run lasts what its steps, timed one by one with the profile, would."""
    cost = costs.resolve("h100-llama3-8b")
    assert cost.profile is not None
    eng = SimEngine(cost, cache_tokens=1 << 16, block_size=16, seed=1)
    eng.add(0, list(range(100)), list(range(40)), 0.0)
    eng.add(1, list(range(200, 260)), list(range(20)), 0.0)
    first = eng.plan(0.0, coalesce=True)
    assert first is not None and first.step is not None and first.k == 1
    eng.apply(first, first.duration_s)
    run = eng.plan(first.duration_s, coalesce=True)
    assert run is not None and run.step is None and run.k == 19  # until request 1's last token
    by_step = sum(cost.profile.step_s(eng.sched.decode_step(j)) for j in range(run.k))
    assert run.duration_s == pytest.approx(by_step)
    assert eng.steps_by(run, 0.0) == 1 and eng.steps_by(run, run.duration_s) == run.k
    assert eng.steps_by(run, run.first_s * 1.5) == 2
    cut = eng.cut(run, 5)
    done = eng.apply(cut, 1.0)
    assert done == [] and eng.sched.steps == 6


def test_sim_engine_is_the_core_scheduler_plus_a_step_time_model() -> None:
    """Layering core <- sim: the simulator's cache is the engine's cache code, not a copy."""
    import ast

    import radixmesh.sim.engine as sim_engine

    tree = ast.parse(Path(sim_engine.__file__).read_text())
    modules = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(m.startswith("radixmesh.engine") for m in modules)
    assert "radixmesh.core.scheduler" in modules
    eng = SimEngine(costs.resolve("cpu-tiny"), cache_tokens=32, block_size=4, seed=1)
    assert isinstance(eng.cache, PrefixCache)
    with pytest.raises(ValueError, match="never fit"):
        eng.add(0, list(range(40)), [1], 0.0)
    a = list(range(28))
    _serve(eng, 1, a, [1, 2, 3], 0.0)  # prompt + 2 outputs: 30 tokens, 28 in whole blocks
    assert eng.total_tokens == eng.cache.usage().tokens == 28 and eng.match(a) == 28
    assert set(eng.drain_delta()[0]) == set(block_hashes(a, 4, 1))


def test_network_delay_loss_partition() -> None:
    net = Network(
        NetworkConfig(
            delay_s=0.01,
            jitter_s=0.002,
            loss=0.5,
            partitions=(PartitionWindow(1.0, 2.0, frozenset({0})),),
        ),
        3,
        random.Random(0),
    )
    delays = [net.delay(0, 1) for _ in range(200)]
    assert min(delays) >= 0.01 and max(delays) <= 0.012
    delivered = sum(bool(net.gossip_copies(1, 2, 0.0)) for _ in range(1000))
    assert 400 < delivered < 600
    assert net.partitioned(0, 1, 1.5) and not net.partitioned(1, 2, 1.5)
    assert not net.partitioned(0, 1, 2.5)
    regions = Network(
        NetworkConfig(regions=("us", "eu"), region_delay_s=((0.001, 0.04), (0.04, 0.001))),
        4,
        random.Random(0),
    )
    assert regions.delay(0, 2) == 0.001 and regions.delay(0, 1) == 0.04


def test_network_draws_exactly_as_before() -> None:
    """The simulator's fixed-seed output depends on these draws: jitter is one draw per delay
    (``base + jitter * random()``), loss one per gossip, and nothing when either is off or a
    partition already decided."""
    cfg = NetworkConfig(delay_s=0.01, jitter_s=0.002, loss=0.25,
                        partitions=(PartitionWindow(1.0, 2.0, frozenset({0})),))
    net, mirror = Network(cfg, 3, random.Random(9)), random.Random(9)
    assert net.delay(0, 1) == 0.01 + 0.002 * mirror.random()
    lost = mirror.random() < 0.25  # the loss draw, then (delivered) the delay's
    assert net.gossip_copies(1, 2, 0.0) == (() if lost else (0.01 + 0.002 * mirror.random(),))
    assert net.gossip_copies(0, 1, 1.5) == ()  # partitioned: no draw
    assert net.delay(1, 0) == 0.01 + 0.002 * mirror.random()
    quiet = Network(NetworkConfig(delay_s=0.01), 2, random.Random(9))
    state = quiet._rng.getstate()
    assert quiet.delay(0, 1) == 0.01 and quiet.gossip_copies(0, 1, 0.0) == (0.01,)
    assert quiet._rng.getstate() == state


def test_network_regions_and_config_checks() -> None:
    cfg = NetworkConfig(regions=("us", "eu", "ap"), jitter_s=0.001,
                        region_delay_s=((0.001, 0.04, 0.09), (0.04, 0.001, 0.12),
                                        (0.09, 0.12, 0.001)))
    net = Network(cfg, 6, random.Random(0))
    assert [net.region_of(i) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    assert net.base_delay(1, 5) == 0.12 and net.base_delay(3, 0) == 0.001
    assert 0.09 <= net.delay(2, 3) < 0.091
    for bad in (
        {"loss": 1.0},
        {"delay_s": -0.001},
        {"jitter_s": -1.0},
        {"regions": ("a", "b"), "region_delay_s": ((0.0, 0.1),)},
        {"regions": ("a",), "region_delay_s": ((-0.1,),)},
        {"region_delay_s": ((0.1,),)},  # a matrix without region names
    ):
        with pytest.raises(ValueError):
            NetworkConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        PartitionWindow(2.0, 1.0, frozenset({0}))
    with pytest.raises(ValueError):
        PartitionWindow(0.0, 1.0, frozenset())
    with pytest.raises(ValueError, match="outside"):
        Network(NetworkConfig(partitions=(PartitionWindow(0.0, 1.0, frozenset({5})),)), 3,
                random.Random(0))


def test_parsers() -> None:
    assert parse_duration("2ms") == pytest.approx(0.002) and parse_duration("1.5") == 1.5
    assert parse_partition("10s-20s:0-1,5").side == frozenset({0, 1, 5})
    f = parse_fault("2@5s:8s")
    assert (f.node, f.crash_s, f.restart_s) == (2, 5.0, 8.0)
    with pytest.raises(ValueError):
        parse_fault("2@8s:5s")
    with pytest.raises(ValueError):
        parse_duration("fast")
    assert parse_duration("1e-3s") == 0.001 and parse_duration("250µs") == pytest.approx(250e-6)
    assert parse_duration is core_parse_duration  # one grammar for the simulator and runtime
    assert parse_regions("us,eu", "1,40;40,1") == (("us", "eu"), ((0.001, 0.04), (0.04, 0.001)))


def test_event_loop_orders_by_time_then_schedule() -> None:
    loop = EventLoop()
    seen: list[str] = []
    loop.at(2.0, seen.append, "c")
    loop.at(1.0, seen.append, "a")
    loop.at(1.0, seen.append, "b")
    loop.at(5.0, seen.append, "late")
    loop.run(until=3.0)
    assert seen == ["a", "b", "c"] and loop.now == 3.0


def test_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    code = main(
        [
            "sim",
            "--nodes",
            "3",
            "--requests",
            "40",
            "--policy",
            "none,cost",
            "--synthetic-scale",
            "0.1",
            "--schedule",
            "sequential",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert [r["policy"] for r in runs] == ["none", "cost"]
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 80 and json.loads(lines[0])["run"] == "none"
    assert "cost" in capsys.readouterr().out


def test_cli_rejects_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--policy", "bogus", "--quiet"]) == 2
    assert "bogus" in capsys.readouterr().err
    assert main(["sim", "--shared-cores", "0", "--quiet"]) == 2
    assert "--shared-cores must be > 0" in capsys.readouterr().err
    assert main(["sim", "--shared-cores", "2", "--experiment", "scale", "--quiet"]) == 2
    assert "--shared-cores is for a sweep" in capsys.readouterr().err


def test_calibrate_from_records_recovers_the_simulated_model(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["sim", "--nodes", "2", "--requests", "60", "--policy", "none",
                 "--synthetic-scale", "0.2", "--schedule", "sequential", "--out", str(out),
                 "--quiet"]) == 0  # fmt: skip
    model_path = tmp_path / "cm.json"
    assert main(["calibrate", "--from-records", str(out / "requests.jsonl"),
                 "--out", str(model_path), "--quiet"]) == 0  # fmt: skip
    fitted = costs.CostModel.load(model_path)
    truth = costs.resolve("cpu-tiny")
    assert fitted.prefill_s_per_token == pytest.approx(truth.prefill_s_per_token, rel=0.05)
    assert fitted.prefill_overhead_s == pytest.approx(
        truth.prefill_overhead_s + truth.request_overhead_s, rel=0.05
    )


def test_validate_against_a_run_reproduces_it(tmp_path: Path) -> None:
    """Replaying a (simulated) bench-format run with the cost model fitted to it gives the
    same hit rates and latency ratios: the validation machinery itself adds no error."""
    flags = ["--nodes", "3", "--requests", "60", "--synthetic-scale", "0.2", "--schedule",
             "sequential", "--quiet"]  # fmt: skip
    # A model whose overhead sits in prefill, as a fit from client latencies puts it.
    model = replace(costs.resolve("cpu-tiny"), request_overhead_s=0.0, prefill_overhead_s=0.01)
    model_path = tmp_path / "model.json"
    model_path.write_text(model.to_json())
    real = tmp_path / "real"
    assert main(["sim", "--policy", "none,cost", "--out", str(real), "--cost-model",
                 str(model_path), *flags]) == 0  # fmt: skip
    out = tmp_path / "val"
    assert main(["sim", "--validate", str(real), "--out", str(out), "--forward-overhead", "2ms",
                 *flags]) == 0  # fmt: skip
    rows = json.loads((out / "validation.json").read_text())["rows"]
    assert [r["policy"] for r in rows] == ["none", "cost"]
    for r in rows:
        assert abs(r["hit_diff_points"]) < 0.01
        assert r["ratio_diff_pct"] is not None and abs(r["ratio_diff_pct"]) < 1.0
    assert "cost, uniform, 2 ms" in (out / "validation.md").read_text()


def test_scale_figures_without_a_none_baseline_draw_no_empty_ratio_plot(tmp_path: Path) -> None:
    """A scale run of one policy has nothing to divide by: the latency-ratio figure is left
    out (it would be empty) and no figure warns about a legend of nothing."""
    import warnings

    from radixmesh.sim import plots

    def row(policy: str, nodes: int) -> dict[str, object]:
        return {"policy": policy, "skew": "uniform", "nodes": nodes, "hotspot_share": 0.3,
                "mean_latency_s": 0.04, "p99_latency_s": 0.1}

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        only_cost = plots.plot_experiment("scale", [row("cost", 4), row("cost", 16)], tmp_path)
        assert [p.name for p in only_cost] == ["scale_hotspot.png"]
        both = [row(p, n) for p in ("none", "cost") for n in (4, 16)]
        paths = plots.plot_experiment("scale", both, tmp_path)
    assert [p.name for p in paths] == ["scale_latency_ratio.png", "scale_hotspot.png"]
    assert all(p.stat().st_size > 0 for p in paths)
