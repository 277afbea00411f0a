"""One benchmark configuration (:class:`RunSpec`) and the engine limits it implies.

A sweep is a list of ``RunSpec``; each runs on a fresh cluster (cold caches). Policies are the
node routing policies (``none``, ``paper``, ``cost``, ``random``, ``round_robin``,
``least_loaded``) plus client-side baselines whose nodes run ``none``: ``oracle`` (see
:mod:`radixmesh.bench.oracle`), ``sglang`` (the sglang-router 0.3.2 ``cache_aware`` gateway)
and ``smg`` (SMG 1.13's ``cache_aware``, :mod:`radixmesh.bench.smg`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from radixmesh.bench.regions import Regions
from radixmesh.core.config import GossipConfig
from radixmesh.core.router import Policy
from radixmesh.results.records import in_warmup
from radixmesh.workload import WorkloadSpec

CLIENT_POLICIES = ("oracle", "sglang", "smg")
GATEWAY_POLICIES = ("sglang", "smg")
ALL_POLICIES = tuple(p.value for p in Policy) + CLIENT_POLICIES


def check_policy(name: str) -> str:
    if name not in ALL_POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(ALL_POLICIES)}")
    return name


@dataclass(frozen=True, slots=True)
class RunSpec:
    name: str  # the run's name in summary.json and requests.jsonl
    policy: str  # a node policy (serve --policy) or a client-side baseline (oracle, sglang, smg)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)  # requests and their schedule
    nodes: int = 4  # nodes in the run's cluster
    net_delay_s: float = 0.002  # emulated one-way delay of every peer message (--net-delay)
    gossip_interval_s: float = 0.5  # Δpoll
    # a cache change brings the next round forward to this long after the last (None: off)
    gossip_announce_s: float | None = GossipConfig().announce_gap_s
    cache_tokens: int = 160_000  # KV budget per node, tokens
    concurrency: int = 1  # closed-loop clients (1 = the paper's one-at-a-time schedule)
    preset: str = "mini"  # the built-in default (engine/presets.py)
    model: str | None = None  # local model directory instead of a preset
    threads: int = 1  # torch threads per node
    device: str = "cpu"  # torch device of every node's engine (cuda: nodes share the GPU)
    dtype: str = "float32"  # engine weights and KV cache
    gpu_memory_fraction: float = 0.0  # cuda: each node process's share of the GPU; 0: no cap
    seed: int = 0  # workload, engine weights and routing randomness
    group: str = ""  # which table/figure of the report this run feeds
    lockstep: str = ""  # consecutive runs with the same non-empty key run paired in time
    # builtin: each node runs the built-in engine in process; emulated: each node fronts its
    # own `radixmesh emulate` engine (bench/emulated.py) with one of ``profiles`` (NAME:COUNT,..)
    engine: str = "builtin"
    profiles: str = ""
    time_scale: float = 1.0  # emulated: everything timed runs S x slower; figures divided back
    # --regions / --region-delays (the simulator's spelling, bench/regions.py): region names
    # and the one-way ms matrix; empty = one flat network at net_delay_s
    regions: str = ""
    region_delays: str = ""
    # --exclude-warmup: the first N requests / those sent in the first S (unscaled) seconds
    # are sent but left out of the figures (records carry "warmup": true)
    warmup_requests: int = 0
    warmup_s: float = 0.0

    def __post_init__(self) -> None:
        check_policy(self.policy)
        if self.nodes < 1 or self.concurrency < 1 or self.cache_tokens < 1:
            raise ValueError("nodes, concurrency and cache_tokens must be >= 1")
        if self.warmup_requests < 0 or self.warmup_s < 0:
            raise ValueError("--exclude-warmup must be >= 0 requests or seconds")
        if self.net_delay_s < 0 or self.gossip_interval_s <= 0:
            raise ValueError("comm delay must be >= 0 and gossip interval > 0")
        if (self.workload.rate or self.workload.load) and self.concurrency > 1:
            raise ValueError("an open-loop rate and closed-loop concurrency exclude each other")
        if self.engine not in ("builtin", "emulated"):
            raise ValueError(f"engine must be builtin or emulated, got {self.engine!r}")
        if self.engine == "emulated" and not self.profiles:
            raise ValueError("--engine emulated needs --profiles NAME[:COUNT],...")
        if not self.time_scale > 0 or (self.engine == "builtin" and self.time_scale != 1):
            raise ValueError("--time-scale must be > 0, and applies to --engine emulated only")
        self.node_profiles  # noqa: B018 -- refused here, naming the bad --profiles entry
        self.region_map  # noqa: B018 -- likewise a bad --regions / --region-delays

    @property
    def region_map(self) -> Regions | None:
        """The run's regions (None: one flat network)."""
        return Regions.parse(self.regions, self.region_delays)

    @property
    def node_profiles(self) -> list[str]:
        """Emulated engines: the profile of each node's engine, in node order."""
        from radixmesh.bench.emulated import parse_profiles

        return parse_profiles(self.profiles, self.nodes) if self.engine == "emulated" else []

    def is_warmup(self, seq: int, t_send: float) -> bool:
        """Whether a request (its position, its unscaled send time) is part of the warm-up."""
        return in_warmup(seq, t_send, self.warmup_requests, self.warmup_s)

    @property
    def node_policy(self) -> str:
        return "none" if self.policy in CLIENT_POLICIES else self.policy

    @property
    def skew(self) -> str:
        return "skewed" if self.workload.skewed else "uniform"


def engine_context(preset: str, model: str | None, profiles: Sequence[str] = ()) -> int:
    """The engine's context length (prompts must be shorter), without loading weights;
    emulated engines: the shortest of their profiles'."""
    if profiles:
        from radixmesh.bench.emulated import context_length

        return context_length(profiles)
    if model:
        cfg = json.loads((Path(model) / "config.json").read_text())
        text = cfg.get("text_config", cfg)
        return int(text.get("max_position_embeddings", 4096))
    from radixmesh.engine.presets import get_preset

    return get_preset(preset).max_position_embeddings
