"""The pure parts of ``make vllm-check`` (the run itself needs vLLM: not in CI)."""

from __future__ import annotations

import json

from radixmesh.bench.vllm_check import markdown
from radixmesh.bench.vllm_replay import Agreement, Observed, build_workload
from radixmesh.bench.vllm_server import VllmServer, kv_events_config, prefix_counters
from radixmesh.results.records import Record

# the lines of a real vLLM 0.32 CPU /metrics page (two requests of 303 tokens, 256 hit)
METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 606.0
vllm:prefix_cache_queries_created{engine="0",model_name="tiny"} 1.796128119205319e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 256.0
vllm:prefix_cache_hits_created{engine="0",model_name="tiny"} 1.7961281192053342e+09
vllm:external_prefix_cache_hits_total{engine="0",model_name="tiny"} 99.0
"""


def test_prefix_counters_read_the_totals_and_skip_created_and_other_caches() -> None:
    assert prefix_counters(METRICS) == (606.0, 256.0)
    two_engines = METRICS + 'vllm:prefix_cache_hits_total{engine="1",model_name="tiny"} 44.0\n'
    assert prefix_counters(two_engines) == (606.0, 300.0)
    assert prefix_counters("") == (0.0, 0.0)


def test_kv_events_config_is_what_vllm_reads() -> None:
    cfg = json.loads(kv_events_config(5557, 5558))
    assert cfg["enable_kv_cache_events"] is True and cfg["publisher"] == "zmq"
    assert cfg["endpoint"] == "tcp://*:5557" and cfg["replay_endpoint"] == "tcp://*:5558"


def test_vllm_argv_has_events_block_size_and_prompt_token_details(tmp_path) -> None:  # type: ignore[no-untyped-def]
    server = VllmServer("v0", "py", tmp_path, 8000, 5557, 5558, 128, 48, tmp_path / "log")
    argv = server.argv()
    assert argv[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--block-size") + 1] == "128"
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "48"
    assert "--enable-prompt-tokens-details" in argv
    assert json.loads(argv[argv.index("--kv-events-config") + 1])["endpoint"] == "tcp://*:5557"


def test_a_pinned_engine_runs_under_taskset_on_its_core(tmp_path) -> None:  # type: ignore[no-untyped-def]
    free = VllmServer("v0", "py", tmp_path, 8000, 5557, 5558, 128, 48, tmp_path / "log")
    assert free.launch_argv() == free.argv()
    pinned = VllmServer("v1", "py", tmp_path, 8000, 5557, 5558, 128, 48, tmp_path / "log",
                        cpus="1")
    assert pinned.launch_argv()[:4] == ["taskset", "-c", "1", "py"]


def _rec(route: str) -> Record:
    return Record("r", "cost", 0, "q", "g", 0, "n0", 0.0, route=route, prompt_tokens=300)


def test_agreement_counts_equal_predictions_per_route() -> None:
    a = Agreement()
    a.add(_rec("local"), Observed(index=256, router=256, usage=256, actual=256))
    a.add(_rec("forwarded"), Observed(index=128, router=256, usage=256, actual=256))
    a.add(_rec("forwarded"), Observed(index=0, router=128, usage=None, actual=0))
    out = a.to_json()
    assert (out["requests"], out["equal"], out["router_equal"]) == (3, 2, 2)
    assert out["usage_equals_metrics"] == 2
    assert out["by_route"] == {"forwarded": {"requests": 2, "equal": 1},
                               "local": {"requests": 1, "equal": 1}}
    assert out["first_mismatches"][0]["predicted"] == 128
    assert a.share is not None and abs(a.share - 2 / 3) < 1e-9


def test_workload_is_round_robin_sequential_and_prefix_sharing() -> None:
    reqs = build_workload(24, 4, 0.5, seed=0)
    assert len(reqs) == 24 and [r.entry for r in reqs[:4]] == [0, 1, 0, 1]
    assert all(r.t is None for r in reqs)
    assert len({r.group for r in reqs}) == 4  # groups repeat: prefixes are shared


def test_markdown_table_has_one_row_per_policy() -> None:
    summary = {"actual_hit_rate": 0.5, "expected_hit_rate": 0.5, "forwarded_share": 0.25,
               "mean_latency_s": 0.1, "p99_latency_s": 0.3, "errors": 0}
    agreement = Agreement()
    agreement.add(_rec("local"), Observed(0, 0, 0, 0))
    result = {"vllm_version": "0.32.0", "date": "2026-12-01", "model": "m", "block_size": 128,
              "num_blocks": 48, "requests": 1, "groups": 1, "prompt_tokens_mean": 300.0,
              "policies": [{"policy": p, "summary": summary, "agreement": agreement.to_json()}
                           for p in ("cost", "none")]}
    text = markdown(result)
    assert "| cost | 100.0 % (1/1) | 1/1 | 50.0 % |" in text and "| none |" in text
