"""A gateway must list the served model before the bench sends through it: SMG can count its
workers healthy while it knows no model they serve (every request then fails 404)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from radixmesh.bench.client import wait_for_model

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def _gateway(answers: list[httpx.Response]) -> tuple[httpx.AsyncClient, list[str]]:
    """A client whose ``/v1/models`` answers come from ``answers`` in turn (the last
    repeats); the paths asked, in order."""
    asked: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return answers[min(len(asked), len(answers)) - 1]

    return httpx.AsyncClient(transport=httpx.MockTransport(handle)), asked


def _models(*ids: str) -> httpx.Response:
    return httpx.Response(200, json={"object": "list", "data": [{"id": i} for i in ids]})


def _wait(client: httpx.AsyncClient, timeout_s: float) -> None:
    async def go() -> None:
        async with client:
            await wait_for_model(client, "http://gw", MODEL, timeout_s, poll_s=0.001)

    asyncio.run(go())


def test_waits_until_the_gateway_lists_the_model() -> None:
    client, asked = _gateway([httpx.Response(503), _models(), _models("other"),
                              _models("other", MODEL)])
    _wait(client, 5.0)
    assert asked == ["/v1/models"] * 4


def test_a_gateway_without_a_model_list_is_not_waited_for() -> None:
    client, asked = _gateway([httpx.Response(404)])
    _wait(client, 5.0)
    assert asked == ["/v1/models"]


@pytest.mark.parametrize("answer", [_models(), httpx.Response(200, json=[MODEL]),
                                    httpx.Response(200, text="not json")])
def test_a_gateway_that_never_lists_it_fails_the_run_saying_so(answer: httpx.Response) -> None:
    client, asked = _gateway([answer])
    with pytest.raises(RuntimeError, match="does not list model"):
        _wait(client, 0.05)
    assert len(asked) >= 2  # it kept asking until the deadline
