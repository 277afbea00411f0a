"""Leaving and joining on real processes (127.0.0.1): SIGTERM drains a node while the mesh keeps
answering, and a node joins through a DNS name ("localhost", no test resolver needed)."""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from radixmesh.runtime.cluster import LocalCluster
from radixmesh.runtime.config import (
    ServeConfig,
    config_from_args,
    config_from_mapping,
)
from radixmesh.runtime.metrics import parse_samples
from radixmesh.runtime.node import socket_addresses
from test_cli_flags import command_args

if TYPE_CHECKING:
    from conftest import Load, Poll

HOP = {"x-radixmesh-hop": "1"}  # execute on the receiving node, never forward
GRACE_S = 12.0  # n1's --drain-grace: its in-flight request needs ~2 s of it
OPTIONS = {"gossip_interval": 0.1, "suspect_timeout": 0.5, "dead_timeout": 3.0,
           "forward_timeout": 2.0, "policy": "cost", "preset": "tiny"}  # byte tokens

serve_args = partial(command_args, "serve")  # `radixmesh serve ARGS...`'s flags


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    per_node = {1: {"debug_engine_delay": 1.5, "drain_grace": GRACE_S}}  # n1: slow, leaves
    with LocalCluster(3, OPTIONS, per_node=per_node, ready_timeout=60,
                      log_dir=tmp_path_factory.mktemp("leave-logs")) as c:
        yield c


def complete(url: str, prompt: str, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, headers=headers or {}, timeout=30)


def alive_ids(c: LocalCluster, node: int) -> set[str]:
    return {p["node_id"] for p in c.mesh(node)["peers"] if p["state"] == "alive"}


# ------------------------------------------------------------------------- flags (fast)
def test_join_is_the_name_and_peers_the_alias(tmp_path: Any) -> None:
    seeds = ("10.0.0.1:8001", "10.0.0.2:8001")
    assert config_from_args(serve_args("--join", ",".join(seeds))).peers == seeds
    assert config_from_args(serve_args("--peers", ",".join(seeds))).peers == seeds
    toml = tmp_path / "node.toml"
    toml.write_text('join = ["10.0.0.1:8001", "10.0.0.2:8001"]\n')
    assert config_from_args(serve_args("--config", str(toml))).peers == seeds
    with pytest.raises(ValueError, match="set twice"):
        config_from_mapping({"join": ["a:1"], "peers": ["b:1"]})
    with pytest.raises(ValueError):
        config_from_mapping({"join": "no-port"})


def test_join_dns_drain_and_advertise_flags() -> None:
    cfg = config_from_args(serve_args("--join-dns", "mesh.internal", "--port", "8005",
                                      "--join-dns-interval", "10s", "--drain-grace", "5s"))
    assert cfg.join_dns_target == ("mesh.internal", 8005)  # our port when none is given
    assert (cfg.join_dns_interval, cfg.drain_grace) == (10.0, 5.0)
    assert ServeConfig(join_dns="mesh.internal:9000").join_dns_target == ("mesh.internal", 9000)
    assert ServeConfig().drain_grace == 30.0 and ServeConfig().join_dns_interval == 30.0
    for bad in ("mesh:port", "mesh:0", "two words", ":80"):
        with pytest.raises(ValueError):
            ServeConfig(join_dns=bad)
    with pytest.raises(ValueError, match="--advertise"):
        ServeConfig(host="0.0.0.0")
    cfg = ServeConfig(host="0.0.0.0", port=8001, advertise="10.1.2.3:8001")
    assert cfg.address == "10.1.2.3:8001"
    assert ServeConfig(host="127.0.0.2", port=8001).address == "127.0.0.2:8001"
    for bad in ("10.1.2.3", "a:1,b:2"):
        with pytest.raises(ValueError):
            ServeConfig(advertise=bad)


def test_socket_addresses_from_getaddrinfo_answers() -> None:
    v4 = (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", 8001))
    v6 = (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::1", 8001, 0, 0))
    assert socket_addresses([v4, v6, v4]) == ["10.0.0.1:8001", "[fd00::1]:8001"]
    found = socket_addresses(socket.getaddrinfo("localhost", 8001, 0, socket.SOCK_STREAM))
    assert "127.0.0.1:8001" in found


# ------------------------------------------------------------------ real processes (slow)
@pytest.mark.slow
def test_a_node_joins_through_a_dns_name(
    cluster: LocalCluster, tmp_path: Any, poll: Poll
) -> None:
    options = {**OPTIONS, "join_dns": f"localhost:{cluster.nodes[0].port}",
               "join_dns_interval": 1.0}
    with LocalCluster(1, options, node_ids=["dns"], ready_timeout=60, log_dir=tmp_path) as d:
        poll.until(lambda: alive_ids(d, 0) >= {"n0", "n1", "n2"}, "dns to see n0, n1, n2", 20)
        poll.until(lambda: "dns" in alive_ids(cluster, 2), "n2 to learn of dns", 10)
        metrics = d.get(0, "/metrics").text
        assert "join_dns_resolutions" in metrics
        d.kill(0, signal.SIGTERM)  # nothing in flight: a drain that ends at once, exit 0
        proc = d.nodes[0].process
        assert proc is not None and proc.wait(15) == 0


@pytest.mark.slow
def test_sigterm_drains_in_flight_work_while_the_mesh_keeps_answering(
    cluster: LocalCluster, poll: Poll, load_thread: type[Load]
) -> None:
    result: dict[str, httpx.Response] = {}
    slow = threading.Thread(target=lambda: result.update(r=complete(
        cluster.url(1), "A long question for the leaving node. " * 20, HOP)))
    urls = [cluster.url(0), cluster.url(2)]  # a client of n0 and n2 (never n1)

    def ask(i: int) -> int:
        return complete(urls[i % 2], f"Question {i}: what is the answer? " * 8).status_code

    with load_thread(ask, 500) as load:
        poll.until(lambda: len(load.results) >= 3, "the client load to run", 30)
        slow.start()
        poll.until(lambda: _local_requests(cluster, 1) >= 1,  # this one, not a forward
                   "n1 to be serving the request", 10)
        cluster.kill(1, signal.SIGTERM)
        health = poll.until(lambda: _leaving(cluster), "n1 to report leaving", 5)
        assert health.status_code == 503
        for peer in (0, 2):  # told by gossip, at once: pushed back for about the grace
            poll.until(lambda p=peer: (_pushback(cluster, p) or 0) > GRACE_S / 2,
                       f"n{peer} to see n1's push-back", 3)
        during = complete(cluster.url(1), "A new request while n1 drains. " * 8)
        assert during.status_code == 200 and during.headers["x-radixmesh-served-by"] != "n1"
        slow.join(GRACE_S)
        assert not slow.is_alive(), "n1's in-flight request did not finish within the grace"
        proc = cluster.nodes[1].process
        assert proc is not None and proc.wait(GRACE_S + 5) == 0  # a clean exit once drained
        before = len(load.results)
        poll.until(lambda: len(load.results) >= before + 3, "requests after n1 left", 30)
    assert result["r"].status_code == 200, result["r"].text
    assert result["r"].headers["x-radixmesh-served-by"] == "n1"  # finished where it ran
    assert load.errors == [] and set(load.results) == {200}, (load.errors, load.results)


def _local_requests(c: LocalCluster, node: int) -> float:
    """Client requests ``node`` started locally (``radixmesh_requests_total{route="local"}``)."""
    samples = parse_samples(c.get(node, "/metrics").text)
    return samples.get('radixmesh_requests_total{route="local"}', 0.0)


def _leaving(c: LocalCluster) -> httpx.Response | None:
    resp = c.get(1, "/health")
    return resp if resp.json()["status"] == "leaving" else None


def _pushback(c: LocalCluster, node: int) -> float | None:
    entry = c.peer_entry(node, 1)
    return None if entry is None else entry["pushback_remaining_s"]
