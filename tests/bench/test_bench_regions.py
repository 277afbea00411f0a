"""Regions on the real-process mesh (bench/regions.py): who pays which one-way delay."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import httpx
import pytest

from radixmesh.bench import client
from radixmesh.bench.launcher import per_node_options
from radixmesh.bench.linkproxy import LinkRelay, parse_target
from radixmesh.bench.regions import Regions
from radixmesh.bench.replay import Replay
from radixmesh.bench.spec import RunSpec
from radixmesh.core.link import LinkConfig
from radixmesh.results.records import Record
from radixmesh.runtime.config import config_from_mapping
from radixmesh.runtime.netem import Netem, format_peer_delays, parse_peer_delays
from radixmesh.workload import Request

MATRIX = "1,40,90;41,1,120;91,121,2"  # asymmetric on purpose: row = from


def regions() -> Regions:
    got = Regions.parse("us,eu,ap", MATRIX)
    assert got is not None
    return got


def test_nodes_live_round_robin_and_pay_the_matrix_each_way() -> None:
    r = regions()
    assert [r.names[r.of(i)] for i in range(5)] == ["us", "eu", "ap", "us", "eu"]
    assert r.between(0, 1) == (0.040, 0.041) and r.between(2, 2) == (0.002, 0.002)
    addresses = [f"127.0.0.1:{9000 + i}" for i in range(4)]
    delays = parse_peer_delays(r.peer_delays(1, addresses, scale=10.0))
    assert set(delays) == {addresses[0], addresses[2], addresses[3]}  # not itself
    assert delays[addresses[0]] == pytest.approx((0.41, 0.40))  # eu -> us, us -> eu, x10
    assert delays[addresses[2]] == pytest.approx((1.20, 1.21))


def test_clients_enter_in_every_region_and_gateways_stand_in_the_first() -> None:
    r = regions()
    assert r.client_link(2, gateway=False) == (0.002, 0.002)  # an ap client to an ap node
    assert r.client_link(2, gateway=True) == (0.091, 0.090)  # ... to the gateway in us
    assert r.gateway_links(3) == [(0.001, 0.001), (0.040, 0.041), (0.090, 0.091)]


@pytest.mark.parametrize(("names", "matrix", "says"), [
    ("us,eu", "", "needs --region-delays"),
    ("", "1,2;2,1", "needs --regions"),
    ("us,eu", MATRIX, "must be 2x2"),
    ("us,eu", "1,x;2,1", "--region-delays"),
])
def test_bad_regions_are_refused_naming_the_flag(names: str, matrix: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        RunSpec(name="r", policy="none", regions=names, region_delays=matrix)


def test_each_node_is_started_with_its_delay_to_every_peer() -> None:
    spec = RunSpec(name="r", policy="cost", nodes=3, regions="us,eu,ap", region_delays=MATRIX)
    addresses = [f"127.0.0.1:{9100 + i}" for i in range(3)]
    opts = per_node_options(spec, addresses)
    for i in range(3):  # every node's flag is one `serve` takes
        config = config_from_mapping({"port": 9100 + i, **opts[i]})
        assert parse_peer_delays(config.net_peer_delays) == parse_peer_delays(
            spec.region_map.peer_delays(i, addresses) if spec.region_map else "")
    assert per_node_options(RunSpec(name="r", policy="cost", nodes=3)) == {}
    with pytest.raises(ValueError, match="address"):
        per_node_options(spec)


def test_peer_delays_round_trip_and_bad_ones_are_named() -> None:
    links = {"10.0.0.1:8001": (0.04, 0.041), "10.0.0.2:8001": (0.0, 0.25)}
    assert parse_peer_delays(format_peer_delays(links)) == links
    assert parse_peer_delays("h:1=40ms") == {"h:1": (0.04, 0.04)}
    for bad in ("h:1", "=40ms", "h:1=soon", "h:1=-1"):
        with pytest.raises(ValueError, match="net_peer_delays"):
            parse_peer_delays(bad)


def test_netem_uses_a_peers_own_delay_each_way_and_the_flat_one_for_the_rest() -> None:
    netem = Netem(LinkConfig(delay_s=0.002, jitter_s=0.001), seed=3,
                  peers={"a:1": (0.040, 0.090)})
    rng = random.Random(3)  # the same draws as the netem's own stream
    assert netem.one_way_delay("a:1") == pytest.approx(0.040 + 0.001 * rng.random())
    assert netem.one_way_delay("a:1", back=True) == pytest.approx(0.090 + 0.001 * rng.random())
    assert netem.one_way_delay("b:1") == pytest.approx(0.002 + 0.001 * rng.random())
    assert netem.one_way_delay() == pytest.approx(0.002 + 0.001 * rng.random())


def test_a_peer_with_its_own_delay_is_delayed_even_when_the_flat_link_is_not() -> None:
    now = [0.0]  # the netem's clock, advanced only by its sleeps
    netem = Netem(LinkConfig(), peers={"a:1": (0.0, 0.0), "b:1": (0.01, 0.01)},
                  clock=lambda: now[0])
    slept: list[float] = []

    async def main() -> None:
        real = asyncio.sleep

        async def fake(s: float) -> None:
            slept.append(s)
            now[0] += s
            await real(0)

        asyncio.sleep = fake  # type: ignore[assignment]
        try:
            await netem.delay("a:1")
            await netem.delay("b:1")
            await netem.delay()
        finally:
            asyncio.sleep = real

    asyncio.run(main())
    assert slept == [0.01]


def test_the_gateway_relay_takes_each_workers_own_delays() -> None:
    assert parse_target("127.0.0.1:8001") == ("127.0.0.1", 8001, None)
    assert parse_target("127.0.0.1:8001=40ms/0.09") == ("127.0.0.1", 8001, (0.04, 0.09))
    relay = LinkRelay(parse_target("h:1=40ms/90ms"), LinkConfig(delay_s=0.002), seed=0)
    assert (relay.config.delay_s, relay.back.delay_s) == (0.04, 0.09)
    flat = LinkRelay(parse_target("h:1"), LinkConfig(delay_s=0.002), seed=0)
    assert (flat.config.delay_s, flat.back.delay_s) == (0.002, 0.002)


def _stream(request: httpx.Request) -> httpx.Response:
    body = (b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
            b'data: {"choices":[{"index":0,"text":"b"}]}\n\n'
            b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
            b"data: [DONE]\n\n")
    return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})


def test_a_distant_client_pays_its_way_there_before_and_back_after() -> None:
    slept: list[float] = []

    async def main() -> Record:
        real = asyncio.sleep

        async def fake(s: float) -> None:
            slept.append(s)
            await real(0)

        rec = Record(run="r", policy="none", seq=0, id="x", group=None, entry=0,
                     entry_node="n0", t_send=0.0)
        asyncio.sleep = fake  # type: ignore[assignment]
        try:
            async with httpx.AsyncClient(transport=httpx.MockTransport(_stream)) as http:
                return await client.send(http, "http://n0", "m", Request(id="x", prompt="p"),
                                         rec, 0.0, link=(0.04, 0.09))
        finally:
            asyncio.sleep = real

    rec = asyncio.run(main())
    assert slept == [0.04, 0.09] and rec.ok and rec.output == "ab"
    assert rec.ttft_s is not None and rec.ttft_s >= 0.09  # its first token came back too


def test_replay_gives_each_client_its_regions_link_in_the_meshs_time() -> None:
    spec = RunSpec(name="r", policy="none", nodes=3, regions="us,eu,ap", region_delays=MATRIX)

    class Cluster:
        urls = ("http://a", "http://b", "http://c")
        node_ids = ("a", "b", "c")

        def close(self) -> None: ...

    replay = Replay(spec, Cluster(), lambda rec: None)
    assert replay.client_link(1) == (0.001, 0.001)
    replay.router = object()  # type: ignore[assignment]  # through a gateway in us
    assert replay.client_link(1) == (0.041, 0.040)
    flat = Replay(RunSpec(name="r", policy="none", nodes=3), Cluster(), lambda rec: None)
    assert flat.client_link(1) is None


def test_the_gateway_reaches_each_worker_from_its_region_in_the_meshs_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from radixmesh.bench import runner

    got: dict[str, object] = {}

    class FakeGateway:
        def __init__(self, urls: list[str], **kw: object) -> None:
            got.update(kw)

    monkeypatch.setitem(runner.GATEWAYS, "smg", FakeGateway)
    spec = RunSpec(name="r", policy="smg", nodes=3, regions="us,eu,ap", region_delays=MATRIX,
                   engine="emulated", profiles="h100-llama3-8b", time_scale=10.0)
    replay = SimpleNamespace(router=None)
    cluster = SimpleNamespace(urls=["http://a", "http://b", "http://c"])
    runner.Runner._attach_baseline(replay, spec, cluster)  # type: ignore[arg-type]
    assert got["links"] == [pytest.approx((0.01, 0.01)), pytest.approx((0.40, 0.41)),
                            pytest.approx((0.90, 0.91))]
    assert got["link_delay_s"] == pytest.approx(0.02)  # the flat --net-delay, scaled too


def test_run_names_say_the_regions() -> None:
    import argparse

    from radixmesh.bench import cli, plan

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(["--regions", "us,eu", "--region-delays", "1,40;40,1", "--nodes", "2",
                         "--policy", "none"])
    [spec] = plan.specs_from_args(args)
    assert spec.name.endswith("-Rus+eu") and spec.region_map is not None
