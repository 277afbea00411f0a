"""How the benchmark gets a fresh cluster: the runtime's ``LocalCluster`` behind one call.

The runner depends only on :class:`BenchCluster` (node URLs and ids, ``close``; optionally
``wait_ready``) and a :data:`ClusterFactory`, so tests and other launchers can plug in. The
local factory returns a cluster whose node processes are spawned but not yet ready, so a
batch's clusters boot at the same time; the runner calls ``wait_ready`` before using one.
Processes are spawned from the calling (main) thread on purpose: the nodes' parent-death
signal (``PR_SET_PDEATHSIG``) fires when the *thread* that forked them exits.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from radixmesh.bench.spec import RunSpec


class BenchCluster(Protocol):
    @property
    def urls(self) -> list[str]: ...
    @property
    def node_ids(self) -> list[str]: ...
    def close(self) -> None: ...


ClusterFactory = Callable[[RunSpec], BenchCluster]


def serve_options(spec: RunSpec) -> dict[str, object]:
    """The ``radixmesh serve`` options (ServeConfig fields) every node of the run gets; an
    emulated mesh's nodes get no built-in engine's options, and every interval, delay and
    timeout ``time_scale`` times longer (bench/emulated.py; 1 otherwise)."""
    s = spec.time_scale
    opts: dict[str, object] = {
        "policy": spec.node_policy,
        "gossip_interval": spec.gossip_interval_s * s,
        "gossip_announce": "off" if spec.gossip_announce_s is None
        else spec.gossip_announce_s * s,
        "net_delay": spec.net_delay_s * s,
        "seed": spec.seed,
        "log_level": "warning",
    }  # fmt: skip
    if spec.engine == "emulated":
        return opts | _stretched_timeouts(s)
    opts |= {"cache_tokens": spec.cache_tokens, "threads": spec.threads, "preset": spec.preset}
    if spec.model:
        opts["model"] = spec.model
    if spec.device != "cpu":
        opts["device"] = spec.device
    if spec.dtype != "float32":
        opts["dtype"] = spec.dtype
    if spec.gpu_memory_fraction:
        opts["gpu_memory_fraction"] = spec.gpu_memory_fraction
    return opts


def _stretched_timeouts(scale: float) -> dict[str, object]:
    """The node's forward and admission timeouts, ``scale`` times their defaults."""
    from radixmesh.core.config import AdmissionConfig, ForwardConfig

    forward = ForwardConfig()
    return {
        "forward_timeout": forward.silence_timeout_s * scale,
        "connect_timeout": forward.connect_timeout_s * scale,
        "max_queue_wait": AdmissionConfig().max_queue_wait_s * scale,
    }


def per_node_options(spec: RunSpec, addresses: list[str] | None = None
                     ) -> dict[int, dict[str, object]]:
    """Each node's own options: for an emulated mesh, its engine's profile and ports; with
    regions, its one-way delay to every other node (``addresses``, in node order)."""
    from radixmesh.runtime.cluster import free_ports

    out: dict[int, dict[str, object]] = {i: {} for i in range(spec.nodes)}
    if spec.engine == "emulated":
        from radixmesh.bench.emulated import engine_options

        ports = free_ports(3 * spec.nodes)
        for i, p in enumerate(spec.node_profiles):
            out[i] |= engine_options(p, ports[3 * i: 3 * i + 3], spec.time_scale)
    regions = spec.region_map
    if regions is not None:
        if addresses is None or len(addresses) != spec.nodes:
            raise ValueError("regions need every node's address before the nodes start")
        for i in out:
            out[i]["net_peer_delays"] = regions.peer_delays(i, addresses, spec.time_scale)
    return {i: o for i, o in out.items() if o}


class _Local:
    """Adapts the runtime's ``LocalCluster`` to :class:`BenchCluster`."""

    def __init__(self, spec: RunSpec, log_dir: Path | None) -> None:
        from radixmesh.runtime.cluster import LOOPBACK, LocalCluster, free_ports

        ports = free_ports(spec.nodes)  # known up front: regions name each node's peers
        per_node = per_node_options(spec, [f"{LOOPBACK}:{p}" for p in ports])
        self._cluster = LocalCluster(spec.nodes, serve_options(spec), per_node=per_node,
                                     log_dir=log_dir, ports=ports)  # fmt: skip
        try:
            self._cluster.start(wait=False)
        except BaseException:
            self._cluster.stop()
            raise

    def wait_ready(self) -> None:
        try:
            self._cluster.wait_ready()
        except BaseException:
            self._cluster.stop()
            raise

    @property
    def urls(self) -> list[str]:
        return list(self._cluster.urls)

    @property
    def node_ids(self) -> list[str]:
        return list(self._cluster.node_ids)

    @property
    def pids(self) -> dict[str, int | None]:
        """Each node's process id, by node id (None: not running)."""
        return {n.node_id: n.pid for n in self._cluster.nodes}

    @property
    def engine_urls(self) -> list[str]:
        """The nodes' external engines (emulated meshes), in node order; [] for built-in."""
        return [str(o["engine_url"]) for _, o in sorted(self._cluster.per_node.items())
                if "engine_url" in o]

    def close(self) -> None:
        self._cluster.stop()


def local_cluster(log_root: str | Path | None = None) -> ClusterFactory:
    """A factory spawning ``spec.nodes`` fresh node processes on 127.0.0.1 per run (ready
    after ``wait_ready()``), with node logs under ``log_root/<run name>/`` (a temporary folder
    when ``None``)."""

    def start(spec: RunSpec) -> BenchCluster:
        log_dir = None if log_root is None else Path(log_root) / spec.name
        return _Local(spec, log_dir)

    return start
