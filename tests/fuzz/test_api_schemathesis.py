"""schemathesis against a real node's OpenAPI document: no response is ever a 5xx.

One ``radixmesh serve`` process (the ``micro`` preset: a 2-layer model, so generation is cheap)
on a free loopback port. schemathesis reads ``/openapi.json`` and sends both schema-conforming
and schema-violating requests to every client operation. Checks: no server error, declared
status codes only, and every 4xx body is an OpenAI error object (the document says so).
Bounded: ``RADIXMESH_SCHEMATHESIS_EXAMPLES`` (default 40) examples per operation and mode.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from radixmesh.runtime.cluster import LocalCluster

EXAMPLES = int(os.environ.get("RADIXMESH_SCHEMATHESIS_EXAMPLES", "40"))


@pytest.fixture(scope="module")
def node() -> Iterator[LocalCluster]:
    options = {"preset": "micro", "cache_tokens": 4096, "gossip_interval": 0.5,
               "max_body_bytes": 65536}
    with LocalCluster(1, options, ready_timeout=120) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def api_schema(node: LocalCluster) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(node.url(0) + "/openapi.json")


def _shorten(case: schemathesis.Case) -> None:
    # Keep generations short: the property is "no 5xx", not "long outputs work".
    if isinstance(case.body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            value = case.body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 8:
                case.body[key] = 8


def _fuzz(operation: schemathesis.APIOperation, mode: GenerationMode, base_url: str) -> int:
    calls = 0

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
              database=None)
    def run(case: schemathesis.Case) -> None:
        nonlocal calls
        _shorten(case)
        calls += 1
        case.call_and_validate(
            base_url=base_url,
            checks=[not_a_server_error, status_code_conformance, response_schema_conformance],
            timeout=60,
        )

    run()
    return calls


# The pytest plugin of schemathesis does not support this pytest; drive Hypothesis directly.
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_errors(api_schema: schemathesis.BaseSchema, node: LocalCluster,
                          mode: GenerationMode) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) == 7
    if mode is GenerationMode.NEGATIVE:  # only request bodies can be made invalid
        operations = [op for op in operations if op.method.upper() == "POST"]
    calls = sum(_fuzz(op, mode, node.url(0)) for op in operations)
    assert calls >= len(operations)


def test_node_survived(node: LocalCluster) -> None:
    """After the fuzzing, the node still answers and reports no 5xx and no core errors."""
    assert node.nodes[0].running
    metrics = node.get(0, "/metrics").text
    counts = [ln for ln in metrics.splitlines() if ln.startswith(("radixmesh_client_errors",
                                                                  "radixmesh_requests"))]
    print("\n".join(counts))  # shown with -s: how many 4xx of each kind the fuzzing provoked
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in metrics.splitlines() if line and not line.startswith("#")}
    server_errors = {k: v for k, v in samples.items()
                     if k.startswith("radixmesh_client_errors_total") and 'status="5' in k}
    assert not any(server_errors.values()), server_errors
    # The counter must be there: a renamed metric would otherwise make this test vacuous.
    assert samples["radixmesh_core_errors_total"] == 0
