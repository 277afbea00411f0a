"""The bench's emulated-GPU mesh: profiles dealt to nodes, each node's engine options, time
scale applied to the node's intervals and undone on the records."""

from __future__ import annotations

import pytest

from radixmesh.bench.emulated import context_length, parse_profiles
from radixmesh.bench.launcher import per_node_options, serve_options
from radixmesh.bench.replay import unscale
from radixmesh.bench.spec import RunSpec
from radixmesh.results.records import Record
from radixmesh.runtime.metrics import parse_samples, sample_sum


def test_profiles_with_counts_are_dealt_in_order() -> None:
    assert parse_profiles("h100-llama3-8b:1,a10g-llama3-8b:2", 3) == [
        "h100-llama3-8b", "a10g-llama3-8b", "a10g-llama3-8b"]
    assert parse_profiles("a100-llama3-8b", 4) == ["a100-llama3-8b"] * 4


@pytest.mark.parametrize(("text", "nodes", "says"), [
    ("h100-llama3-8b:2", 3, "add up to 2 engines for 3 nodes"),
    ("h100-llama3-8b:0", 0, "COUNT >= 1"),
    ("nonesuch:2", 2, "nonesuch"),
    ("", 2, "at least one profile"),
    ("h100-llama3-8b:1,h100-qwen2.5-0.5b:1", 2, "different models"),
])
def test_bad_profile_lists_are_refused_naming_what_is_wrong(text: str, nodes: int,
                                                            says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_profiles(text, nodes)


def test_an_emulated_run_needs_profiles_and_no_builtin_time_scale() -> None:
    with pytest.raises(ValueError, match="--profiles"):
        RunSpec(name="r", policy="cost", engine="emulated")
    with pytest.raises(ValueError, match="time-scale"):
        RunSpec(name="r", policy="cost", time_scale=4.0)
    # the oracle runs on emulated engines too: it shadows each engine's scheduler
    RunSpec(name="r", policy="oracle", engine="emulated", profiles="h100-llama3-8b")


def test_each_node_fronts_its_own_engine_at_the_stretched_time_scale() -> None:
    spec = RunSpec(name="r", policy="cost", nodes=2, engine="emulated", time_scale=10.0,
                   profiles="h100-llama3-8b:1,a10g-llama3-8b:1", net_delay_s=0.001,
                   gossip_interval_s=0.5)
    opts = serve_options(spec)
    assert opts["gossip_interval"] == pytest.approx(5.0)
    assert opts["net_delay"] == pytest.approx(0.01)
    assert per_node_options(spec)[1]["profile"] == "a10g-llama3-8b"  # the node's shadow's
    assert per_node_options(spec)[1]["profile_time_scale"] == 10.0
    assert "preset" not in opts and "threads" not in opts  # no built-in engine
    per = per_node_options(spec)
    assert per[0]["engine"] == per[1]["engine"] == "vllm"
    assert "--profile a10g-llama3-8b" in str(per[1]["launch"])
    assert "--time-scale 10" in str(per[0]["launch"])
    ports = {per[i]["engine_url"] for i in (0, 1)}
    assert len(ports) == 2  # one engine per node
    assert context_length(spec.node_profiles) == 32_768  # the A10G profile: --max-model-len


def test_records_of_a_stretched_run_come_back_in_unscaled_time() -> None:
    rec = Record(run="r", policy="cost", seq=0, id="x", group=None, entry=0, entry_node="n0",
                 t_send=20.0, t_done=30.0, latency_s=10.0, ttft_s=2.0, tpot_s=0.1,
                 server_timing={"service": 5.0})
    unscale(rec, 10.0)
    assert (rec.t_send, rec.t_done, rec.latency_s) == pytest.approx((2.0, 3.0, 1.0))
    assert (rec.ttft_s, rec.tpot_s, rec.server_timing["service"]) == pytest.approx(
        (0.2, 0.01, 0.5))


def _counter(text: str, name: str) -> float:
    """What bench/after_run.py reads of an engine's ``/metrics`` page."""
    return sample_sum(parse_samples(text), name)


def test_lag_counters_are_read_from_prometheus_text() -> None:
    text = ("# TYPE emulator_lag_seconds_total counter\n"
            'emulator_lag_seconds_total{profile="h100"} 1.5\n'
            "emulator_busy_seconds_total 30\n")
    assert _counter(text, "emulator_lag_seconds_total") == 1.5
    assert _counter(text, "emulator_busy_seconds_total") == 30.0
    assert _counter(text, "emulator_steps_total") == 0.0
