"""The benchmark harness without clusters: the oracle's cache mirror against the real engine,
admission (drops / truncation / fail), schedules recorded, a turn held for its predecessor,
batching, bootstrap intervals and per-node figures."""

from __future__ import annotations

import asyncio
import json
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest

from radixmesh.bench import replay as replay_module
from radixmesh.bench.oracle import UNKNOWN, CacheMirror, Oracle, fed_output, output_ids
from radixmesh.bench.prompts import PromptTooLong, make_admit, prompt_ids
from radixmesh.bench.replay import Replay, _open_loop, arrival_times, mode_of
from radixmesh.bench.runner import RunResult, batches
from radixmesh.bench.spec import RunSpec
from radixmesh.bench.sweep import paired
from radixmesh.core.byte_tokenizer import ByteTokenizer
from radixmesh.results.records import Record
from radixmesh.results.run_summary import node_figures, ratio_interval
from radixmesh.workload import Request, WorkloadSpec, schedule
from radixmesh.workload.build import build_counted
from radixmesh.workload.request import Message

BUDGET = 2_500  # tokens: small enough that the mirrored runs evict


# ----------------------------------------------------------------------------- the mirror
def few_shot(n: int) -> list[Request]:
    """One hot few-shot prefix, different questions, a few generated tokens each."""
    prefix = "Examples:\n" + "".join(f"Q: what is {i} plus {i}? A: {2 * i}\n" for i in range(30))
    return [Request(id=f"fs{i}", prompt=prefix + f"Q: name {i}?", max_tokens=1 + i % 4)
            for i in range(n)]  # fmt: skip


def system_prompt(n: int) -> list[Request]:
    """A long shared system prompt, chat messages (through the chat template)."""
    system = Message("system", "You are a careful assistant. " * 25)
    return [Request(id=f"sp{i}", messages=(system, Message("user", f"question {i} " * 3)),
                    max_tokens=6) for i in range(n)]  # fmt: skip


Generate = Callable[[Request], tuple[int, str, int, str]]


def multi_turn(generate: Generate, turns: int) -> None:
    """Conversations whose every turn resends the previous answers (as the API returned them)."""
    for conv in range(2):
        msgs: tuple[Message, ...] = (Message("user", f"conversation {conv}: hello $$ $$"),)
        for turn in range(turns):
            req = Request(id=f"c{conv}t{turn}", messages=msgs, max_tokens=20)  # > 1 KV block
            _, text, _, _ = generate(req)
            msgs = (*msgs, Message("assistant", text), Message("user", f"and then {turn}?"))


def mirrored(mirror_generated: bool) -> tuple[Generate, list[int]]:
    """The tiny engine in-process beside a mirror; returns a generate function and the list
    of (engine cached - mirror predicted) per request."""
    from radixmesh.engine.base import GenerateRequest, SamplingParams
    from radixmesh.engine.factory import build_engine

    engine = build_engine("tiny", cache_tokens=BUDGET)
    tok = engine.tokenizer
    mirror = CacheMirror(BUDGET, 16, engine.max_context)
    diffs: list[int] = []

    def generate(req: Request) -> tuple[int, str, int, str]:
        ids = prompt_ids(tok, req)
        lease = mirror.start(ids, req.max_tokens)
        sp = SamplingParams(max_tokens=req.max_tokens)
        out = engine.generate(GenerateRequest(req.id, tuple(ids), sp))
        text = tok.decode(out.output_ids)
        gen = output_ids(tok, text, len(out.output_ids)) if mirror_generated else []
        mirror.finish(lease, ids + fed_output(gen, out.finish_reason))
        diffs.append(out.cached_tokens - lease.cached)
        return out.cached_tokens, text, len(out.output_ids), out.finish_reason

    return generate, diffs


@pytest.fixture(scope="module")
def mirror_runs() -> dict[bool, list[int]]:
    out: dict[bool, list[int]] = {}
    for flag in (True, False):
        generate, diffs = mirrored(flag)
        for req in [*few_shot(12), *system_prompt(8)]:
            generate(req)
        multi_turn(generate, turns=5)
        out[flag] = diffs
    return out


def test_oracle_mirror_is_exact_with_generated_tokens(mirror_runs: dict[bool, list[int]]) -> None:
    diffs = mirror_runs[True]
    assert len(diffs) == 12 + 8 + 10
    assert diffs == [0] * len(diffs)


def test_a_prompt_only_mirror_would_drift(mirror_runs: dict[bool, list[int]]) -> None:
    """The same runs with generated tokens left out of the mirror: it goes wrong (the check
    above has teeth)."""
    assert any(d != 0 for d in mirror_runs[False])


def test_output_ids_marks_what_text_cannot_tell() -> None:
    tok = ByteTokenizer()
    assert output_ids(tok, "ab", 2) == [97, 98]
    assert output_ids(tok, "", 3) == [UNKNOWN] * 3  # three special tokens, say
    assert output_ids(tok, "a\ufffdb", 3) == [97, UNKNOWN, UNKNOWN]
    assert fed_output([1, 2, 3], "length") == [1, 2] and fed_output([1, 2], "stop") == [1, 2]


# ----------------------------------------------------------------------------- admission
def write_trace(path: Path, lines: list[dict[str, object]]) -> str:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


@pytest.fixture
def long_trace(tmp_path: Path) -> str:
    lines: list[dict[str, object]] = [
        {"id": f"r{i}", "prompt": ("x" * 5000 if i % 3 == 0 else "short") + f" {i}",
         "group": "long" if i % 3 == 0 else "short", "t": 0.5 * i}
        for i in range(9)
    ]  # fmt: skip
    return write_trace(tmp_path / "long.jsonl", lines)


def test_drops_counted_per_reason_and_group(long_trace: str) -> None:
    spec = RunSpec(name="t", policy="none", preset="tiny",  # 4,096 byte tokens
                   workload=WorkloadSpec(trace=long_trace, requests=None))
    reqs, drops = build_counted(spec.workload, 2, make_admit(spec, "drop"))
    assert len(reqs) == 6 and drops.examined == 9
    assert drops.to_json()["by_reason"] == {"too_long": 3}
    assert drops.to_json()["by_group"] == {"too_long": {"long": 3}}
    assert "dropped 3 of 9" in drops.text()


def test_truncate_or_fail_instead_of_dropping(long_trace: str) -> None:
    spec = RunSpec(name="t", policy="none", preset="tiny",  # 4,096 byte tokens
                   workload=WorkloadSpec(trace=long_trace, requests=None))
    reqs, drops = build_counted(spec.workload, 2, make_admit(spec, "truncate"))
    assert len(reqs) == 9 and drops.total == 0 and drops.to_json()["truncated"] == 3
    tok = ByteTokenizer()
    longest = max(len(prompt_ids(tok, r)) for r in reqs)
    assert 4000 < longest + 1 + 8 < 4096  # cut to just fit the tiny preset's context
    with pytest.raises(PromptTooLong):
        build_counted(spec.workload, 2, make_admit(spec, "fail"))


def test_truncating_chat_messages_keeps_the_leading_ones() -> None:
    spec = RunSpec(name="t", policy="none", preset="tiny")  # 4,096 byte tokens
    req = Request(id="c", messages=(Message("system", "s" * 3000), Message("user", "u" * 3000)))
    out = make_admit(spec, "truncate")(req)
    assert isinstance(out, Request) and out.messages is not None
    assert out.messages[0].content == "s" * 3000 and 0 < len(out.messages[-1].content) < 3000


# ----------------------------------------------------------------------------- schedules
def test_rate_honoured_for_traces_and_trace_times_kept(long_trace: str) -> None:
    spec = RunSpec(name="t", policy="none", preset="tiny",  # 4,096 byte tokens
                   workload=WorkloadSpec(trace=long_trace, requests=None))
    runner_res = _plan(spec)
    assert runner_res.mode == "open" and runner_res.schedule["schedule"] == "trace"
    assert [r.t for r in runner_res.requests][:2] == [0.5, 1.0]  # lines 1, 2 (line 0 dropped)
    timed = RunSpec(name="p", policy="none", preset="tiny",
                    workload=WorkloadSpec(trace=long_trace, requests=None, rate=50.0))  # fmt: skip
    res = _plan(timed)
    assert res.schedule["schedule"] == "poisson" and res.schedule["arrival_rate"] == 50.0
    assert [r.t for r in res.requests][:2] != [0.5, 1.0] and res.requests[0].t == 0.0


def test_sequential_and_closed_loop_recorded() -> None:
    w = WorkloadSpec(requests=6, synthetic_scale=0.1, synthetic_groups=2)
    seq = _plan(RunSpec(name="s", policy="none", workload=w))
    closed = _plan(RunSpec(name="c", policy="none", workload=w, concurrency=3))
    assert (seq.mode, seq.schedule["schedule"]) == ("sequential", "sequential")
    assert (closed.mode, closed.schedule["concurrency"]) == ("closed", 3)
    with pytest.raises(ValueError, match="exclude"):
        RunSpec(name="x", policy="none", workload=WorkloadSpec(rate=1.0), concurrency=2)


def _plan(spec: RunSpec) -> RunResult:
    from radixmesh.bench.runner import Runner

    return Runner("/tmp/radixmesh-test-plan", log=lambda m: None).plan(spec)


def test_batches_pair_by_point_and_mode() -> None:
    w = WorkloadSpec(requests=4, rate=1.0)
    specs = paired([RunSpec(name=f"{p}-x", policy=p, workload=w) for p in ("none", "cost")])
    runs = [RunResult(s, mode="open") for s in specs]
    runs.append(RunResult(RunSpec(name="seq", policy="none", lockstep=specs[0].lockstep)))
    assert [len(b) for b in batches(runs)] == [2, 1]  # same key, other mode: not together
    five = [RunResult(RunSpec(name=str(i), policy="none", lockstep="k")) for i in range(5)]
    assert [len(b) for b in batches(five)] == [4, 1]


def test_paired_open_loop_needs_one_schedule() -> None:
    a = [Request(id=str(i), prompt="p", t=float(i)) for i in range(3)]
    b = [r.with_time((r.t or 0) + 0.5) for r in a]
    assert arrival_times([(None, a), (None, a[:2])]) == [0.0, 1.0, 2.0]  # type: ignore[list-item]
    with pytest.raises(ValueError, match="one arrival schedule"):
        arrival_times([(None, a), (None, b)])  # type: ignore[list-item]
    assert mode_of(RunSpec(name="n", policy="none"), a) == "open"


class TimedReplay:
    """A replay whose ``one`` only waits a little (seeded) and notes when each request ran:
    the schedule's code (closed loop, open loop) is the bench's own."""

    def __init__(self, clients: int, clock: Callable[[], float]) -> None:
        self.spec = RunSpec(name="fake", policy="none", concurrency=clients)
        self.clock = clock
        self.t0 = clock()
        self.spans: dict[str, tuple[float, float]] = {}
        self.running = self.most = 0

    async def one(self, http: object, seq: int, req: Request, record: bool = True) -> Record:
        start = self.clock()
        self.running += 1
        self.most = max(self.most, self.running)
        await asyncio.sleep(random.Random(seq).uniform(0.0, 0.004))  # a fake request's service
        self.running -= 1
        self.spans[req.id] = (start - self.t0, self.clock() - self.t0)
        return rec("n0")


def conversations(n: int, turns: int) -> list[Request]:
    """``n`` conversations of ``turns`` turns, interleaved: each turn waits for the last."""
    return [Request(id=f"c{c}/t{t}", prompt="p", after=f"c{c}/t{t - 1}" if t else None)
            for t in range(turns) for c in range(n)]  # fmt: skip


def assert_turns_waited(replay: TimedReplay, reqs: list[Request]) -> None:
    assert set(replay.spans) == {r.id for r in reqs}
    for r in reqs:
        if r.after is not None:
            assert replay.spans[r.after][1] <= replay.spans[r.id][0], r.id


@pytest.fixture
def virtual_replay(virtual_loop: asyncio.AbstractEventLoop,
                   monkeypatch: pytest.MonkeyPatch) -> Callable[[int], TimedReplay]:
    """TimedReplays on the loop's virtual time, which the bench's schedules read too."""
    monkeypatch.setattr(replay_module, "time", SimpleNamespace(perf_counter=virtual_loop.time))
    return lambda clients: TimedReplay(clients, virtual_loop.time)


def test_closed_loop_clients_send_a_turn_only_after_the_answer_to_the_last(
    virtual_loop: asyncio.AbstractEventLoop, virtual_replay: Callable[[int], TimedReplay]
) -> None:
    reqs = conversations(3, 4)
    replay = virtual_replay(8)
    virtual_loop.run_until_complete(Replay.closed_loop(replay, None, reqs))  # type: ignore[arg-type]
    assert_turns_waited(replay, reqs)
    assert replay.most == 3  # 8 clients, but only 3 conversations can have a turn out


def test_open_loop_holds_a_turn_whose_answer_is_not_in_yet(
    virtual_loop: asyncio.AbstractEventLoop, virtual_replay: Callable[[int], TimedReplay]
) -> None:
    reqs = schedule.poisson(conversations(4, 3), nodes=4, rate=5000.0, seed=1)  # overlapping
    replay = virtual_replay(1)
    virtual_loop.run_until_complete(
        _open_loop(None, [(replay, reqs)]))  # type: ignore[arg-type, list-item]
    assert_turns_waited(replay, reqs)
    for r in reqs:
        assert replay.spans[r.id][0] >= (r.t or 0.0)  # never before its arrival time
    # and a turn that was not held starts at its arrival time exactly (nothing else delays it)
    first = [r for r in reqs if r.after is None]
    assert [replay.spans[r.id][0] for r in first] == pytest.approx([r.t for r in first])


# ----------------------------------------------------------------------------- figures
def rec(served: str | None, latency: float = 1.0, service: float = 0.5) -> Record:
    return Record(run="r", policy="cost", seq=0, id="x", group=None, entry=0, entry_node="n0",
                  t_send=0.0, t_done=2.0, latency_s=latency, served_by=served,
                  server_timing={"service": service})  # fmt: skip


def test_stranded_node_flagged() -> None:
    figs = node_figures([rec("n0"), rec("n0"), rec("n2")], ["n0", "n1", "n2"])
    assert figs["served_per_node"] == {"n0": 2, "n1": 0, "n2": 1}
    assert figs["stranded"] and figs["stranded_nodes"] == ["n1"]
    assert figs["busy_share"] == pytest.approx(1.5 / (3 * 2.0))
    assert not node_figures([rec("n0"), rec("n1")], ["n0", "n1"])["stranded"]


def test_bootstrap_interval_brackets_the_ratio_and_narrows() -> None:
    import random

    rng = random.Random(1)

    def pairs(n: int) -> list[tuple[float, float]]:
        return [
            (0.8 * b * rng.uniform(0.7, 1.3), b) for b in (rng.uniform(0.1, 1) for _ in range(n))
        ]

    small, big = pairs(40), pairs(1000)
    lo_s, hi_s = ratio_interval(small) or (0, 0)
    lo_b, hi_b = ratio_interval(big) or (0, 0)
    point = sum(a for a, _ in small) / sum(b for _, b in small)
    assert lo_s < point < hi_s and lo_b < 0.8 < hi_b
    assert hi_b - lo_b < (hi_s - lo_s) / 2
    assert ratio_interval(small[:1]) is None


# --------------------------------------------------------- gateway start: a port taken meanwhile
_READY_SERVER = """
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"healthy_workers": int(sys.argv[2])}).encode()
        self.send_response(200); self.send_header("content-length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_gateway_whose_port_was_taken_meanwhile_starts_again_on_fresh_ports() -> None:
    """The ports are picked free, then bound by the gateway a moment later; when another
    process took one in between (clusters start at once), the gateway exits with "Address
    already in use" and is started again on new ports, up to PORT_ATTEMPTS times; any other
    exit is an error at once."""
    from radixmesh.bench import sglang

    class Fake(sglang.Gateway):
        name, package = "fake", "json"
        ports: list[int] = []  # noqa: RUF012 (one test's record)
        failures = 1

        def command(self, port: int, workers: Sequence[str]) -> list[str]:
            Fake.ports.append(port)
            if len(Fake.ports) <= Fake.failures:
                return [sys.executable, "-c",
                        "print('Error: Address already in use (os error 98)'); raise SystemExit(1)"]
            return [sys.executable, "-c", _READY_SERVER, str(port), str(len(workers))]

    gw = Fake(["http://127.0.0.1:1"], startup_timeout_s=20)
    try:
        assert len(Fake.ports) == 2 and gw.port == Fake.ports[1] != Fake.ports[0]
        assert gw.ready()
    finally:
        gw.close()
    Fake.ports, Fake.failures = [], sglang.PORT_ATTEMPTS
    with pytest.raises(sglang.PortTaken):
        Fake(["http://127.0.0.1:1"], startup_timeout_s=20)
    assert len(Fake.ports) == sglang.PORT_ATTEMPTS

    class Broken(Fake):
        def command(self, port: int, workers: Sequence[str]) -> list[str]:
            Fake.ports.append(port)
            return [sys.executable, "-c", "print('bad flag'); raise SystemExit(2)"]

    Fake.ports = []
    with pytest.raises(RuntimeError, match="bad flag") as info:
        Broken(["http://127.0.0.1:1"], startup_timeout_s=20)
    assert not isinstance(info.value, sglang.PortTaken) and len(Fake.ports) == 1


def test_the_oracle_restarts_a_stale_speed_from_the_nodes_that_served() -> None:
    """The oracle applies the nodes' stale-speed rule: a node whose warm-up looked slow is
    not left out for good (every cold prompt went to the one that looked fastest, and the
    others' estimates never changed). Once its estimate is a load window old it restarts
    from the median of the nodes that served within the window, and cold prompts spread."""
    now = [0.0]
    oracle = Oracle(["n0", "n1"], 20_000, 16, 0.002, seed=1, clock=lambda: now[0])
    prompt = list(range(1000))
    for node, service in ((0, 5.0), (1, 0.1)):  # warm-ups: n0 looked 50x slower
        oracle.finished(node, oracle.started(node, [7] * 40, 1), 40, None, service)
    assert oracle.choose(prompt, 1, entry=0)[0] == 1  # a cold prompt leaves n0
    window = oracle.router.config.load_window_s
    for step in range(1, 4):  # n1 keeps serving, n0 nothing
        now[0] = step * window / 2
        oracle.finished(1, oracle.started(1, prompt, 1), len(prompt), None, 0.1)
    assert oracle.speed_restarts == 0  # checked when the oracle next chooses
    assert oracle.choose(prompt, 1, entry=0)[0] == 0  # n0 is as fast as n1 now: it stays
    assert oracle.speed_restarts == 1


# ------------------------------------------------------------- streamed records, goodput, failure
def _rec(**kw: object) -> Record:
    return Record(run="r", policy="none", seq=0, id="x", group=None, entry=0, entry_node="n0",
                  t_send=0.0, **kw)  # type: ignore[arg-type]


def test_a_stream_gives_ttft_tpot_usage_and_the_nodes_timing() -> None:
    from radixmesh.bench.client import _fill_stream, _StreamState

    state = _StreamState()
    state.chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, 1.0)
    assert state.first is None  # a chat stream's role-only opening chunk is not a token
    for t, piece in ((1.5, "a"), (1.7, "b"), (2.1, "c")):
        state.chunk({"choices": [{"index": 0, "delta": {"content": piece}}]}, t)
    state.chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}, 2.2)
    state.chunk({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3,
                                          "prompt_tokens_details": {"cached_tokens": 4}}}, 2.3)
    state.done = True  # data: [DONE] (a stream without it is an error: the next test)
    rec = _rec(cached_tokens=2)  # the header's estimate at acceptance
    _fill_stream(rec, state, start=1.0)
    assert rec.ttft_s == pytest.approx(0.5) and rec.tpot_s == pytest.approx(0.3)
    assert rec.cached_tokens == 4 and rec.prompt_tokens == 9 and rec.output == "abc"
    assert rec.finish_reason == "length" and rec.ok


def test_an_error_inside_a_stream_fails_the_record() -> None:
    from radixmesh.bench.client import _fill_stream, _StreamState

    state = _StreamState()
    state.chunk({"choices": [{"index": 0, "text": "a"}]}, 1.0)
    state.chunk({"error": {"message": "node shut down", "code": 503}}, 1.1)
    rec = _rec()
    _fill_stream(rec, state, start=0.0)
    assert not rec.ok and "node shut down" in (rec.error or "")


def test_a_stream_that_breaks_off_without_done_fails_the_record() -> None:
    from radixmesh.bench.client import _fill_stream, _StreamState

    state = _StreamState()
    state.chunk({"choices": [{"index": 0, "text": "a"}]}, 1.0)
    rec = _rec()
    _fill_stream(rec, state, start=0.0)
    assert not rec.ok and rec.error == "stream ended without [DONE]"


def test_goodput_counts_failed_requests_against_it() -> None:
    from radixmesh.results.run_summary import Slo, token_latencies

    recs = [_rec(ttft_s=0.2, tpot_s=0.05), _rec(ttft_s=1.5, tpot_s=0.01),
            _rec(ttft_s=0.3, tpot_s=0.2), _rec(ttft_s=0.4), _rec(error="HTTP 500: x")]
    figures = token_latencies(recs)
    assert figures["goodput"] == pytest.approx(2 / 5)  # the 1st and the 1-token 4th
    assert figures["p50_ttft_s"] == 0.3 and figures["slo"] == {"ttft_s": 1.0, "tpot_s": 0.1}
    assert token_latencies(recs, Slo(ttft_s=2.0, tpot_s=0.5))["goodput"] == pytest.approx(4 / 5)
    assert token_latencies([_rec()]) == {}  # records without TTFT add nothing


def test_a_run_that_sent_nothing_or_lost_too_much_fails() -> None:
    from radixmesh.bench.after_run import run_failure
    from radixmesh.workload.build import Drops

    spec = RunSpec(name="r", policy="none")
    drops = Drops()
    for i in range(20):
        drops.note(Request(id=str(i), prompt="p"), "too_long")
    empty = RunResult(spec, drops=drops)
    assert "no request was sent" in (run_failure(empty) or "")
    fine = RunResult(spec, records=[_rec() for _ in range(40)])
    assert run_failure(fine) is None
    fine.records[0].error = "HTTP 500: x"
    assert run_failure(fine) is None  # 1 of 40 failed: 2.5 %
    fine.records[1].error = "HTTP 500: x"
    fine.records[2].error = "HTTP 500: x"
    assert "3 of 40 requests failed" in (run_failure(fine) or "")
