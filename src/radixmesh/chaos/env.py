"""A chaos environment: a keyed :class:`LocalCluster`, a prefix-sharing workload, references.

Every fault runs against real ``radixmesh serve`` processes on loopback. The cluster key is
random per run and reaches the nodes through ``RADIXMESH_CLUSTER_KEY`` (never argv), so every
fault also runs with peer authentication on.

Reference outputs: the same model (preset and seed) built in this process, one thread like
every node, generating greedily with an empty cache — a single node's greedy output, computed
without touching the cluster (sending references through a node would warm its cache and
change routing). Under any fault, every answer must equal its reference: a fault may cost
time, never correctness. (Answers are compared as
returned text; the byte tokenizer renders invalid UTF-8 as U+FFFD, so with ``max_tokens`` of 6+
a differing output is all but certain to show.)

Convergence: node X's view of peer P is current when X lists P as alive with P's incarnation
and ``view_version`` equal to P's own ``version``; the cluster has converged when that holds
for every ordered pair of running nodes.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from radixmesh.chaos.load import ClientOutcome, Prompt, closed_loop
from radixmesh.core.headers import HEADER_HOP
from radixmesh.options import NETWORKS
from radixmesh.runtime.cluster import LocalCluster
from radixmesh.runtime.config import ServeConfig, config_from_mapping
from radixmesh.runtime.metrics import parse_samples
from radixmesh.workload.synthetic import synthetic_groups

HOP = {HEADER_HOP: "1"}  # execute on the receiving node, never forward


# The `radixmesh serve` options (ServeConfig fields) every chaos node gets unless told
# otherwise; the rest are ServeConfig's defaults. The nodes share this machine: the local
# network preset's round and forward timeout.
SERVE_OPTIONS: dict[str, object] = {
    "preset": "micro",  # the model every node runs (micro: fast on a 2-core CPU)
    "policy": "paper",  # pure longest-prefix routing, so forwards are predictable
    "gossip_interval": NETWORKS["local"]["gossip_interval"],  # Δpoll
    "forward_timeout": NETWORKS["local"]["forward_timeout"],
    "pushback_threshold": 4,  # above the kill/loss faults' concurrency, below the slow one's
    "dead_timeout": 30.0,  # long, so a restart is recognised by its incarnation
    "cache_tokens": 32_768,
    "seed": 0,
}


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    """A chaos run: its cluster's size, its workload, and the nodes' ``radixmesh serve``
    options (:data:`SERVE_OPTIONS` under ``serve``), read back as the ServeConfig they make."""

    nodes: int = 3
    max_tokens: int = 6
    prompt_scale: float = 0.2  # synthetic MMLU-shaped prompts, ~600 characters
    keyed: bool = True  # run with a cluster key (peer authentication on)
    log_dir: str | None = None
    serve: tuple[tuple[str, object], ...] = ()  # more `radixmesh serve` options (over these)
    _node: ServeConfig = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # read once (a renamed key warns once); ValueError naming an unknown or bad option
        object.__setattr__(self, "_node", config_from_mapping(self.options(), ServeConfig()))

    def options(self) -> dict[str, object]:
        """Every node's ``radixmesh serve`` options."""
        return {**SERVE_OPTIONS, **dict(self.serve)}

    def node(self) -> ServeConfig:
        """The ServeConfig the options make (over ServeConfig's own defaults)."""
        return self._node

    def to_json(self) -> dict[str, object]:
        return {"nodes": self.nodes, "max_tokens": self.max_tokens,
                "prompt_scale": self.prompt_scale, "keyed": self.keyed,
                "log_dir": self.log_dir, **self.options()}

    # the serve options the faults read, typed
    @property
    def preset(self) -> str:
        return self.node().preset

    @property
    def seed(self) -> int:
        return self.node().seed

    @property
    def cache_tokens(self) -> int:
        return self.node().cache_tokens

    @property
    def gossip_interval(self) -> float:
        return self.node().gossip_interval

    @property
    def forward_timeout(self) -> float:
        return self.node().forward_timeout

    @property
    def pushback_threshold(self) -> int:
        return self.node().pushback_threshold


class ChaosEnv:
    """Owns the cluster for a set of faults; always use as a context manager."""

    def __init__(self, config: ChaosConfig) -> None:
        self.config = config
        self.key = secrets.token_hex(24) if config.keyed else ""
        env = dict(os.environ)
        env.pop("RADIXMESH_CLUSTER_KEY", None)
        if self.key:
            env["RADIXMESH_CLUSTER_KEY"] = self.key
        self.cluster = LocalCluster(config.nodes, config.options(), env=env,
                                    log_dir=config.log_dir, ready_timeout=240)
        self.model = ""
        groups = synthetic_groups(seed=config.seed, scale=config.prompt_scale, groups=12,
                                  max_per_group=40)
        self.groups: list[list[Prompt]] = [
            [Prompt(r.id, r.prompt or r.text, config.max_tokens) for r in reqs]
            for reqs in groups.values()
        ]
        self._by_id = {p.id: p for group in self.groups for p in group}
        self._references: dict[str, str] = {}
        self._engine: Any = None
        self._http = httpx.Client(timeout=30.0, trust_env=False)  # slow when the box is loaded

    def __enter__(self) -> ChaosEnv:
        self.cluster.start()
        models = self._http.get(self.cluster.url(0) + "/v1/models").json()
        self.model = models["data"][0]["id"]
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.close()
        self.cluster.stop()

    # ---------------------------------------------------------------------------- sending
    @property
    def delta_poll(self) -> float:
        return self.config.gossip_interval

    def url(self, i: int) -> str:
        return self.cluster.url(i)

    def send(self, entries: Callable[[int], str], prompts: Sequence[Prompt], concurrency: int = 3,
             headers: dict[str, str] | None = None,
             on_done: Callable[[int, ClientOutcome], None] | None = None,
             pace_s: float = 0.0) -> list[ClientOutcome]:
        return asyncio.run(closed_loop(entries, prompts, self.model, concurrency, 60.0, headers,
                                       on_done, pace_s))

    def references(self, prompts: Sequence[Prompt]) -> dict[str, str]:
        """Single-node greedy outputs of ``prompts`` (computed in-process, once per prompt)."""
        for p in prompts:
            self._by_id.setdefault(p.id, p)
        missing = [p for p in prompts if p.id not in self._references]
        if missing:
            self._compute_references(missing)
        return {p.id: self._references[p.id] for p in prompts}

    def _compute_references(self, prompts: Sequence[Prompt]) -> None:
        import torch

        from radixmesh.engine.base import GenerateRequest, SamplingParams
        from radixmesh.engine.factory import build_engine

        threads = torch.get_num_threads()
        try:
            if self._engine is None:
                self._engine = build_engine(self.config.preset, seed=self.config.seed,
                                            cache_tokens=self.config.cache_tokens, threads=1)
            torch.set_num_threads(1)
            tok = self._engine.tokenizer
            for p in prompts:
                req = GenerateRequest(p.id, tuple(tok.encode(p.text)),
                                      SamplingParams(max_tokens=p.max_tokens, temperature=0.0))
                self._references[p.id] = tok.decode(self._engine.generate(req).output_ids)
        finally:
            torch.set_num_threads(threads)

    def lost(self, outcomes: Sequence[ClientOutcome]) -> list[str]:
        """Ids whose answer is missing or differs from the single-node reference."""
        refs = self.references([self._by_id[o.id] for o in outcomes])
        return [o.id for o in outcomes if not o.ok or refs[o.id] != o.text]

    def warm(self, node: int, prompts: Sequence[Prompt]) -> None:
        """Execute ``prompts`` on ``node`` itself, so its cache (and soon its gossip) has them."""
        self.send(lambda _: self.url(node), prompts, 1, HOP)

    # ---------------------------------------------------------------------------- state
    def meshes(self, among: Sequence[int] | None = None) -> dict[int, dict[str, Any]]:
        idx = [n.index for n in self.cluster.nodes if n.running] if among is None else among
        return {i: self._http.get(self.url(i) + "/mesh", timeout=15.0).json() for i in idx}

    def stale_pairs(self, among: Sequence[int] | None = None) -> list[str]:
        """``"X->P: why"`` for every ordered pair whose view is not current."""
        meshes = self.meshes(among)
        by_id = {m["node_id"]: m for m in meshes.values()}
        out = []
        for m in meshes.values():
            seen = {p["node_id"]: p for p in m.get("peers", [])}
            for pid, truth in by_id.items():
                if pid == m["node_id"]:
                    continue
                p = seen.get(pid)
                why = _staleness(p, truth)
                if why:
                    out.append(f"{m['node_id']}->{pid}: {why}")
        return out

    def wait_converged(self, timeout_s: float, among: Sequence[int] | None = None,
                       poll_s: float = 0.02) -> float | None:
        """Seconds until every view is current, or None on timeout."""
        t0 = time.monotonic()
        while time.monotonic() - t0 <= timeout_s:
            if not self.stale_pairs(among):
                return time.monotonic() - t0
            time.sleep(poll_s)
        return None

    def wait_view(self, observer: int, peer: int, timeout_s: float = 30.0) -> bool:
        """Until ``observer``'s view of ``peer`` is current and non-empty."""
        deadline = time.monotonic() + timeout_s
        pid = self.cluster.nodes[peer].node_id
        while time.monotonic() < deadline:
            m = self.meshes([observer, peer])
            entry = next((p for p in m[observer]["peers"] if p["node_id"] == pid), None)
            if entry and not _staleness(entry, m[peer]) and entry["view_blocks"] > 0:
                return True
            time.sleep(0.05)
        return False

    def peer_entry(self, observer: int, peer: int) -> dict[str, Any] | None:
        pid = self.cluster.nodes[peer].node_id
        mesh = self.meshes([observer])[observer]
        return next((p for p in mesh["peers"] if p["node_id"] == pid), None)

    def metrics(self, i: int) -> dict[str, float]:
        """Prometheus samples of node ``i`` as ``{"name{labels}": value}``."""
        return parse_samples(self._http.get(self.url(i) + "/metrics", timeout=15.0).text)

    def admin(self, i: int, path: str, body: dict[str, object]) -> dict[str, Any]:
        resp = self._http.post(self.url(i) + path, json=body)
        resp.raise_for_status()
        result: dict[str, Any] = resp.json()
        return result

    def set_netem(self, **values: float) -> None:
        for n in self.cluster.nodes:
            if n.running:
                self.admin(n.index, "/admin/netem", dict(values))


def _staleness(entry: dict[str, Any] | None, truth: dict[str, Any]) -> str | None:
    if entry is None:
        return "unknown"
    if entry.get("state") != "alive":
        return f"state {entry.get('state')}"
    if entry.get("incarnation") != truth.get("incarnation"):
        return "old incarnation"
    if entry.get("view_version") != truth.get("version"):
        return f"version {entry.get('view_version')} != {truth.get('version')}"
    return None
