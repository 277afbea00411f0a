"""The request path observes the histograms: a real NodeService, real engine, two requests."""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from radixmesh.engine.base import SamplingParams
from radixmesh.runtime.config import ServeConfig
from radixmesh.runtime.node import NodeService


def _values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_local_requests_fill_the_histograms(engine: Any) -> None:
    async def main() -> str:
        node = NodeService(ServeConfig(node_id="h", port=18994, gossip_interval=5.0), engine)
        await node.start()
        try:
            prompt = list(b"The same long prefix, then a question. " * 4)
            for _ in range(2):
                ex = await node.execute(prompt, SamplingParams(max_tokens=3), False)
                await ex.result()
            return node.prometheus()
        finally:
            await node.stop()

    v = _values(asyncio.run(main()))
    assert v[("radixmesh_request_duration_seconds_count",
              (("outcome", "done"), ("route", "local")))] == 2
    assert v[("radixmesh_time_to_first_token_seconds_count", ())] == 2
    assert v[("radixmesh_queue_seconds_count", ())] == 2
    assert v[("radixmesh_prefill_tokens_count", (("kind", "cached"),))] == 2
    assert v[("radixmesh_prefill_tokens_sum", (("kind", "cached"),))] > 0  # the 2nd reused it
