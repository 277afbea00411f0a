"""chaos/load.py sends through the bench's client: streamed by default with TTFT, plain on
request, and every failure (status, transport error, a stream cut short) is an outcome."""

from __future__ import annotations

import asyncio
import json

import httpx

from radixmesh.chaos.load import ClientOutcome, Prompt, closed_loop, send_one, summarize
from radixmesh.core.headers import HEADER_QUEUE, HEADER_ROUTE, HEADER_SERVED_BY, HEADER_SERVICE

HEADERS = {HEADER_SERVED_BY: "n1", HEADER_ROUTE: "forwarded", HEADER_QUEUE: "0.25",
           HEADER_SERVICE: "0.5"}


def _sse(pieces: list[str], done: bool = True) -> bytes:
    events = [{"choices": [{"index": 0, "text": p}]} for p in pieces]
    events.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": len(pieces),
                                            "prompt_tokens_details": {"cached_tokens": 3}}})
    lines = [f"data: {json.dumps(e)}\n\n" for e in events] + (["data: [DONE]\n\n"] if done else [])
    return "".join(lines).encode()


def _handler(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    prompt = body["prompt"]
    if prompt == "busy":
        return httpx.Response(429, json={"error": {"message": "queue full"}})
    if prompt == "down":
        raise httpx.ConnectError("refused", request=request)
    if not body.get("stream"):
        return httpx.Response(200, headers=HEADERS, json={
            "choices": [{"index": 0, "text": "plain answer", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                      "prompt_tokens_details": {"cached_tokens": 1}}})
    assert body["stream_options"] == {"include_usage": True}
    sse = {**HEADERS, "content-type": "text/event-stream"}
    return httpx.Response(200, headers=sse, content=_sse(["he", "llo"], done=prompt != "cut"))


def _send(*prompts: Prompt) -> list[ClientOutcome]:
    async def go() -> list[ClientOutcome]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(_handler)) as client:
            return [await send_one(client, "http://n0", p, "m", 0.0) for p in prompts]

    return asyncio.run(go())


def test_a_streamed_prompt_records_text_ttft_route_and_the_nodes_timing() -> None:
    (out,) = _send(Prompt("a", "hi"))
    assert out.ok and out.text == "hello" and out.status == 200
    assert out.ttft_s is not None and 0 <= out.ttft_s <= out.latency_s
    assert (out.served_by, out.route, out.cached_tokens) == ("n1", "forwarded", 3)
    assert out.server_s == 0.75 and out.entry == "http://n0"


def test_a_plain_prompt_is_one_json_answer_without_ttft() -> None:
    (out,) = _send(Prompt("a", "hi", stream=False))
    assert out.ok and out.text == "plain answer" and out.ttft_s is None
    assert out.cached_tokens == 1 and out.server_s == 0.75


def test_failures_are_outcomes_never_exceptions() -> None:
    busy, down, cut = _send(Prompt("b", "busy"), Prompt("d", "down"), Prompt("c", "cut"))
    assert busy.status == 429 and not busy.ok and "queue full" in (busy.error or "")
    assert down.status is None and not down.ok and "ConnectError" in (down.error or "")
    assert cut.status == 200 and not cut.ok and cut.error == "stream ended without [DONE]"


def test_closed_loop_answers_every_prompt_once_and_summarize_reports_ttft(  # type: ignore[no-untyped-def]
    monkeypatch,
) -> None:
    prompts = [Prompt(f"p{i}", "hi" if i % 3 else "busy") for i in range(9)]
    orig = httpx.AsyncClient.__init__

    def init(self: httpx.AsyncClient, *a: object, **kw: object) -> None:
        orig(self, *a, transport=httpx.MockTransport(_handler), **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(httpx.AsyncClient, "__init__", init)
    outs = asyncio.run(closed_loop(lambda i: f"http://n{i % 2}", prompts, "m", concurrency=3))
    assert sorted(o.id for o in outs) == sorted(p.id for p in prompts)
    summary = summarize(outs)
    assert summary["requests"] == 9 and summary["failures"] == 3
    assert summary["ttft_p50_s"] is not None and summary["routes"] == {"forwarded": 6, "none": 3}


def test_open_loop_sends_rate_x_duration_or_until_stopped(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from radixmesh.chaos.load import open_loop

    orig = httpx.AsyncClient.__init__

    def init(self: httpx.AsyncClient, *a: object, **kw: object) -> None:
        orig(self, *a, transport=httpx.MockTransport(_handler), **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(httpx.AsyncClient, "__init__", init)
    prompt = Prompt("p", "hi")
    timed = asyncio.run(open_loop(lambda i: "http://n0", lambda i: prompt, "m", 400.0, 0.02))
    assert len(timed) == 8 and all(o.ok for o in timed)

    async def until_stopped() -> list[ClientOutcome]:
        stop = asyncio.Event()
        ticks: list[float] = []

        def tick(t: float) -> None:  # the 5th arrival stops the schedule
            ticks.append(t)
            if len(ticks) == 5:
                stop.set()

        return await open_loop(lambda i: "http://n0", lambda i: prompt, "m", 1000.0, None,
                               on_tick=tick, stop=stop)

    assert len(asyncio.run(until_stopped())) == 5
