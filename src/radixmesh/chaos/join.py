"""Operating figure: how long a node takes to join a mesh of emulated hosts.

``radixmesh chaos --operate join --hosts 4,16`` (see ``chaos/cli.py``); prints its figures and
returns a JSON-able report. Nothing here asserts a timing: this is a benchmark.

Theory of operation (emulated hosts, root only)
-----------------------------------------------
N hosts (Linux network namespaces on one bridge, ``testing/netns.py``), one
``radixmesh serve`` per host bound to the host's own address, every node given ONE seed
(h1). N-1 nodes start, each executes one request (so every node has a cache view worth
sending), and the mesh converges. Then the N-th node starts, and we measure from its spawn
to (1) ``/health`` answering (process start, model build) and (2) a converged view: every
node lists every other node alive, with its current incarnation and ``view_version`` equal
to that node's own summary version (``GET /mesh``). Repeated ``trials`` times: the new
node is stopped with SIGTERM and started again (a new incarnation) each time.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from radixmesh.chaos.env import HOP


@dataclass(frozen=True, slots=True)
class JoinScenario:
    hosts: int = 4
    preset: str = "micro"
    trials: int = 3
    gossip_interval: float = 0.5  # the default (GossipConfig.lan)
    port: int = 8000
    start_timeout_s: float = 600.0  # N torch processes starting on a shared 2-core box
    converge_timeout_s: float = 120.0
    poll_s: float = 0.1


def _serve_argv(net: Any, host: str, cfg: JoinScenario) -> list[str]:
    script = Path(sys.executable).parent / "radixmesh"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "radixmesh.cli"]
    return [*cmd, "serve", "--host", net.address(host), "--port", str(cfg.port),
            "--node-id", host, "--preset", cfg.preset, "--threads", "1",
            "--gossip-interval", str(cfg.gossip_interval),
            "--join", f"{net.address('h1')}:{cfg.port}", "--drain-grace", "5s",
            "--dead-timeout", "60"]


class _Meshes:
    """``GET /mesh`` of every host, and the convergence test over them."""

    def __init__(self, net: Any, port: int) -> None:
        self.net, self.port = net, port
        self.http = httpx.Client(timeout=2.0, trust_env=False)

    def url(self, host: str) -> str:
        return f"http://{self.net.address(host)}:{self.port}"

    def get(self, host: str) -> dict[str, Any] | None:
        try:
            resp = self.http.get(self.url(host) + "/mesh")
        except httpx.HTTPError:
            return None
        return resp.json() if resp.status_code == 200 else None

    def stale(self, hosts: Sequence[str]) -> str | None:
        """Why the views among ``hosts`` are not converged, or None when they are."""
        meshes = {}
        for host in hosts:
            mesh = self.get(host)
            if mesh is None:
                return f"{host} not answering"
            meshes[host] = mesh
        for host, mesh in meshes.items():
            seen = {p["node_id"]: p for p in mesh.get("peers", [])}
            for other, truth in meshes.items():
                if other == host:
                    continue
                p = seen.get(other)
                if p is None or p.get("state") != "alive":
                    return f"{host} -> {other}: {'unknown' if p is None else p.get('state')}"
                if p.get("incarnation") != truth["incarnation"]:
                    return f"{host} -> {other}: old incarnation"
                if p.get("view_version") != truth["version"]:
                    return f"{host} -> {other}: view {p.get('view_version')} != {truth['version']}"
        return None

    def wait(self, check: Callable[[], bool], timeout_s: float, poll_s: float, what: str,
             procs: dict[str, Any]) -> float:
        t0 = time.monotonic()
        while not check():
            for host, proc in procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{host} exited (rc {proc.returncode}) waiting for {what}")
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
            time.sleep(poll_s)
        return time.monotonic() - t0


def run_join(cfg: JoinScenario, log_dir: str | None = None) -> dict[str, object]:
    """The join figure on ``cfg.hosts`` emulated hosts (see the module doc). Root only."""
    from radixmesh.testing.netns import EmulatedHosts, netns_unavailable, reap_stale

    reason = netns_unavailable()
    if reason is not None:
        raise RuntimeError(f"emulated hosts need Linux network namespaces: {reason}")
    reap_stale()
    names = [f"h{i + 1}" for i in range(cfg.hosts)]
    logs = Path(log_dir or tempfile.mkdtemp(prefix="radixmesh-join-"))
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RADIXMESH_CLUSTER_KEY", None)
    with EmulatedHosts(names) as net:
        mesh = _JoinMesh(net, cfg, logs, env)
        started = mesh.start_existing(names[:-1])
        trials = [mesh.trial(names, trial) for trial in range(cfg.trials)]
    gossip = cfg.gossip_interval
    after = [t["health_to_converged_s"] for t in trials]
    return {"hosts": cfg.hosts, "preset": cfg.preset, "gossip_interval_s": gossip,
            "existing_nodes_start_s": round(started, 1), "trials": trials,
            "health_to_converged_s_max": max(after),
            "health_to_converged_rounds_max": round(max(after) / gossip, 1),
            "config": asdict(cfg)}


class _JoinMesh:
    """The nodes of one join run on emulated hosts, and its two steps."""

    def __init__(self, net: Any, cfg: JoinScenario, logs: Path, env: dict[str, str]) -> None:
        self.net, self.cfg, self.logs, self.env = net, cfg, logs, env
        self.meshes = _Meshes(net, cfg.port)
        self.procs: dict[str, Any] = {}

    def spawn(self, host: str) -> Any:
        return self.net.spawn(host, _serve_argv(self.net, host, self.cfg),
                              self.logs / f"{host}.log", env=self.env)

    def start_existing(self, old: list[str]) -> float:
        """Start the nodes on ``old``, let each cache a prefix, wait until their views of one
        another converge; how long they took to converge the first time."""
        cfg, meshes = self.cfg, self.meshes
        t0 = time.monotonic()
        self.procs.update({h: self.spawn(h) for h in old})
        meshes.wait(lambda: meshes.stale(old) is None, cfg.start_timeout_s, 0.5,
                    f"{len(old)} nodes to converge", self.procs)
        started = time.monotonic() - t0
        for host in old:  # a cache worth gossiping on every node
            body = {"model": cfg.preset, "prompt": f"Host {host} caches this prefix. " * 8,
                    "max_tokens": 2, "temperature": 0}
            meshes.http.post(meshes.url(host) + "/v1/completions", json=body, headers=HOP,
                             timeout=60.0).raise_for_status()
        meshes.wait(lambda: meshes.stale(old) is None, cfg.converge_timeout_s, cfg.poll_s,
                    "views of the caches", self.procs)
        print(f"[join] {len(old)} hosts up and converged {started:.1f} s after spawn",
              flush=True)
        return started

    def trial(self, names: list[str], trial: int) -> dict[str, float]:
        """Start the last host's node, time its join, stop it again."""
        cfg, meshes, new = self.cfg, self.meshes, names[-1]
        t_spawn = time.monotonic()
        self.procs[new] = self.spawn(new)
        ready = meshes.wait(lambda: meshes.get(new) is not None, cfg.start_timeout_s,
                            cfg.poll_s, f"{new} to answer", self.procs)
        converged = meshes.wait(lambda: meshes.stale(names) is None,
                                cfg.converge_timeout_s, cfg.poll_s,
                                "the new node's view to converge", self.procs)
        row = {"spawn_to_health_s": round(ready, 2),
               "health_to_converged_s": round(converged, 2),
               "spawn_to_converged_s": round(time.monotonic() - t_spawn, 2)}
        print(f"[join] {cfg.hosts} hosts, trial {trial + 1}: {new} answered "
              f"{ready:.2f} s after spawn, converged view {converged:.2f} s later",
              flush=True)
        proc = self.procs.pop(new)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        # the others mark the old incarnation dead only after --dead-timeout; the next
        # trial's node is a new incarnation, which they must take over at once
        return row
