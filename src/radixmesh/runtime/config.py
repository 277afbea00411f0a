"""Configuration of one running node (``radixmesh serve``): flags and an optional TOML file.

Every flag has a TOML key of the same name (dashes or underscores), e.g.::

    node-id = "a"
    port = 8001
    join = ["127.0.0.1:8002", "127.0.0.1:8003"]   # or: peers = [...] (the old name)
    join-dns = "radixmesh.internal:8001"
    gossip-interval = 0.1
    net-delay = "2ms"

Precedence: built-in defaults < the ``--network`` preset (local | lan | wan, radixmesh/options.py)
< TOML file (``--config``) < command-line flags. The result is one frozen, validated
:class:`ServeConfig`; :meth:`ServeConfig.node_config` turns it into the pure core's
:class:`~radixmesh.core.config.NodeConfig`. The options other commands share (``cluster``,
``bench``, ``sim``, ``chaos``) take their flag, help and renamed (deprecated) names from
radixmesh/options.py's table; an old name still works for one release, with a warning.

Why one file over 400 lines: it is the node's whole operator surface — every field, its
validation, its conversion from TOML or a flag, and its help text — kept side by side so that a
new flag is added in one place (``_help_texts`` is a table, like an argument parser's).
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from radixmesh.core.blocks import Fingerprint
from radixmesh.core.config import (
    AdmissionConfig,
    ForwardConfig,
    GossipConfig,
    GossipMode,
    NodeConfig,
    PushbackConfig,
)
from radixmesh.core.estimators import CostPriors
from radixmesh.core.quotas import check_share
from radixmesh.core.router import Policy, RouterConfig
from radixmesh.core.sessions import SessionConfig
from radixmesh.core.units import parse_duration, parse_optional_duration
from radixmesh.options import (
    NETWORKS,
    OPTIONS,
    add_renamed,
    canonical_key,
    check_network,
    gossip_config,
    parse_fraction,
    parse_optional_fraction,
)
from radixmesh.runtime.netem import parse_peer_delays

# The core's defaults, which ServeConfig's defaults are read from (one place declares each).
_ROUTER = RouterConfig()
_GOSSIP = GossipConfig()
_PUSHBACK = PushbackConfig()
_FORWARD = ForwardConfig()
PEER_TRANSPORTS = ("link", "http")
_ADMISSION = AdmissionConfig()


def parse_token_cap(text: str | int | None) -> int | None:
    """``--max-queue-tokens``: a count >= 1, ``0``/``"auto"`` (from the engine's measured
    speed) or ``"off"``/``"none"`` (no token bound) -> None."""
    if text is None or (isinstance(text, str) and text.strip().lower() in ("off", "none")):
        return None
    if isinstance(text, str) and text.strip().lower() == "auto":
        return 0
    if isinstance(text, bool) or not isinstance(text, int | str):
        raise ValueError(f"max_queue_tokens: expected a count, 'auto' or 'off', got {text!r}")
    value = int(text)
    if value < 0:
        raise ValueError(f"max_queue_tokens must be >= 0, 'auto' or 'off': {text!r}")
    return value


def parse_dns_target(text: str) -> tuple[str, int | None]:
    """``"NAME"`` or ``"NAME:PORT"`` -> (name, port or None)."""
    name, sep, port = text.strip().rpartition(":")
    if not sep:
        name, port = text.strip(), ""
    if not name or any(c.isspace() for c in name) or (port and not port.isdigit()):
        raise ValueError(f"join_dns must be NAME or NAME:PORT, got {text!r}")
    if port and not 0 < int(port) < 65536:
        raise ValueError(f"join_dns port must be in 1..65535, got {text!r}")
    return name, int(port) if port else None


def parse_peers(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"h:p,h:p"`` or a list of ``"h:p"`` -> tuple of validated ``host:port`` strings."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out: list[str] = []
    for raw in items:
        item = str(raw).strip()
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"peer must be host:port, got {item!r}")
        out.append(item)
    return tuple(out)


ENGINE_KINDS = ("builtin", "vllm", "sglang", "openai", "llamacpp")


def parse_endpoint_list(value: str | Sequence[str]) -> str:
    """ZMQ endpoints as ``"a,b"`` or a TOML list -> ``"a,b"``."""
    items = value.split(",") if isinstance(value, str) else [str(v) for v in value]
    return ",".join(i.strip() for i in items if i.strip())


@dataclass(frozen=True, slots=True)
class ServeConfig:
    node_id: str = ""  # unique name in the mesh; "" -> "node-<port>"
    host: str = "127.0.0.1"  # interface to bind
    port: int = 8000  # TCP port: the client API and the peer endpoints
    advertise: str = ""  # host:port peers use to reach us; "" -> host:port (not 0.0.0.0)
    peers: tuple[str, ...] = ()  # --join (alias --peers): seed addresses, host:port
    join_dns: str = ""  # NAME[:PORT]: its A/AAAA records are seeds (port: ours if omitted)
    join_dns_interval: float = 30.0  # seconds between resolutions of join_dns
    drain_grace: float = 30.0  # SIGTERM: seconds to finish in-flight work before exiting
    drain_linger: float = 2.0  # SIGTERM: the port stays open at least this long (<= grace)
    gossip_interval: float = _GOSSIP.interval_s  # seconds between anti-entropy rounds (Δpoll)
    gossip_mode: str = _GOSSIP.mode.value  # delta | snapshot | epidemic
    # delta mode: a cache change brings the next round forward to this long after the last
    gossip_announce: float | None = _GOSSIP.announce_gap_s  # None ("off"): rounds only
    gossip_fanout: int = _GOSSIP.fanout  # epidemic mode: peers per round
    policy: str = _ROUTER.policy.value  # cost | paper | none | random | round_robin | ...
    load_bound: float | None = _ROUTER.load_bound  # cost: bounded load; None = off
    preset: str = "mini"  # built-in engine preset (ignored when model is set; engine/presets.py)
    model: str = ""  # local Hugging Face model directory; "" -> preset
    cache_tokens: int = 65_536  # KV cache budget in tokens
    engine: str = "builtin"  # builtin | vllm | sglang | openai | llamacpp (external, HTTP)
    engine_url: str = ""  # external engine's base URL, e.g. http://127.0.0.1:8000
    kv_events: str = ""  # external engine's KV-event endpoint(s), as in its config, comma list
    kv_replay: str = ""  # its replay endpoint (one: rank i uses port + i)
    tokenizer: str = ""  # external engine: the model directory whose tokenizer it loads
    engine_block_size: int = 0  # external engine's KV block size; 0 -> from its events
    engine_kv_blocks: int = 0  # vLLM's num_gpu_blocks: predict its evictions (0: off)
    launch: str = ""  # external engine: start it as a child with this command, stop it with us
    # external engine: its step-time profile (core/profile.py; a shipped name or a TOML file):
    # the node shadows its scheduler (core/shadow.py) and routes on predicted TTFT
    profile: str = ""
    profile_time_scale: float = 1.0  # the engine's steps last this many times the profile's
    # external engine with a profile: poll its /metrics this often (seconds; 0: never) so the
    # shadow carries load others send it (core/engine_report.py, runtime/engine_metrics.py)
    engine_metrics_interval: float = 0.5
    device: str = "cpu"  # torch device of the built-in engine: cpu | cuda[:N]
    dtype: str = "float32"  # built-in engine weights / KV: float32 | bfloat16 | float16
    gpu_memory_fraction: float = 0.0  # cuda: this process's share of the GPU; 0 -> no cap
    threads: int = 0  # torch intra-op threads; 0 -> torch's default
    seed: int = 0  # weights of presets, and this node's routing randomness
    suspect_timeout: float = 0.0  # silent this long -> suspect; 0 -> 4 gossip intervals
    dead_timeout: float = 0.0  # silent this long -> dead; 0 -> 20 gossip intervals
    pushback_threshold: int = _PUSHBACK.queue_threshold  # queue depth: ask peers to back off
    pushback_relative: float = _PUSHBACK.relative or 0.0  # ... and x peers' mean; 0 -> off
    forward_timeout: float = _FORWARD.silence_timeout_s  # forward: first byte / silence timeout
    connect_timeout: float = _FORWARD.connect_timeout_s  # forward / gossip: TCP connect timeout
    peer_transport: str = "link"  # link: a peer's forwards share one open exchange | http
    max_queue_requests: int = 0  # requests queued or running at most; 0 -> no count cap
    max_queue_wait: float = _ADMISSION.max_queue_wait_s  # full once this much work is queued
    max_queue_tokens: int | None = _ADMISSION.max_queue_tokens  # prompt+max_tokens; 0 -> auto
    tenant_queue_share: float | None = None  # each tenant's share of those; None: no quotas
    net_delay: float = 0.0  # emulated one-way delay on every peer message, seconds
    net_jitter: float = 0.0  # emulated extra delay, uniform in [0, jitter], seconds
    net_loss: float = 0.0  # emulated loss probability of gossip messages
    net_duplicate: float = 0.0  # emulated duplication probability of gossip messages
    net_peer_delays: str = ""  # ADDRESS=OUT[/BACK],...: these peers' own one-way delays
    debug_engine_delay: float = 0.0  # test/chaos only: extra seconds per request on the engine
    cluster_key: str = field(default="", repr=False)  # peer-message secret; "" -> env or none
    api_key: str = field(default="", repr=False)  # client bearer token; "" -> env or none
    api_keys: str = ""  # (tenants) FILE of 'KEY TENANT' lines: tenant keys, core/tenants.py
    session_margin: float = SessionConfig().margin_s  # (tenants) core/sessions.py
    adapters: str = ""  # (tenants) NAME=DIGEST|DIR,...: the LoRA adapters the engine serves
    peer_tls_cert: str = ""  # PEM: this node's certificate (server and client); all 3 or none
    peer_tls_key: str = ""  # PEM: its private key
    peer_tls_ca: str = ""  # PEM: the mesh CA that signs every node's certificate
    decision_log: int = 1024  # routing decisions kept for GET /mesh/decisions; 0 -> none
    max_body_bytes: int = 4 * 1024 * 1024  # client request bodies larger than this -> 413
    incarnation: int = 0  # 0 -> derived from the wall clock at start (grows across restarts)
    log_level: str = "info"  # debug | info | warning | error
    network: str = "lan"  # timing preset under the rest: local | lan | wan (options.NETWORKS)

    @classmethod
    def for_network(cls, network: str, **values: Any) -> ServeConfig:
        """The ``network`` preset's timings, then ``values``."""
        return cls(**{**NETWORKS[check_network(network)], "network": network, **values})

    @classmethod
    def local(cls, **values: Any) -> ServeConfig:
        """One machine: 0.2 s gossip rounds, 1 s forward silence, 0.25 s connects."""
        return cls.for_network("local", **values)

    @classmethod
    def lan(cls, **values: Any) -> ServeConfig:
        """A data-centre network: the defaults."""
        return cls.for_network("lan", **values)

    @classmethod
    def wan(cls, **values: Any) -> ServeConfig:
        """Regions apart: GossipConfig.wan()'s rounds, timeouts and cadences, 5 s forwards."""
        return cls.for_network("wan", **values)

    def __post_init__(self) -> None:
        self._check_routing()
        self._check_emulation()
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError("dtype must be float32, bfloat16 or float16")
        if not 0 <= self.gpu_memory_fraction <= 1:
            raise ValueError("gpu_memory_fraction must be in [0, 1] (0: no cap)")
        self._check_engine()
        if self.cluster_key.strip() and len(self.cluster_key.strip().encode()) < 16:
            raise ValueError("cluster_key must be at least 16 bytes")
        if self.threads < 0 or self.incarnation < 0 or self.max_body_bytes < 1024:
            raise ValueError("threads/incarnation must be >= 0, max_body_bytes >= 1024")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ValueError("log_level must be debug, info, warning or error")
        self._check_join()
        self._check_tls()

    def _check_routing(self) -> None:
        """The port, gossip, policy, admission and pushback settings."""
        if not 0 < self.port < 65536:
            raise ValueError("port must be in 1..65535")
        check_network(self.network)
        GossipMode.parse(self.gossip_mode)
        Policy.parse(self.policy)
        positive = ("gossip_interval", "forward_timeout", "connect_timeout", "max_queue_wait",
                    "join_dns_interval")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_queue_requests < 0:
            raise ValueError("max_queue_requests must be >= 0 (0: no cap)")
        if self.decision_log < 0:
            raise ValueError("decision_log must be >= 0 (0: keep none)")
        if self.max_queue_tokens is not None and self.max_queue_tokens < 0:
            raise ValueError("max_queue_tokens must be >= 0 (0: auto) or off")
        check_share(self.tenant_queue_share)
        if self.cache_tokens < 1 or self.pushback_threshold < 1 or self.gossip_fanout < 1:
            raise ValueError("cache_tokens, pushback_threshold and gossip_fanout must be >= 1")
        if self.pushback_relative != 0 and not self.pushback_relative >= 1:
            raise ValueError("pushback_relative must be >= 1 (0: the threshold alone)")

    def _check_emulation(self) -> None:
        """Failure timeouts, the emulated network and engine delay, the peer transport."""
        if min(self.net_delay, self.net_jitter, self.suspect_timeout, self.dead_timeout) < 0:
            raise ValueError("durations must be >= 0")
        if not 0 <= self.net_loss <= 1 or not 0 <= self.net_duplicate <= 1:
            raise ValueError("net_loss and net_duplicate must be in [0, 1]")
        if self.debug_engine_delay < 0:
            raise ValueError("debug_engine_delay must be >= 0")
        if self.peer_transport not in PEER_TRANSPORTS:
            raise ValueError(f"peer_transport must be one of {', '.join(PEER_TRANSPORTS)}")

    def _check_tls(self) -> None:
        names = ("peer_tls_cert", "peer_tls_key", "peer_tls_ca")
        given = [n for n in names if getattr(self, n).strip()]
        if given and len(given) < len(names):
            flags = ", ".join("--" + n.replace("_", "-") for n in names if n not in given)
            raise ValueError("--peer-tls-cert, --peer-tls-key and --peer-tls-ca go together "
                             f"(all three or none): missing {flags}")

    @property
    def peer_tls(self) -> bool:
        """Mutual TLS on this node's port (runtime/peer_tls.py)."""
        return bool(self.peer_tls_cert.strip())

    def _check_join(self) -> None:
        parse_peer_delays(self.net_peer_delays)  # refused here, naming the bad entry
        if self.drain_grace < 0 or self.drain_linger < 0:
            raise ValueError("drain_grace and drain_linger must be >= 0")
        if self.join_dns:
            parse_dns_target(self.join_dns)
        if self.advertise:
            if "," in self.advertise or len(parse_peers(self.advertise)) != 1:
                raise ValueError(f"advertise must be one host:port, got {self.advertise!r}")
        elif self.host in ("0.0.0.0", "", "::"):
            raise ValueError(
                f"--host {self.host or repr('')} listens on every interface, so peers cannot be "
                "told which address reaches this node: pass --advertise HOST:PORT (the "
                "address other machines use for it)"
            )

    def _check_engine(self) -> None:
        if self.engine not in ENGINE_KINDS:
            raise ValueError(f"engine must be one of {', '.join(ENGINE_KINDS)}")
        if self.engine != "builtin" and not self.engine_url:
            raise ValueError(f"--engine {self.engine} needs --engine-url")
        if self.engine in ("openai", "llamacpp") and self.kv_events:
            raise ValueError(f"--engine {self.engine} has no KV events (use vllm or sglang)")
        if self.kv_replay and not self.kv_events:
            raise ValueError("--kv-replay needs --kv-events")
        if self.engine_block_size < 0:
            raise ValueError("engine_block_size must be >= 0 (0: from the events)")
        if self.engine_kv_blocks < 0:
            raise ValueError("engine_kv_blocks must be >= 0 (0: off)")
        if self.engine_kv_blocks and (self.engine != "vllm" or not self.engine_block_size):
            raise ValueError("--engine-kv-blocks models vLLM's free queue: it needs --engine "
                             "vllm and --engine-block-size")
        if self.profile and self.engine == "builtin":
            raise ValueError("--profile describes an external engine: give --engine vllm|sglang")
        if not self.profile_time_scale > 0:
            raise ValueError("profile_time_scale must be > 0")
        if self.engine_metrics_interval != 0 and not 0.01 <= self.engine_metrics_interval <= 60:
            raise ValueError("engine_metrics_interval must be 0 (off) or in [0.01, 60] seconds")
        if self.launch and self.engine == "builtin":
            raise ValueError("--launch starts an external engine: give --engine and --engine-url")

    # ------------------------------------------------------------------------- derived
    @property
    def name(self) -> str:
        return self.node_id or f"node-{self.port}"

    @property
    def address(self) -> str:
        return self.advertise or f"{self.host}:{self.port}"

    @property
    def join_dns_target(self) -> tuple[str, int] | None:
        """(name, port) of ``join_dns`` (the port defaults to this node's), or None."""
        if not self.join_dns:
            return None
        name, port = parse_dns_target(self.join_dns)
        return name, port or self.port

    def gossip_config(self) -> GossipConfig:
        return gossip_config(self.gossip_interval, self.gossip_mode, self.gossip_fanout,
                             self.gossip_announce, self.suspect_timeout, self.dead_timeout,
                             self.network)

    def router_config(self) -> RouterConfig:
        """The router's: its durations stretched by ``profile_time_scale`` (an engine that
        many times slower than its profile: rates that many times lower)."""
        router = replace(_ROUTER, policy=Policy.parse(self.policy), load_bound=self.load_bound)
        return router.stretched(self.profile_time_scale)

    def pushback_config(self) -> PushbackConfig:
        relative = self.pushback_relative or None
        return replace(_PUSHBACK, queue_threshold=self.pushback_threshold, relative=relative)

    def forward_config(self) -> ForwardConfig:
        return replace(
            _FORWARD,
            connect_timeout_s=self.connect_timeout,
            silence_timeout_s=self.forward_timeout,
        )

    def node_config(self, fingerprint: Fingerprint, incarnation: int) -> NodeConfig:
        return NodeConfig(
            node_id=self.name,
            address=self.address,
            fingerprint=fingerprint,
            incarnation=incarnation,
            seeds=tuple(p for p in self.peers if p != self.address),
            router=self.router_config(),
            gossip=self.gossip_config(),
            pushback=self.pushback_config(),
            forward=self.forward_config(),
            admission=self.admission_config(),
            decision_log=self.decision_log,
            sessions=SessionConfig(margin_s=self.session_margin).stretched(self.profile_time_scale),
            priors=CostPriors().stretched(self.profile_time_scale),
        )

    def admission_config(self) -> AdmissionConfig:
        cap = self.max_queue_requests or None
        return replace(_ADMISSION, max_queue_requests=cap, max_queue_wait_s=self.max_queue_wait,
                       max_queue_tokens=self.max_queue_tokens)


# ----------------------------------------------------------------------------- parsing
_CONVERT: dict[str, Any] = {
    "peers": parse_peers,
    "gossip_interval": parse_duration,
    "suspect_timeout": parse_duration,
    "dead_timeout": parse_duration,
    "forward_timeout": parse_duration,
    "connect_timeout": parse_duration,
    "max_queue_wait": parse_duration,
    "session_margin": parse_duration,
    "max_queue_tokens": parse_token_cap,
    "tenant_queue_share": OPTIONS["tenant_queue_share"].parse,
    "join_dns_interval": parse_duration,
    "drain_grace": parse_duration,
    "drain_linger": parse_duration,
    "net_delay": parse_duration,
    "net_jitter": parse_duration,
    "net_loss": parse_fraction,
    "net_duplicate": parse_fraction,
    "debug_engine_delay": parse_duration,
    "load_bound": parse_optional_fraction,
    "gossip_announce": parse_optional_duration,
}
_CONVERT["kv_events"] = _CONVERT["kv_replay"] = parse_endpoint_list
_FIELDS = {f.name: f for f in fields(ServeConfig)}
_ALIASES = {"join": "peers"}  # documented name -> field (the flag and the TOML key)


def _convert(key: str, value: object) -> object:
    conv = _CONVERT.get(key)
    if conv is not None:
        return conv(value)
    kind = type(getattr(ServeConfig(), key))
    if kind is int and (isinstance(value, bool) or not isinstance(value, int | str)):
        raise ValueError(f"{key}: expected an integer, got {value!r}")
    if kind is str and not isinstance(value, str):
        raise ValueError(f"{key}: expected a string, got {value!r}")
    return kind(value)


def config_from_mapping(
    values: Mapping[str, object], base: ServeConfig | None = None
) -> ServeConfig:
    """Apply ``values`` (keys with dashes or underscores; renamed keys warn) over ``base``, or,
    without one, over the preset of ``values``' ``network`` (default lan); unknown keys raise."""
    changes: dict[str, Any] = {}
    for raw_key, value in values.items():
        key = canonical_key(raw_key)
        key = _ALIASES.get(key, key)
        if key not in _FIELDS or key == "config":
            raise ValueError(f"unknown configuration key {raw_key!r}")
        if key in changes:
            raise ValueError(f"{raw_key!r}: set twice (two names of one setting, such as "
                             "join and peers)")
        changes[key] = _convert(key, value)
    if base is None:  # a network preset lies under the other values
        base = ServeConfig.for_network(changes.get("network", "lan"))
    return replace(base, **changes)


def load_toml(path: str | Path) -> dict[str, object]:
    with open(path, "rb") as fh:
        data = tomllib.load(fh)
    section = data.get("serve", data)
    if not isinstance(section, dict):
        raise ValueError(f"{path}: [serve] must be a table")
    return section


def add_serve_arguments(parser: argparse.ArgumentParser, skip: Sequence[str] = ()) -> None:
    """Add one flag per :class:`ServeConfig` field (default SUPPRESS: only given flags appear)."""
    helps = _help_texts()
    group = parser.add_argument_group("node")
    for name in _FIELDS:
        if name in skip:
            continue
        flags = ["--" + name.replace("_", "-")]
        flags[:0] = ["--" + a for a, field_name in _ALIASES.items() if field_name == name]
        default = getattr(ServeConfig(), name)
        shown = ",".join(default) if isinstance(default, tuple) else default
        group.add_argument(
            *flags,
            dest=name,
            default=argparse.SUPPRESS,
            metavar="HOST:PORT,..." if name == "peers" else name.upper(),
            help=f"{helps.get(name, '')} (default: {shown!r})",
        )
        if name in OPTIONS and OPTIONS[name].old:
            add_renamed(group, OPTIONS[name])


def _help_texts() -> dict[str, str]:  # long: a table of help texts
    """Each flag's help: the shared options' from radixmesh/options.py, the rest here."""
    return {o.name: o.help for o in OPTIONS.values()} | {
        "node_id": "unique node name",
        "host": "interface to bind",
        "port": "TCP port (client API and peer endpoints; HTTPS with --peer-tls-*)",
        "advertise": "host:port peers use to reach this node (required with --host 0.0.0.0)",
        "peers": "join the mesh through these seed addresses host:port,host:port (--peers is "
        "the old name); a seed that is down is retried with backoff",
        "join_dns": "join through the A/AAAA records of NAME[:PORT] (port: this node's), "
        "resolved at start and every --join-dns-interval",
        "join_dns_interval": "seconds between resolutions of --join-dns, e.g. 30s",
        "drain_grace": "SIGTERM: stop taking work, finish what is in flight within this long, "
        "then exit 0 (what still runs is cancelled)",
        "drain_linger": "SIGTERM: keep the port open (new requests go to peers) at least this "
        "long, so load balancers see /health 503 before it closes (capped at --drain-grace)",
        "model": "local Hugging Face model directory (overrides --preset); with an external "
        "--engine: the model name the engine serves (default: asked from its /v1/models)",
        "engine": "builtin (this process) | vllm | sglang | openai | llamacpp (an engine at "
        "--engine-url; llamacpp: llama.cpp's server, its slots modelled)",
        "engine_url": "external engine's base URL, e.g. http://127.0.0.1:8000",
        "kv_events": "external engine's KV-event publisher endpoint(s), exactly as in its "
        "--kv-events-config (tcp://*:5557: we connect to the engine's host), comma list",
        "kv_replay": "external engine's replay endpoint, e.g. tcp://*:5558",
        "tokenizer": "directory with the external engine's tokenizer.json (the same files), "
                     "or `bytes` for an engine on the byte tokenizer (radixmesh emulate's default)",
        "engine_block_size": "external engine's KV block size (0 = take it from its events)",
        "engine_kv_blocks": "vLLM's KV blocks (num_gpu_blocks; needs --engine-block-size): "
                            "predict cached tokens net of what the requests ahead evict and "
                            "store (0 = off)",
        "profile": "external engine: its step-time profile (a shipped name, `radixmesh profile "
        "list`, or a TOML file): the node shadows its scheduler and routes on predicted TTFT",
        "profile_time_scale": "external engine: its steps last this many times the profile's "
        "(an emulated engine's --time-scale); the router's windows and cost priors stretch with it",
        "engine_metrics_interval": "external engine with --profile: poll its /metrics this "
        "often (seconds; 0 = never) so the shadow counts load others send it",
        "launch": "external engine: start this command line as a child process (no shell), "
        "wait until --engine-url answers, stop it with the node",
        "suspect_timeout": "silence before a peer is suspect (0 = 4 gossip intervals)",
        "dead_timeout": "silence before a peer is dead (0 = 20 gossip intervals)",
        "pushback_relative": "... and only while the queue is also over this many times the "
        "peers' mean queue (0 = the threshold alone)",
        "connect_timeout": "peer TCP connect timeout",
        "peer_transport": "how forwards reach a peer: link (all of them over one long-lived "
        "HTTP exchange per peer, opened on the first forward) | http (one POST each)",
        "max_queue_requests": "bounded admission: requests queued or running at most (0 = no cap)"
        "; beyond it a request goes to a peer with room or gets HTTP 429",
        "max_queue_wait": "bounded admission: full once this much work is queued, e.g. 30s",
        "max_queue_tokens": "bounded admission: prompt + max_tokens of the requests queued or "
        "running at most; 'auto' = the tokens the engine gets through within --max-queue-wait "
        "at its measured rate; 'off' = no token bound",
        "decision_log": "routing decisions kept (what the node believed of every candidate, "
        "what it chose) for GET /mesh/decisions; 0 = none",
        "net_duplicate": "emulated gossip duplication probability, e.g. 0.1",
        "net_peer_delays": "emulated one-way delays to particular peers instead of --net-delay,"
        " ADDRESS=OUT[/BACK],... (BACK: their answers'; what bench --regions sets)",
        "debug_engine_delay": "chaos testing: sleep this long before each request on the engine",
        "cluster_key": "secret (>= 16 bytes) authenticating peer messages; prefer the "
        "RADIXMESH_CLUSTER_KEY environment variable or the config file (flags show in ps)",
        "api_key": "require 'Authorization: Bearer KEY' on the client API (or RADIXMESH_API_KEY)",
        "adapters": "NAME=DIGEST|DIR[,...]: LoRA adapters the engine serves under NAME (as "
        "vLLM's --lora-modules), known by their content digest (given, or SHA-256 of DIR); "
        "the built-in engine loads DIR, a PEFT LoRA folder",
        "session_margin": "a session (prompt_cache_key, x-session-id) goes to the node that "
        "served it last unless that node is predicted slower than the best by more than this",
        "api_keys": "FILE of 'KEY TENANT' lines: each key opens /v1/* for its tenant, whose "
        "cache is its own (beside --api-key, the operator's key: shared cache, every route)",
        "max_body_bytes": "largest accepted client request body",
        "peer_tls_cert": "PEM certificate of this node, signed by --peer-tls-ca, SAN = its "
        "advertised host: the port then serves HTTPS and /peer/* needs a client certificate "
        "signed by the CA (with --peer-tls-key, --peer-tls-ca: all three or none)",
        "peer_tls_key": "PEM private key of --peer-tls-cert",
        "peer_tls_ca": "PEM CA certificate(s) that sign the mesh's node certificates",
        "incarnation": "override the incarnation number (0 = from the clock)",
        "log_level": "debug | info | warning | error",
    }


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """Defaults < the ``--network`` preset (a flag's, else the TOML's) < ``--config`` TOML <
    explicit flags."""
    given = {k: v for k, v in vars(args).items() if k in _FIELDS}
    path = getattr(args, "config", None)
    toml = load_toml(path) if path else {}
    network = given.get("network") or toml.get("network") or "lan"
    base = ServeConfig.for_network(str(network))
    return config_from_mapping(given, config_from_mapping(toml, base))


def config_to_argv(values: Mapping[str, object]) -> list[str]:
    """Flags that reproduce ``values`` (keys as in :class:`ServeConfig`) on a command line."""
    argv: list[str] = []
    for key, value in values.items():
        name = canonical_key(key)
        name = _ALIASES.get(name, name)
        if name not in _FIELDS:
            raise ValueError(f"unknown configuration key {key!r}")
        if value is None:
            text = "off"
        else:
            text = ",".join(value) if isinstance(value, list | tuple) else str(value)
        argv += ["--" + name.replace("_", "-"), text]
    return argv
