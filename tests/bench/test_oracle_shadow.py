"""On an emulated mesh the oracle shadows each engine's scheduler and ranks by predicted TTFT
(bench/oracle.py): a cold prompt entering at an A10G goes to the idle H100."""

from __future__ import annotations

from radixmesh.bench.oracle import Oracle
from radixmesh.core.profile import resolve


def test_the_oracle_sends_a_cold_prompt_to_the_faster_engine_and_tracks_it() -> None:
    now = [0.0]
    oracle = Oracle(["h100", "a10g"], 200_000, 16, 0.002, seed=0, max_context=32_768,
                    clock=lambda: now[0],
                    profiles=[resolve("h100-llama3-8b"), resolve("a10g-llama3-8b")])
    prompt = list(range(2600))
    node, cached = oracle.choose(prompt, 4, entry=1)
    assert (node, cached) == (0, 0)  # 53 ms there + a round trip against 550 ms here
    lease = oracle.started(node, prompt, 4)
    assert oracle.shadows is not None and oracle.shadows[0].live == 1
    now[0] = 0.2
    oracle.finished(node, lease, len(prompt), [*prompt, 1, 2, 3], 0.08)
    assert oracle.shadows[0].live == 0
    assert oracle.shadows[0].cached_prefix([*prompt, 9]) >= 2592  # its cache has the prompt
