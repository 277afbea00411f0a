"""Three emulated hosts (Linux network namespaces on one bridge), one ``radixmesh serve`` each.

Every node binds its own host's address (10.213.0.11-13, port 8000 on each) and is given ONE
seed, h1; the rest is learnt by gossip over real veth links. The test process talks to the
nodes from the root namespace (``radixmesh.testing.netns``: one veth into the bridge). Checks,
in order on the same mesh:

1. membership converges: every node lists the other two alive (h2 and h3 only knew h1);
2. a prefix cached on h1 is found from h3: the request sent to h3 is served by h1 (policy
   ``paper``: argmax of the estimated prefix match, independent of speed estimates);
3. SIGTERM of h2, the forward target of a hot prefix, while h1 and h3 take requests: nothing
   fails, h2 exits 0 within its drain grace;
4. a partition (h3's bridge port down) and its heal: h1 marks h3 suspect, then alive again.

Needs root and ``ip netns`` (skipped otherwise, with the reason); CI runs it as root. Figures
(time to converged membership, drain, suspicion) are printed, never asserted; every wait is
bounded. Namespaces, veths and processes are removed afterwards, also on failure, and the
fixture checks that nothing carrying the run's tag is left.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from radixmesh.testing.netns import (
    EmulatedHosts,
    NetnsUnavailable,
    leftovers,
    netns_unavailable,
    reap_stale,
)

if TYPE_CHECKING:
    from conftest import Load, Poll

pytestmark = pytest.mark.slow

HOSTS = ("h1", "h2", "h3")
PORT = 8000
GRACE_S = 10.0  # h2's --drain-grace
START_TIMEOUT_S = 90.0  # three torch processes on a shared 2-core box
HOP = {"x-radixmesh-hop": "1"}  # execute on the receiving node, never forward
PREFIX = ("The following are multiple choice questions (with answers) about emulated "
          "networks, veth pairs and bridges. ") * 5


def serve_command() -> list[str]:
    script = Path(sys.executable).parent / "radixmesh"
    return [str(script)] if script.exists() else [sys.executable, "-m", "radixmesh.cli"]


def serve_argv(net: EmulatedHosts, host: str) -> list[str]:
    return [*serve_command(), "serve", "--host", net.address(host), "--port", str(PORT),
            "--node-id", host, "--preset", "tiny", "--threads", "1",
            "--gossip-interval", "0.2", "--join", f"{net.address('h1')}:{PORT}",
            "--policy", "paper", "--drain-grace", str(GRACE_S), "--dead-timeout", "30"]


@dataclass
class Mesh:
    net: EmulatedHosts
    procs: dict[str, Any]
    started: float  # time.monotonic() when the processes were spawned
    logs: Path
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=30,
                                                                    trust_env=False))
    expected_up: tuple[str, ...] = HOSTS  # a node of these that exits fails the wait

    def url(self, host: str) -> str:
        return f"http://{self.net.address(host)}:{PORT}"

    def mesh(self, host: str) -> dict[str, Any] | None:
        try:
            resp = self.http.get(self.url(host) + "/mesh", timeout=2)
        except httpx.HTTPError:
            return None
        return resp.json() if resp.status_code == 200 else None

    def peer(self, host: str, peer: str) -> dict[str, Any] | None:
        mesh = self.mesh(host)
        for entry in (mesh or {}).get("peers", []):
            if entry.get("node_id") == peer:
                return dict(entry)
        return None

    def alive(self, host: str) -> set[str]:
        mesh = self.mesh(host) or {}
        return {p["node_id"] for p in mesh.get("peers", []) if p.get("state") == "alive"}

    def complete(self, host: str, prompt: str, headers: dict[str, str] | None = None
                 ) -> httpx.Response:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
        return self.http.post(self.url(host) + "/v1/completions", json=body,
                              headers=headers or {})

    def view_current(self, host: str, peer: str) -> bool:
        """``host``'s estimate of ``peer``'s cache is at ``peer``'s own summary version."""
        own, entry = self.mesh(peer), self.peer(host, peer)
        return (own is not None and entry is not None and entry["view_blocks"] > 0
                and entry["view_version"] == own["version"])

    def check_up(self) -> None:
        """Fail at once, with its log, if a host that should be up has exited."""
        for host, proc in self.procs.items():
            if proc.poll() is not None and host in self.expected_up:
                raise AssertionError(f"{host} exited (rc {proc.returncode}):\n"
                                     f"{self.log_tail(host)}")

    def log_tail(self, host: str, lines: int = 25) -> str:
        path = self.logs / f"{host}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(f"emulated hosts need Linux network namespaces: {reason}")
    stale = reap_stale()  # namespaces of an earlier run that was killed before its tear-down
    if stale:
        print(f"\n[emulated hosts] deleted stale namespaces: {stale}")
    logs = tmp_path_factory.mktemp("netns-logs")
    net = EmulatedHosts(HOSTS)
    try:
        net.setup()
    except NetnsUnavailable as exc:
        net.teardown()
        pytest.skip(str(exc))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RADIXMESH_CLUSTER_KEY", None)
    m: Mesh | None = None
    try:
        started = time.monotonic()
        procs = {h: net.spawn(h, serve_argv(net, h), logs / f"{h}.log", env=env) for h in HOSTS}
        m = Mesh(net, procs, started, logs)
        yield m
    finally:
        if m is not None:
            m.http.close()
        net.teardown()
        left = leftovers(net.tag)
        print(f"\n[emulated hosts] tear-down: leftovers with tag {net.tag!r}: {left or 'none'}")
        assert not left, left


def test_membership_converges_through_one_seed(mesh: Mesh, poll: Poll) -> None:
    others = {h: set(HOSTS) - {h} for h in HOSTS}
    poll.until(lambda: all(mesh.alive(h) >= others[h] for h in HOSTS),
               "every node to list the other two alive", START_TIMEOUT_S, watch=mesh.check_up)
    converged = time.monotonic() - mesh.started
    print(f"\n[emulated hosts] start -> converged membership: {converged:.1f} s")
    for host in HOSTS:  # learnt by gossip: h2 and h3 were told only h1's address
        for peer in others[host]:
            entry = mesh.peer(host, peer)
            assert entry is not None and entry["address"] == f"{mesh.net.address(peer)}:{PORT}"
        assert (mesh.mesh(host) or {}).get("seeds") == []


def test_a_prefix_cached_on_h1_is_served_by_h1_when_asked_at_h3(mesh: Mesh, poll: Poll) -> None:
    first = mesh.complete("h1", PREFIX + "Question: what does a bridge forward?", HOP)
    assert first.status_code == 200, first.text
    assert first.headers["x-radixmesh-served-by"] == "h1"
    poll.until(lambda: mesh.view_current("h3", "h1"),
               "h3 to learn h1's cache", 15, watch=mesh.check_up)
    second = mesh.complete("h3", PREFIX + "Question: what does a veth pair carry?")
    assert second.status_code == 200, second.text
    served, route = second.headers["x-radixmesh-served-by"], second.headers["x-radixmesh-route"]
    cached = int(second.headers["x-radixmesh-cached-tokens"])
    print(f"\n[emulated hosts] asked h3: served by {served}, route {route}, {cached} cached")
    assert (served, route) == ("h1", "forwarded")
    assert cached > 0


def test_sigterm_of_a_forward_target_fails_nothing(mesh: Mesh, poll: Poll,
                                                   load_thread: type[Load]) -> None:
    hot = PREFIX.replace("emulated", "draining")

    def host(i: int) -> str:  # requests to h1 and h3 in turn, all sharing h2's hot prefix
        return ("h1", "h3")[i % 2]

    def ask(i: int) -> tuple[int, str, str]:  # (status, served by, route)
        resp = mesh.complete(host(i), f"{hot}Question {i}: which link?")
        return (resp.status_code, resp.headers.get("x-radixmesh-served-by", ""),
                resp.headers.get("x-radixmesh-route", ""))

    assert mesh.complete("h2", hot + "Warm-up.", HOP).status_code == 200  # h2 caches it
    poll.until(lambda: mesh.view_current("h1", "h2") and mesh.view_current("h3", "h2"),
               "h1 and h3 to learn h2's cache", 15, watch=mesh.check_up)
    with load_thread(ask, 200, host) as load:
        poll.until(lambda: len(load.results) >= 4,
                   "the load to run", 30, watch=mesh.check_up)
        before = len(load.results)
        t0 = time.monotonic()
        mesh.expected_up = ("h1", "h3")
        mesh.procs["h2"].send_signal(signal.SIGTERM)
        rc = mesh.procs["h2"].wait(GRACE_S + 10)
        drained = time.monotonic() - t0
        n = len(load.results)
        poll.until(lambda: len(load.results) >= n + 4,
                   "requests after h2 left", 30, watch=mesh.check_up)
    results = list(load.results)
    to_h2 = sum(1 for _, served, _ in results[:before] if served == "h2")
    draining = dict(Counter(f"{served}/{route}" for _, served, route in results[before:n]))
    print(f"\n[emulated hosts] SIGTERM h2: exit rc {rc} after {drained:.1f} s "
          f"(grace {GRACE_S:.0f} s); {len(results)} requests, {to_h2}/{before} served by h2 "
          f"before the signal, during the drain {draining}, errors {len(load.errors)}")
    assert rc == 0, mesh.log_tail("h2")
    assert load.errors == [], load.errors
    assert {status for status, _, _ in results} == {200}, results
    assert to_h2 > 0  # h2 really was a forward target when it left
    assert all(served in ("h1", "h3") for _, served, _ in results[n:])


def test_partition_and_heal_of_h3(mesh: Mesh, poll: Poll) -> None:
    mesh.expected_up = ("h1", "h3")
    poll.until(lambda: "h3" in mesh.alive("h1"),
               "h1 to see h3 alive", 15, watch=mesh.check_up)
    t0 = time.monotonic()
    mesh.net.link_down("h3")
    try:
        poll.until(lambda: (mesh.peer("h1", "h3") or {}).get("state") == "suspect",
                   "h1 to suspect h3", 15, watch=mesh.check_up)
        suspected = time.monotonic() - t0
        during = mesh.complete("h1", "A request while h3 is cut off. " * 4)
        assert during.status_code == 200 and during.headers["x-radixmesh-served-by"] == "h1"
    finally:
        mesh.net.link_up("h3")
    t1 = time.monotonic()
    poll.until(lambda: (mesh.peer("h1", "h3") or {}).get("state") == "alive",
               "h1 to see h3 alive again", 15, watch=mesh.check_up)
    healed = time.monotonic() - t1
    poll.until(lambda: "h1" in mesh.alive("h3"),
               "h3 to see h1 alive again", 15, watch=mesh.check_up)
    print(f"\n[emulated hosts] partition: h1 suspected h3 after {suspected:.2f} s; "
          f"alive again {healed:.2f} s after the heal")
