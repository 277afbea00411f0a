"""``radixmesh bench`` for the routing issue: workloads × schedules, the capacity probe, and the
two centralized gateways (sglang-router 0.3.2, SMG 1.13) launched in front of a worker."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import replace
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from radixmesh.bench import plan, replay
from radixmesh.bench import runner as runner_mod
from radixmesh.bench.capacities import Capacities
from radixmesh.bench.emulated import PLANNED, planned_capacity
from radixmesh.bench.replay import CapacityProbe, mode_of, timing_probe
from radixmesh.bench.runner import GATEWAYS, Runner, RunResult, batches, summary_entry
from radixmesh.bench.sglang import SglangRouter
from radixmesh.bench.smg import Smg
from radixmesh.bench.spec import ALL_POLICIES, RunSpec
from radixmesh.core.config import GossipConfig
from radixmesh.results.records import Record
from radixmesh.sim.sweep import capacity_rate, mean_prompt_tokens, profile_costs
from radixmesh.sim.tokens import TOKENIZERS
from radixmesh.workload import Request, WorkloadSpec, agentic
from radixmesh.workload.build import build
from radixmesh.workload.schedule import Entry
from test_cli_flags import command_args

bench_args = partial(command_args, "bench")  # `radixmesh bench ARGS...`'s flags


def test_workloads_times_schedules_each_paired_with_its_own_key() -> None:
    args = bench_args("--workload", "chat,rag", "--concurrency", "4", "--load", "50%,0.8",
                      "--policy", "none,cost,smg", "--requests", "12")  # fmt: skip
    specs = plan.specs_from_args(args)
    assert len(specs) == 2 * 3 * 3  # workloads × schedules × policies
    names = [s.name for s in specs]
    assert len(set(names)) == len(names)
    assert names[:3] == [
        f"{p}-uniform-d2ms-g500ms-c200000-n4-k4-wchat" for p in ("none", "cost", "smg")
    ]
    assert "smg-uniform-d2ms-g500ms-c200000-n4-wrag-L0.8" in names
    loads = [s for s in specs if s.workload.load]
    assert {s.workload.load for s in loads} == {0.5, 0.8}
    assert all(s.workload.rate is None and s.concurrency == 1 for s in loads)
    # one lockstep key per workload × schedule point, shared by its policies only
    keys = [s.lockstep for s in specs]
    assert len(set(keys)) == 6 and all(keys.count(k) == 3 for k in keys)
    assert {s.workload.kind for s in specs} == {"chat", "rag"}
    # the runner batches each point's policies together (6 fit with --batch-limit 6)
    planned = [RunResult(s, mode=mode_of(s, [])) for s in specs]
    assert [len(b) for b in batches(planned, 6)] == [3] * 6
    assert [r.mode for r in planned[3:6]] == ["open"] * 3


def test_random_entry_is_named_and_reaches_the_workload() -> None:
    specs = plan.specs_from_args(bench_args("--workload", "agentic", "--load", "0.8", "--policy",
                                            "none,cost", "--entry", "random"))  # fmt: skip
    assert [s.name for s in specs] == [
        f"{p}-uniform-d2ms-g500ms-c200000-n4-wagentic-erandom-L0.8" for p in ("none", "cost")
    ]
    assert all(s.workload.entry is Entry.RANDOM for s in specs)
    assert len({s.lockstep for s in specs}) == 1  # still paired with each other
    sweep = plan.specs_from_args(bench_args("--sweep", "paper", "--only", "t1",
                                            "--entry", "random"))
    assert sweep and all(s.name.endswith("@uniform-erandom") for s in sweep)
    given = plan.specs_from_args(bench_args("--workload", "agentic", "--policy", "none"))
    assert given[0].workload.entry is Entry.GIVEN and "-e" not in given[0].name.split("-w")[1]
    with pytest.raises(SystemExit):
        bench_args("--entry", "sideways")


def test_schedule_defaults_and_mmlu_names_unchanged() -> None:
    plain = plan.specs_from_args(bench_args("--policy", "none,cost"))
    assert [s.name for s in plain] == ["none-uniform-d2ms-g500ms-c200000-n4",
                                       "cost-uniform-d2ms-g500ms-c200000-n4"]  # fmt: skip
    assert all(not s.lockstep for s in plain)  # sequential: paired only with --interleave
    only_load = plan.specs_from_args(bench_args("--policy", "none", "--load", "0.5"))
    assert [s.name for s in only_load] == ["none-uniform-d2ms-g500ms-c200000-n4-L0.5"]
    assert only_load[0].lockstep  # open loop: paired by default
    both = plan.specs_from_args(bench_args("--policy", "none", "--concurrency", "1,16",
                                           "--rate", "2"))
    assert [(s.concurrency, s.workload.rate) for s in both] == [(1, None), (16, None), (1, 2.0)]
    with pytest.raises(SystemExit):
        bench_args("--load", "0")
    with pytest.raises(SystemExit):
        bench_args("--workload", "video")
    assert "smg" in ALL_POLICIES and set(GATEWAYS) == {"sglang", "smg"}


def test_load_excludes_closed_loop_concurrency() -> None:
    with pytest.raises(ValueError, match="exclude"):
        RunSpec(name="x", policy="none", workload=WorkloadSpec(load=0.5), concurrency=4)


class _StubReplay:
    """What the probe needs of a Replay: its spec and a closed loop (records come back)."""

    def __init__(self, policy: str, service_s: float) -> None:
        self.spec = RunSpec(name=f"{policy}-x", policy=policy, nodes=2,
                            workload=WorkloadSpec(load=0.5, seed=3))  # fmt: skip
        self.service_s = service_s
        self.calls: list[tuple[int, int, bool]] = []

    async def closed_loop(
        self, http: Any, requests: Sequence[Request], clients: int | None = None,
        record: bool = True,
    ) -> list[Record]:  # fmt: skip
        self.calls.append((len(requests), clients or 0, record))
        out = []
        for i in range(0, len(requests), clients or 1):  # ``clients`` at a time
            await asyncio.sleep(self.service_s)  # its service time: virtual time in the test
            out += [Record(run=self.spec.name, policy=self.spec.policy, seq=j, id=r.id,
                           group=None, entry=0, entry_node="n0", t_send=0.0,
                           latency_s=self.service_s, status=200)
                    for j, r in enumerate(requests[i : i + (clients or 1)])]  # fmt: skip
        return out


def test_capacity_probe_times_the_batch_at_a_fraction_of_none_capacity(
    virtual_loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the probe's clock is the loop's virtual time: the stubs' service times pass exactly
    monkeypatch.setattr(replay, "time", SimpleNamespace(perf_counter=virtual_loop.time))
    probe_reqs = [Request(id=f"p{i}", prompt="x") for i in range(8)]
    none, cost = _StubReplay("none", 0.05), _StubReplay("cost", 0.02)
    reqs = [Request(id=f"r{i}", prompt="y") for i in range(40)]
    probe = CapacityProbe(probe_reqs, clients=4, load=0.5)
    pairs = [(none, reqs), (cost, reqs)]
    timed = virtual_loop.run_until_complete(probe.apply(None, pairs))  # type: ignore[arg-type]
    # 8 requests, 4 at a time, 50 ms each: 80 req/s for none (the basis), 200 for cost
    assert probe.basis == "none" and probe.capacity_rps == probe.throughput["none-x"]
    assert probe.throughput == pytest.approx({"none-x": 80.0, "cost-x": 200.0})
    assert probe.rate == pytest.approx(0.5 * probe.capacity_rps)
    assert none.calls == [(8, 4, False)]  # the probe's requests are not the run's records
    (_, a), (_, b) = timed
    assert [r.t for r in a] == [r.t for r in b] and all(r.t is not None for r in a)
    span = (a[-1].t or 0) - (a[0].t or 0)
    assert 39 / span == pytest.approx(probe.rate, rel=0.5)  # Poisson at that rate
    info = probe.to_json()
    assert info["probe_requests"] == 8 and info["basis"] == "none" and info["load"] == 0.5
    # no none in the batch: the median cluster is the basis
    probe2 = CapacityProbe(probe_reqs, clients=4, load=0.8)
    virtual_loop.run_until_complete(probe2.apply(None, [(cost, reqs)]))  # type: ignore[arg-type]
    assert probe2.basis == "median"


def test_an_emulated_mesh_is_timed_at_its_planned_capacity_without_a_probe(
    virtual_loop: asyncio.AbstractEventLoop,
) -> None:
    # batching engines: the planned capacity is the basis, no probe request is sent
    none = _StubReplay("none", 0.05)
    reqs = [Request(id=f"r{i}", prompt="y") for i in range(40)]
    probe = CapacityProbe([Request(id="p", prompt="x")], clients=4, load=0.8, planned=1000.0)
    ((_, timed),) = virtual_loop.run_until_complete(
        probe.apply(None, [(none, reqs)]))  # type: ignore[arg-type]
    assert none.calls == [] and probe.throughput == {}
    assert (probe.basis, probe.capacity_rps, probe.rate) == (PLANNED, 1000.0, 800.0)
    assert all(r.t is not None for r in timed)
    later = CapacityProbe([], clients=4, load=0.5, earlier=1000.0, planned=1000.0)
    virtual_loop.run_until_complete(later.apply(None, [(none, reqs)]))  # type: ignore[arg-type]
    assert later.basis == PLANNED  # a later batch of the point: still the planned basis


def test_the_planned_capacity_is_the_simulators(tmp_path: Any) -> None:
    """bench's --load on an emulated mesh and sim's --load are one fraction of one figure."""
    reqs = build(WorkloadSpec(kind="rag", requests=60, seed=3), 4)
    tokenize, _ = TOKENIZERS["bytes"]()
    node_costs = profile_costs("h100-llama3-8b:1,a10g-llama3-8b:3", 4)
    want = capacity_rate(node_costs[0], 4, mean_prompt_tokens(reqs, tokenize),
                         reqs[0].max_tokens, None, node_costs)
    assert planned_capacity("h100-llama3-8b:1,a10g-llama3-8b:3", 4, reqs) == want
    one = planned_capacity("a10g-llama3-8b", 1, reqs)
    assert want == pytest.approx(4 * one)  # mixed: what none's even spread sustains
    assert planned_capacity("h100-llama3-8b", 4, reqs) > want


def test_runner_plans_a_probe_workload_under_another_seed(tmp_path: Any) -> None:
    runner = Runner(tmp_path, progress=False, log=lambda _: None, probe_requests=6)
    w = WorkloadSpec(kind="agentic", requests=10, load=0.5, synthetic_scale=0.3)
    spec = RunSpec(name="n", policy="none", workload=w)
    res = runner.plan(spec)
    assert res.mode == "open" and len(res.probe_requests) == 6
    assert all(r.t is None for r in res.requests)  # timed only after the probe
    assert all(p.id.startswith("probe/") for p in res.probe_requests)
    run_prompts = {r.prompt for r in res.requests}
    assert not run_prompts & {p.prompt for p in res.probe_requests}
    # the probe's system prompt differs past the generator's constant rules (another seed)
    a, b = res.requests[0].text, res.probe_requests[0].text
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert shared < len(agentic.RULES) + 40
    entry = summary_entry(res)
    assert entry["workload"] == "agentic" and entry["load_fraction"] == 0.5


# ----------------------------------------------------------------------------- gateways
class _Worker(BaseHTTPRequestHandler):
    """A stand-in for a radixmesh node: the endpoints a gateway uses, the node's headers."""

    def log_message(self, *a: Any) -> None:
        pass

    def _send(self, code: int, body: dict[str, Any], extra: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, {"status": "ok"})
        elif self.path.startswith("/v1/models"):
            self._send(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})
        else:
            self._send(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        name = self.server.server_address[1]  # type: ignore[index]
        choice = {"index": 0, "text": "A", "finish_reason": "length"}
        if self.path == "/v1/chat/completions":
            choice = {"index": 0, "message": {"role": "assistant", "content": "A"},
                      "finish_reason": "length"}  # fmt: skip
        usage = {"prompt_tokens": len(json.dumps(body)), "completion_tokens": 1}
        self._send(200, {"id": "x", "choices": [choice], "usage": usage, "model": body["model"]},
                   {"x-radixmesh-served-by": f"w{name}"})  # fmt: skip


@pytest.fixture()
def workers() -> Iterator[list[str]]:
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _Worker) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    for s in servers:
        s.shutdown()
        s.server_close()


@pytest.mark.parametrize("gateway", [SglangRouter, Smg], ids=["sglang-router", "smg"])
def test_gateway_routes_to_the_workers_and_passes_node_headers(
    gateway: type[SglangRouter] | type[Smg], workers: list[str], tmp_path: Any
) -> None:
    if not gateway.available():
        pytest.skip(gateway.install_hint)
    # two gateways at once: their metrics ports must not clash; one with its time constants
    # stretched as a run at time scale 1,200 stretches them (it must still register and route)
    a = gateway(workers, startup_timeout_s=60, log_path=tmp_path / "a.log", time_scale=1200)
    b = gateway(workers, startup_timeout_s=60)
    try:
        assert a.metrics_port != b.metrics_port
        served = set()
        for i in range(6):
            prompt = f"question {i} " + "shared prefix " * 20 * (i % 2)
            r = httpx.post(a.url + "/v1/completions", timeout=30,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 1})  # fmt: skip
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "A"
            served.add(r.headers["x-radixmesh-served-by"])
        chat = httpx.post(
            b.url + "/v1/chat/completions",
            timeout=30,
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1,
            },
        )
        assert chat.status_code == 200 and chat.headers["x-radixmesh-served-by"].startswith("w")
        assert served <= {f"w{u.rsplit(':', 1)[1]}" for u in workers}
    finally:
        a.close()
        b.close()
    assert (tmp_path / "a.log").exists()


def test_gateway_time_constants_stretch_with_the_time_scale() -> None:
    """SMG's polls, exclusions and timers are passed at its defaults times the time scale (a
    10 s load poll is 12,000 s at time scale 1,200), in whole seconds, never under 1."""
    args = Smg.clock_args(1200)
    pairs = dict(zip(args[::2], args[1::2], strict=True))
    assert pairs["--load-monitor-interval"] == "12000" and pairs["--worker-stall-secs"] == "2400"
    assert Smg.clock_args(1.0)[1::2] == [str(d) for _, d in Smg.clocks]
    assert set(Smg.clock_args(0.01)[1::2]) == {"1"} and SglangRouter.clock_args(1200) == []
    if Smg.available():  # the defaults are smg's own (RouterArgs' fields of the same names)
        from smg.router_args import RouterArgs  # type: ignore[import-not-found, unused-ignore]

        for flag, default_s in Smg.clocks:
            assert getattr(RouterArgs, flag.removeprefix("--").replace("-", "_")) == default_s


def _relay(delay_s: float, targets: Sequence[str]) -> tuple[subprocess.Popen[bytes], list[str]]:
    cmd = [sys.executable, "-m", "radixmesh.bench.linkproxy", "--delay", str(delay_s)]
    for url in targets:
        cmd += ["--to", url.removeprefix("http://")]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    words = proc.stdout.readline().decode().split()
    assert words[0] == "READY" and len(words) == len(targets) + 1
    return proc, [f"http://127.0.0.1:{p}" for p in words[1:]]


def test_link_relay_relays_requests_intact_to_each_worker(workers: list[str]) -> None:
    # the relay process: one port per --to, in order, and it stops when its parent is gone
    # (how long the link takes: the next test, on virtual time)
    proc, urls = _relay(0.01, workers)
    try:
        with httpx.Client(timeout=10) as client:
            for url, worker in zip(urls, workers, strict=True):
                r = client.post(
                    url + "/v1/completions", json={"model": "tiny", "prompt": "x" * 5000}
                )
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == "A"
                assert r.headers["x-radixmesh-served-by"] == f"w{worker.rsplit(':', 1)[1]}"
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # the parent is gone: the relay stops by itself
        assert proc.wait(timeout=10) == 0


async def _front(relay: Any) -> tuple[asyncio.Server, asyncio.Event]:
    """A listening front for ``relay`` (a ``LinkRelay``), and an event set once the relay has
    finished a connection (passed both EOFs on and closed both sides)."""
    relayed = asyncio.Event()

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            await relay.handle(r, w)
        finally:
            relayed.set()

    return await asyncio.start_server(handle, "127.0.0.1", 0), relayed


def test_link_relay_delays_each_way_by_its_own_delay(
    virtual_loop: asyncio.AbstractEventLoop,
) -> None:
    # One relay (as ``--to HOST:PORT=0.1/0.25`` makes) between a client and an upper-casing
    # worker, all on the loop's virtual clock: the request reaches the worker 0.1 s after it
    # was sent, the answer the client 0.25 s after that, and the bytes are intact.
    from radixmesh.bench.linkproxy import LinkRelay
    from radixmesh.core.link import LinkConfig

    async def scenario() -> tuple[bytes, float, float]:
        loop = asyncio.get_running_loop()
        reached: list[float] = []

        async def worker(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            data = await r.readexactly(4096)
            reached.append(loop.time())
            w.write(data.upper())
            await w.drain()
            w.close()

        upstream = await asyncio.start_server(worker, "127.0.0.1", 0)
        port = upstream.sockets[0].getsockname()[1]
        relay = LinkRelay(("127.0.0.1", port, (0.1, 0.25)), LinkConfig(delay_s=0.5), seed=0)
        front, relayed = await _front(relay)
        r, w = await asyncio.open_connection(*front.sockets[0].getsockname()[:2])
        t0 = loop.time()
        w.write(b"ping" * 1024)
        await w.drain()
        answer = await r.read()  # to EOF: the worker closed, and the relay passed it on
        took = loop.time() - t0
        w.close()
        await w.wait_closed()
        await relayed.wait()  # the relay passed our EOF on and closed both sides
        for server in (front, upstream):
            server.close()
            await server.wait_closed()
        return answer, reached[0] - t0, took

    answer, out, took = virtual_loop.run_until_complete(scenario())
    assert answer == b"PING" * 1024
    assert out == pytest.approx(0.1, abs=1e-9)  # its own delay, not the default 0.5
    assert took == pytest.approx(0.1 + 0.25, abs=1e-9)


def test_a_held_link_relay_passes_bytes_at_once_until_armed(
    virtual_loop: asyncio.AbstractEventLoop,
) -> None:
    # A gateway registers its workers through a held relay (SMG's registration steps time out
    # after 10 s, under one round trip between regions at time scale 300): one echo crosses
    # it at once; once armed, the next echo on the same (pooled) connection takes the link's
    # 0.1 s out and 0.25 s back.
    from radixmesh.bench.linkproxy import LinkRelay
    from radixmesh.core.link import LinkConfig

    async def scenario() -> list[float]:
        loop = asyncio.get_running_loop()

        async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            while data := await r.read(4096):
                w.write(data.upper())
                await w.drain()
            w.close()

        upstream = await asyncio.start_server(echo, "127.0.0.1", 0)
        armed = asyncio.Event()
        target = ("127.0.0.1", upstream.sockets[0].getsockname()[1], (0.1, 0.25))
        relay = LinkRelay(target, LinkConfig(delay_s=0.5), seed=0, armed=armed)
        front, relayed = await _front(relay)
        r, w = await asyncio.open_connection(*front.sockets[0].getsockname()[:2])
        took = []
        for _ in range(2):
            t0 = loop.time()
            w.write(b"ping")
            await w.drain()
            assert await r.readexactly(4) == b"PING"
            took.append(loop.time() - t0)
            armed.set()
        w.close()
        await w.wait_closed()
        await relayed.wait()  # our EOF passed on, the worker's back: both sides closed
        for server in (front, upstream):
            server.close()
            await server.wait_closed()
        return took

    took = virtual_loop.run_until_complete(scenario())
    assert took[0] == pytest.approx(0.0, abs=1e-9)
    assert took[1] == pytest.approx(0.1 + 0.25, abs=1e-9)


def test_link_relay_rejects_a_bad_target() -> None:
    from radixmesh.bench.linkproxy import parse_target

    assert parse_target("127.0.0.1:80") == ("127.0.0.1", 80, None)
    for bad in ("127.0.0.1", "host:0", ":80", "host:port"):
        with pytest.raises(argparse.ArgumentTypeError, match="HOST:PORT"):
            parse_target(bad)


@pytest.mark.parametrize("gateway", [SglangRouter, Smg], ids=["sglang-router", "smg"])
def test_gateway_hop_crosses_the_emulated_link(
    gateway: type[SglangRouter] | type[Smg], workers: list[str]
) -> None:
    if not gateway.available():
        pytest.skip(gateway.install_hint)
    # The gateway knows the workers only by the relay's ports, the relay delays by the link's
    # delay (how it delays: the relay's own test), and without the relay no request gets
    # through: its hop crosses the link. (No wall-clock timing: the gateway is a process.)
    g = gateway(workers, startup_timeout_s=60, link_delay_s=0.1)
    try:
        assert g._proc is not None and g._relay is not None
        relay_args = [str(a) for a in g._relay.args]  # type: ignore[union-attr]
        assert relay_args[relay_args.index("--delay") + 1] == "0.1" and "--hold" in relay_args
        args = [str(a) for a in g._proc.args]  # type: ignore[union-attr]
        routed = args[args.index("--worker-urls") + 1 : args.index("--prometheus-host")]
        assert len(routed) == len(workers) and not set(routed) & set(workers)
        with httpx.Client(timeout=30) as client:
            for i in range(3):
                body = {"model": "tiny", "prompt": f"q{i}", "max_tokens": 1}
                r = client.post(g.url + "/v1/completions", json=body)
                assert r.status_code == 200 and r.headers["x-radixmesh-served-by"].startswith("w")
            g._relay.terminate()
            assert g._relay.wait(timeout=10) is not None
            body = {"model": "tiny", "prompt": "after", "max_tokens": 1}
            assert client.post(g.url + "/v1/completions", json=body).status_code != 200
    finally:
        g.close()
    assert g._relay is not None and g._relay.poll() is not None  # stopped with the gateway


def test_gateway_that_exits_reports_its_error(workers: list[str]) -> None:
    if not Smg.available():
        pytest.skip(Smg.install_hint)

    class Broken(Smg):
        def command(self, port: int, workers: Sequence[str]) -> list[str]:
            return [*super().command(port, workers), "--policy", "no_such_policy"]

    with pytest.raises(RuntimeError, match="smg exited"):
        Broken(workers, startup_timeout_s=30)


class _FakeCluster:
    def __init__(self, name: str, events: list[str], fail: bool) -> None:
        self.name, self.events, self.fail = name, events, fail
        events.append(f"spawn {name}")

    @property
    def urls(self) -> list[str]:
        return ["http://127.0.0.1:1"]

    @property
    def node_ids(self) -> list[str]:
        return ["n0"]

    def wait_ready(self) -> None:
        self.events.append(f"ready {self.name}")
        if self.fail:
            raise RuntimeError(f"{self.name} never became ready")

    def close(self) -> None:
        self.events.append(f"close {self.name}")


def test_batch_clusters_spawn_together_and_failures_close_every_one(tmp_path: Any) -> None:
    events: list[str] = []
    failing = {"b"}

    def factory(spec: RunSpec) -> _FakeCluster:
        return _FakeCluster(spec.name, events, spec.name in failing)

    runner = Runner(tmp_path, cluster_factory=factory, progress=False, log=lambda _: None)
    todo = [(RunResult(RunSpec(name=n, policy="none")), n) for n in ("a", "b", "c")]
    live: list[Any] = []
    with (tmp_path / "r.jsonl").open("w") as fh, pytest.raises(RuntimeError, match="b never"):
        runner._start_all(todo, fh, True, live)
    # every cluster is spawned before the first is waited for (they boot at the same time)
    assert events[:3] == ["spawn a", "spawn b", "spawn c"]
    assert events[3:] == ["ready a", "ready b", "close b", "close c"]
    assert [res.spec.name for res, *_ in live] == ["a"]  # the caller stops what is live
    events.clear()
    failing.clear()
    live.clear()
    with (tmp_path / "r.jsonl").open("w") as fh:
        runner._start_all(todo, fh, True, live)
    assert [res.spec.name for res, *_ in live] == ["a", "b", "c"] and "close a" not in events


def test_the_paper_sweeps_poll_group_polls_only() -> None:
    """Δpoll means the paper's polling only with announcements off: they would spread every
    cache change within their gap whatever Δpoll is. The other batches keep the default."""
    specs = plan.specs_from_args(bench_args("--sweep", "paper", "--only", "t1,poll"))
    poll = [s for s in specs if s.group == "poll"]
    rest = [s for s in specs if s.group != "poll"]
    assert len({s.gossip_interval_s for s in poll}) == 4 and rest
    assert all(s.gossip_announce_s is None for s in poll)
    assert all(s.gossip_announce_s == GossipConfig().announce_gap_s for s in rest)


def test_a_resumed_sweep_is_timed_at_the_capacity_its_first_attempt_measured(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The first attempt's probe measures 100 req/s, then the run is cut short (Ctrl-C); the
    # resumed run's probe would measure 70 (another moment of a shared machine): the runs of
    # one point must meet one rate, so it is timed at 100's share all the same.
    measured = iter([100.0, 70.0, 70.0])
    interrupt = [True]

    async def measure(self: CapacityProbe, http: Any, r: Any) -> float:
        return next(measured)

    async def together(pairs: Any, mode: str, probe: CapacityProbe | None = None,
                       started: Any = None) -> Any:  # replay_together's probe, then the run
        assert probe is not None
        ran = await probe.apply(None, pairs)
        if interrupt and interrupt.pop():
            raise KeyboardInterrupt
        return ran

    monkeypatch.setattr(CapacityProbe, "_measure", measure)
    monkeypatch.setattr(runner_mod, "replay_together", together)
    w = WorkloadSpec(kind="chat", requests=6, load=0.5, synthetic_scale=0.3)
    specs = [RunSpec(name=p, policy=p, nodes=1, workload=w) for p in ("none", "cost")]

    def sweep(skip_done: bool) -> dict[str, Any]:
        runner = Runner(tmp_path, cluster_factory=lambda s: _FakeCluster(s.name, [], False),
                        progress=False, log=lambda _: None, probe_requests=4)
        runner.run_all(specs[:1] if interrupt else specs, skip_done=skip_done)
        return {r["name"]: r for r in json.loads((tmp_path / "summary.json").read_text())["runs"]}

    first = sweep(False)
    assert first["none"]["interrupted"]
    resumed = sweep(True)
    assert not resumed["none"]["interrupted"]
    for name in ("none", "cost"):
        assert resumed[name]["capacity"]["capacity_rps"] == 100.0, name
        assert resumed[name]["capacity"]["rate"] == pytest.approx(50.0)
    assert resumed["cost"]["capacity"]["throughput_rps"] == {"cost": 70.0}  # still measured
    kept = Capacities.load(tmp_path / runner_mod.CAPACITY_FILE)
    assert list(kept.known.values()) == [100.0]
    (tmp_path / runner_mod.CAPACITY_FILE).write_text("[1, 2]")  # not ours: said, measured anew
    with pytest.raises(ValueError, match=r"capacity\.json: not a capacity file"):
        Capacities.load(tmp_path / runner_mod.CAPACITY_FILE)
    logged: list[str] = []
    runner = Runner(tmp_path, progress=False, log=logged.append)
    assert runner.run_all([], skip_done=True) == [] and "measured anew" in logged[0]


def test_an_emulated_point_resumed_across_the_load_basis_change_is_flagged() -> None:
    spec = RunSpec(name="n", policy="none", engine="emulated", profiles="h100-llama3-8b",
                   nodes=4, workload=WorkloadSpec(kind="rag", requests=20, load=0.8))
    reqs = build(spec.workload, 4)
    said: list[str] = []
    planned = planned_capacity("h100-llama3-8b", 4, reqs)
    probe = timing_probe(spec, reqs, reqs[:4], 0.8, planned, 16, said.append)
    assert (probe.planned, probe.clients, said) == (planned, 4, [])  # the same basis: quiet
    timing_probe(spec, reqs, reqs[:4], 0.8, 100.0, 16, said.append)  # a probe's, earlier
    assert len(said) == 1 and "100.00 req/s" in said[0]
    plain = replace(spec, engine="builtin", profiles="")
    assert timing_probe(plain, reqs, reqs[:4], 0.8, None, 16, said.append).planned is None


def test_a_run_keeps_the_capacities_another_attempt_wrote_without_using_them(
    tmp_path: Any,
) -> None:
    path = tmp_path / runner_mod.CAPACITY_FILE
    Capacities(path).remember('{"a": 1}', 100.0)  # an earlier attempt's point
    later = Capacities(path)  # a run not resumed: measures its own
    later.remember('{"b": 2}', 50.0)
    assert later.get('{"a": 1}') is None  # not used to time this run
    assert Capacities.load(path).known == {'{"a": 1}': 100.0, '{"b": 2}': 50.0}
