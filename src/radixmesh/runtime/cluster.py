"""``radixmesh cluster`` and :class:`LocalCluster`: N ``radixmesh serve`` processes on loopback.

Theory of operation
-------------------
Each node is a real ``python -m radixmesh.cli serve`` process on 127.0.0.1 with its own free
port, seeded with every other node's address. Children run in their own session (process
group), so a terminal's Ctrl-C reaches only the launcher, which then stops them in order
(SIGTERM, then SIGKILL after a grace period). On Linux each child also gets
``PR_SET_PDEATHSIG``: if the launcher itself dies (even by SIGKILL) the children follow, so no
orphans are left behind. Output goes to one log file per node.

Ready means: every running node answers ``/health`` and lists every other running node as
``alive`` in its ``/mesh`` with that node's current incarnation — i.e. each pair has gossiped.

Python API (used by the benchmark and chaos tools)::

    with LocalCluster(3, {"gossip_interval": 0.1, "policy": "cost"}) as c:
        c.urls                   # ["http://127.0.0.1:PORT", ...]
        c.kill(1)                # kill -9 node 1
        c.restart(1)             # same id and port, new incarnation; waits until re-joined
        c.partition(0, [2])      # node 0 and node 2 stop hearing each other (both sides)
        c.heal()

Why one file over 400 lines: the process lifecycle (start, readiness, kill, restart, orphan
protection, partitions) and the ``radixmesh cluster`` command that drives it share one state
machine over the same child processes; split apart, each half would reach into the other.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import httpx

from radixmesh.child_process import die_with_parent
from radixmesh.core.units import parse_duration
from radixmesh.options import canonical_key
from radixmesh.runtime.config import (
    add_serve_arguments,
    config_from_mapping,
    config_to_argv,
    load_toml,
)

LOOPBACK = "127.0.0.1"


class ClusterError(RuntimeError):
    """A node failed to start or the cluster did not become ready in time."""


_HANDED_OUT: set[int] = set()  # ports this process gave out already: never given twice


def free_ports(n: int, host: str = LOOPBACK) -> list[int]:
    """``n`` distinct ports that were free a moment ago (the OS picks them), none of them
    handed out before by this process: clusters started one after another (a benchmark's
    paired clusters, each node with its engine's three ports) never collide."""
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        for _ in range(64 * n + 64):  # bounded: the OS rarely repeats a recent port
            if len(ports) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
            port = s.getsockname()[1]
            if port not in _HANDED_OUT:
                ports.append(port)
        if len(ports) < n:
            raise ClusterError(f"could not find {n} free ports")
        _HANDED_OUT.update(ports)
        return ports
    finally:
        for s in socks:
            s.close()


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nobody listens on right now."""
    return free_ports(1, host)[0]


@dataclass
class NodeProc:
    index: int
    node_id: str
    port: int
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    spawned_at: float = 0.0  # time.monotonic() at spawn
    startup_s: float | None = None  # spawn -> first healthy answer
    incarnation: int | None = None
    starts: int = 0
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid


class LocalCluster:
    """Start, stop, kill, restart and partition N local nodes (see module doc)."""

    def __init__(
        self,
        n: int,
        options: Mapping[str, object] | None = None,
        *,
        per_node: Mapping[int, Mapping[str, object]] | None = None,
        node_ids: Sequence[str] | None = None,
        ports: Sequence[int] | None = None,
        base_port: int | None = None,
        log_dir: str | Path | None = None,
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
        ready_timeout: float = 180.0,
        die_with_parent: bool = True,
    ) -> None:
        if n < 1:
            raise ValueError("need at least one node")
        self.options = dict(options or {})
        for reserved in ("node_id", "port", "peers", "host", "advertise"):
            if reserved in self.options or reserved.replace("_", "-") in self.options:
                raise ValueError(f"{reserved!r} is set per node by the cluster")
        self.per_node = {i: dict(v) for i, v in (per_node or {}).items()}
        ids = list(node_ids) if node_ids else [f"n{i}" for i in range(n)]
        if len(ids) != n or len(set(ids)) != n:
            raise ValueError("node_ids must be n distinct names")
        if ports is None:
            ports = [base_port + i for i in range(n)] if base_port else free_ports(n)
        if len(ports) != n:
            raise ValueError("need one port per node")
        self._own_log_dir = log_dir is None
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="radixmesh-cluster-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.nodes = [NodeProc(i, ids[i], ports[i], self.log_dir / f"{ids[i]}.log")
                      for i in range(n)]
        self.python = python
        self.env = dict(env) if env is not None else None
        self.ready_timeout = ready_timeout
        self.die_with_parent = die_with_parent and sys.platform.startswith("linux")
        self._http = httpx.Client(timeout=5.0, trust_env=False)

    # ------------------------------------------------------------------------- accessors
    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def addresses(self) -> list[str]:
        return [n.address for n in self.nodes]

    @property
    def node_ids(self) -> list[str]:
        return [n.node_id for n in self.nodes]

    def url(self, i: int) -> str:
        return self.nodes[i].url

    def index_of(self, node: int | str) -> int:
        if isinstance(node, int):
            return node
        for n in self.nodes:
            if node in (n.node_id, n.address, n.url):
                return n.index
        raise KeyError(node)

    # ------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self, wait: bool = True) -> LocalCluster:
        for node in self.nodes:
            self._spawn(node)
        if wait:
            self.wait_ready()
        return self

    def argv(self, i: int) -> list[str]:
        node = self.nodes[i]
        values: dict[str, object] = {"threads": max(1, (os.cpu_count() or 1) // len(self))}
        values.update(self.options)
        values.update(self.per_node.get(i, {}))
        values.update({
            "node_id": node.node_id,
            "host": LOOPBACK,
            "port": node.port,
            "peers": [n.address for n in self.nodes if n is not node],
        })
        return [self.python, "-m", "radixmesh.cli", "serve", *config_to_argv(values)]

    def _spawn(self, node: NodeProc) -> None:
        if node.running:
            raise ClusterError(f"{node.node_id} is already running")
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        with open(node.log_path, "ab") as log:
            log.write(f"--- start #{node.starts + 1}: {' '.join(self.argv(node.index))}\n"
                      .encode())
            log.flush()
            node.process = subprocess.Popen(
                self.argv(node.index), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, env=env, start_new_session=True,
                preexec_fn=die_with_parent if self.die_with_parent else None,
            )
        node.spawned_at = time.monotonic()
        node.startup_s = None
        node.incarnation = None
        node.starts += 1

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every node (SIGTERM, then SIGKILL after ``timeout``). Idempotent."""
        for node in self.nodes:
            if node.running:
                assert node.process is not None
                with contextlib.suppress(ProcessLookupError):
                    node.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            self._reap(node, deadline)
        self._http.close()

    def _reap(self, node: NodeProc, deadline: float) -> None:
        proc = node.process
        if proc is None:
            return
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()

    def kill(self, node: int | str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL: ``kill -9``) to one node; SIGKILL also reaps it."""
        n = self.nodes[self.index_of(node)]
        if not n.running:
            return
        assert n.process is not None
        with contextlib.suppress(ProcessLookupError):
            n.process.send_signal(sig)
        if sig == signal.SIGKILL:
            n.process.wait()

    def stop_node(self, node: int | str, timeout: float = 10.0) -> None:
        n = self.nodes[self.index_of(node)]
        if n.running:
            self.kill(n.index, signal.SIGTERM)
        self._reap(n, time.monotonic() + timeout)

    def restart(self, node: int | str, wait: bool = True) -> None:
        """Stop (if running) and start again: same id and port, a new incarnation."""
        i = self.index_of(node)
        self.stop_node(i)
        self._spawn(self.nodes[i])
        if wait:
            self.wait_ready()

    # ------------------------------------------------------------------------- readiness
    def wait_ready(self, timeout: float | None = None) -> None:
        """Until all running nodes are healthy and see each other alive (current incarnation)."""
        deadline = time.monotonic() + (timeout or self.ready_timeout)
        while True:
            problem = self._not_ready()
            if problem is None:
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"cluster not ready: {problem}")
            time.sleep(0.1)

    def _not_ready(self) -> str | None:
        meshes: dict[str, dict[str, Any]] = {}
        for node in self.nodes:
            if node.process is None:
                continue
            if not node.running:
                if node.startup_s is None:
                    rc, tail = node.process.returncode, self.log_tail(node.index)
                    raise ClusterError(f"{node.node_id} exited during start-up (rc {rc}):\n{tail}")
                continue
            mesh = self._probe(node)
            if mesh is None:
                return f"{node.node_id} not answering"
            meshes[node.node_id] = mesh
        incarnations = {n.node_id: n.incarnation for n in self.nodes if n.node_id in meshes}
        for nid, mesh in meshes.items():
            seen = {p.get("node_id"): p for p in mesh.get("peers", []) if isinstance(p, dict)}
            for other, inc in incarnations.items():
                peer = seen.get(other)
                if other != nid and (peer is None or peer.get("state") != "alive"
                                     or peer.get("incarnation") != inc):
                    return f"{nid} does not see {other} alive yet"
        return None

    def _probe(self, node: NodeProc) -> dict[str, Any] | None:
        try:
            resp = self._http.get(node.url + "/mesh", timeout=2.0)
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        mesh: dict[str, Any] = resp.json()
        if node.startup_s is None:
            node.startup_s = time.monotonic() - node.spawned_at
        node.incarnation = mesh.get("incarnation")
        return mesh

    def log_tail(self, node: int | str, lines: int = 30) -> str:
        path = self.nodes[self.index_of(node)].log_path
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    # ------------------------------------------------------------------------- network
    def partition(self, node: int | str, peers: Iterable[int | str], symmetric: bool = True
                  ) -> None:
        """Cut ``node`` off from ``peers`` (by index or id); both sides unless not symmetric."""
        i = self.index_of(node)
        others = [self.index_of(p) for p in peers]
        self._set_partition(i, self._cut_of(i) | {self.nodes[j].node_id for j in others})
        if symmetric:
            for j in others:
                self._set_partition(j, self._cut_of(j) | {self.nodes[i].node_id})

    def split(self, *groups: Iterable[int | str]) -> None:
        """Partition the cluster into ``groups``: nodes hear only their own group."""
        members = [{self.index_of(x) for x in g} for g in groups]
        for group in members:
            for i in group:
                cut = {self.nodes[j].node_id for j in range(len(self)) if j not in group}
                self._set_partition(i, cut)

    def heal(self, node: int | str | None = None) -> None:
        """Remove all partitions (of one node, or of every running node)."""
        targets = [self.index_of(node)] if node is not None else range(len(self))
        for i in targets:
            if self.nodes[i].running:
                self._set_partition(i, set())

    def _cut_of(self, i: int) -> set[str]:
        resp = self._http.get(self.nodes[i].url + "/admin/partition")
        resp.raise_for_status()
        return set(resp.json()["partitioned_from"])

    def _set_partition(self, i: int, peers: set[str]) -> None:
        resp = self._http.post(self.nodes[i].url + "/admin/partition",
                               json={"peers": sorted(peers)})
        resp.raise_for_status()

    # ------------------------------------------------------------------------- helpers
    def get(self, node: int | str, path: str, **kw: Any) -> httpx.Response:
        return self._http.get(self.nodes[self.index_of(node)].url + path, **kw)

    def post(self, node: int | str, path: str, **kw: Any) -> httpx.Response:
        return self._http.post(self.nodes[self.index_of(node)].url + path, **kw)

    def mesh(self, node: int | str) -> dict[str, Any]:
        resp = self.get(node, "/mesh")
        resp.raise_for_status()
        result: dict[str, Any] = resp.json()
        return result

    def peer_entry(self, node: int | str, peer: int | str) -> dict[str, Any] | None:
        """``node``'s ``/mesh`` entry about ``peer`` (None if unknown)."""
        pid = self.nodes[self.index_of(peer)].node_id
        for p in self.mesh(node).get("peers", []):
            if p.get("node_id") == pid:
                return dict(p)
        return None


# ------------------------------------------------------------------------------ the command
_RESERVED = ("node_id", "port", "peers", "host", "advertise")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=4, help="number of nodes (default 4)")
    parser.add_argument("--base-port", type=int, default=8001,
                        help="first port; node i listens on base+i (0 = any free ports)")
    parser.add_argument("--log-dir", help="directory for one log per node (default: a temp dir)")
    parser.add_argument("--ready-timeout", type=parse_duration, default=180.0,
                        metavar="DURATION",
                        help="how long to wait for all nodes to be healthy and gossiping, "
                        "e.g. 180s, 5m (default 180s)")
    parser.add_argument("--config", metavar="TOML",
                        help="every node's options from this TOML file (serve's keys); flags win")
    add_serve_arguments(parser, skip=_RESERVED)


_SECRET_ENV = {"cluster_key": "RADIXMESH_CLUSTER_KEY", "api_key": "RADIXMESH_API_KEY"}


def cluster_options(args: argparse.Namespace) -> tuple[dict[str, object], dict[str, str]]:
    """Every node's options (the ``--config`` file's, then the flags) and the environment its
    secrets travel in (never argv, where ``ps`` shows them)."""
    options: dict[str, object] = {}
    if getattr(args, "config", None):
        toml = load_toml(args.config)
        config_from_mapping(toml)  # a bad file fails here, before any node starts
        options = {_key(k): v for k, v in toml.items()}
    options |= {k: v for k, v in vars(args).items()
                if k not in ("nodes", "base_port", "log_dir", "ready_timeout", "config")}
    env = {_SECRET_ENV[k]: str(options.pop(k)) for k in list(options) if k in _SECRET_ENV}
    return options, env


def _key(key: str) -> str:
    name = canonical_key(key)
    return "peers" if name == "join" else name


def run(args: argparse.Namespace) -> int:
    stop = _StopSignal()
    try:
        options, secrets = cluster_options(args)
        cluster = LocalCluster(args.nodes, options, base_port=args.base_port or None,
                               log_dir=args.log_dir, ready_timeout=args.ready_timeout,
                               env={**os.environ, **secrets} if secrets else None)
    except (ValueError, OSError) as exc:
        print(f"radixmesh cluster: {exc}", file=sys.stderr)
        return 2
    print(f"starting {args.nodes} nodes (logs in {cluster.log_dir}) ...", flush=True)
    try:
        cluster.start()
        _print_ready(cluster)
        while not stop.requested:
            _report_exits(cluster)
            time.sleep(0.5)
    except ClusterError as exc:
        print(f"radixmesh cluster: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping all nodes ...", file=sys.stderr, flush=True)
        cluster.stop()
        stop.restore()
    return 0


def served_model(cluster: LocalCluster) -> str:
    """The model name the nodes serve (what a client sends as ``"model"``), from node 0's
    ``/health``: the model directory's name, the preset's, or the external engine's."""
    resp = cluster.get(0, "/health")
    resp.raise_for_status()
    return str(resp.json()["model"])


def banner(cluster: LocalCluster, model: str) -> str:
    """The "ready, try this" text, with the model the nodes really serve."""
    lines = [f"{node.node_id}  {node.url}  (ready in {node.startup_s or 0:.1f}s, pid {node.pid})"
             for node in cluster.nodes]
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 8})
    api_key = cluster.options.get("api_key") or (cluster.env or {}).get("RADIXMESH_API_KEY")
    key = ("" if not api_key else
           " -H 'authorization: Bearer <your --api-key>'")
    lines += [
        "",
        f"all {len(cluster)} nodes healthy and gossiping, serving model {model!r}. Try:",
        f"  curl -s {cluster.urls[0]}/v1/completions -H 'content-type: application/json'{key} \\",
        f"    -d {shlex.quote(body)} -D -",
        "Ctrl-C stops them all.",
    ]
    return "\n".join(lines)


def _print_ready(cluster: LocalCluster) -> None:
    print(banner(cluster, served_model(cluster)), flush=True)


def _report_exits(cluster: LocalCluster) -> None:
    for node in cluster.nodes:
        if node.process is not None and not node.running and not node.extra.get("reported"):
            node.extra["reported"] = True
            print(f"{node.node_id} exited (rc {node.process.returncode}); see {node.log_path}",
                  file=sys.stderr, flush=True)


class _StopSignal:
    """The first SIGTERM / SIGINT interrupts the launcher (which then stops every node)."""

    def __init__(self) -> None:
        self.requested = False
        self._old = {s: signal.signal(s, self._handler) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:  # already stopping: don't interrupt the shutdown itself
            return
        self.requested = True
        raise KeyboardInterrupt

    def restore(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
