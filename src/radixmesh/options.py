"""One table of the node options that several commands take, and the network presets.

Theory of operation
-------------------
A node's options have one definition: the fields of ``runtime/config.py``'s ``ServeConfig``
(``radixmesh serve``'s flags and TOML keys). The options that other commands also take — the
nodes ``cluster`` starts, the clusters ``bench`` and ``chaos`` start, the nodes ``sim``
simulates — are listed once in :data:`OPTIONS`: the field name (the flag is ``--`` + the name
with dashes, the TOML key either spelling), its help text, how text becomes its value, and the
names it had before (deprecated: accepted for one release, with a warning on stderr). Each
command adds them to its parser with :func:`add_option` (one value, or a comma-separated list
for the sweeps of ``bench`` and ``sim``), with its own default where it has one.

Network presets (:data:`NETWORKS`, memberlist's ``DefaultLocalConfig`` / ``LANConfig`` /
``WANConfig``): the timing options for one machine, a LAN (the defaults) and a WAN, as field
values. ``ServeConfig.local()`` / ``.lan()`` / ``.wan()`` apply them; ``--network NAME`` picks
one under the TOML file and the flags (which still win).

Imports only the core: the simulator uses it too and must not import the runtime.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from radixmesh.core.config import GossipConfig, GossipMode
from radixmesh.core.units import parse_duration, parse_optional_duration

NEXT_RELEASE = "the old name goes in the next release"


@dataclass(frozen=True, slots=True)
class Option:
    name: str  # the field; the flag is --NAME-WITH-DASHES, the TOML key either spelling
    help: str  # what it means (each command adds its default)
    parse: Callable[[Any], Any] | None = None  # flag text or TOML value -> the value; None: str
    old: tuple[str, ...] = ()  # deprecated names of the flag / TOML key (one release)
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def parse_fraction(text: Any) -> float:
    """A probability from ``"0.1"``, ``0.1`` or ``"10%"``."""
    if isinstance(text, str) and text.strip().endswith("%"):
        value = float(text.strip()[:-1]) / 100.0
    else:
        value = float(text)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"fraction must be in [0, 1]: {text!r}")
    return value


def parse_optional_fraction(text: Any) -> float | None:
    """A number >= 0, or None from ``"off"`` / ``"none"`` (the feature is disabled)."""
    if text is None or (isinstance(text, str) and text.strip().lower() in ("off", "none", "")):
        return None
    if isinstance(text, bool):
        raise ValueError(f"not a number: {text!r}")
    value = float(text)
    if value < 0:
        raise ValueError(f"must be >= 0 or 'off': {text!r}")
    return value


def parse_share(text: Any) -> float | None:
    """``--tenant-queue-share``: a fraction in (0, 1] (``"0.5"``, ``"50%"``), or None from
    ``"off"`` / ``"none"`` (no quotas)."""
    if text is None or (isinstance(text, str) and text.strip().lower() in ("off", "none", "")):
        return None
    if isinstance(text, bool):
        raise ValueError(f"tenant_queue_share: not a number: {text!r}")
    value = parse_fraction(text)
    if value <= 0:
        raise ValueError(f"tenant_queue_share must be in (0, 1] or 'off': {text!r}")
    return value


_TABLE = (
    Option("nodes", "nodes in the mesh", int),
    Option("policy", "routing policy: cost | paper | none | random | round_robin | "
           "least_loaded | llmd", old=("policies",)),
    Option("preset", "built-in model preset (mini | tiny | micro | qwen2.5-0.5b)",
           old=("engine_preset",)),
    Option("model", "local Hugging Face model directory (overrides --preset)"),
    Option("seed", "seed of preset weights and of routing randomness", int),
    Option("threads", "torch threads (0 = default)", int),
    Option("device", "torch device (cpu, cuda)"),
    Option("dtype", "built-in engine weights and KV cache: float32 | bfloat16 | float16"),
    Option("gpu_memory_fraction", "cuda: cap this process's share of the GPU's memory, e.g. "
           "0.2 (several nodes on one GPU; 0 = no cap)", float),
    Option("cache_tokens", "KV cache budget in tokens", int),
    Option("gossip_interval", "gossip period Δpoll, e.g. 0.5 or 100ms", parse_duration,
           metavar="DURATION"),
    Option("gossip_mode", "what a gossip round carries: delta | snapshot | epidemic"),
    Option("gossip_fanout", "epidemic mode: peers per round", int, old=("fanout",)),
    Option("gossip_announce", "delta mode: a change to a node's cache brings its next gossip "
           "round forward to this long after the last one, e.g. 50ms; 'off': rounds only every "
           "--gossip-interval (the paper's polling)", parse_optional_duration),
    Option("load_bound", "cost policy: no forwards to peers busier than (1+x) x the mean; "
           "'off'", parse_optional_fraction),
    Option("pushback_threshold", "queue depth above which peers are asked to back off", int),
    Option("forward_timeout", "forward first-byte / silence timeout", parse_duration,
           metavar="DURATION"),
    Option("net_delay", "emulated one-way delay of peer messages, e.g. 2ms", parse_duration,
           old=("comm_delay",), metavar="DURATION"),
    Option("net_jitter", "emulated jitter (uniform extra one-way delay in [0, J]), e.g. 1ms",
           parse_duration, old=("jitter",), metavar="DURATION"),
    Option("net_loss", "emulated gossip loss probability, e.g. 0.05", parse_fraction,
           old=("loss",)),
    Option("tenant_queue_share", "per-tenant admission quota: each tenant (--api-keys) may "
           "hold at most this share of the node's --max-queue-* bounds, e.g. 0.5 or 50%%; "
           "requests without a tenant share the rest; 'off' = no quotas", parse_share,
           metavar="SHARE|off"),
    Option("network", "timing presets under the other options: local (one machine) | lan "
           "(the defaults) | wan", metavar="local|lan|wan"),
)
OPTIONS: dict[str, Option] = {o.name: o for o in _TABLE}
RENAMED: dict[str, str] = {old: o.name for o in _TABLE for old in o.old}  # old -> field

# Network presets: field values over ServeConfig's defaults (the LAN's). Each is a deployment's
# timing: how often nodes gossip, when a silent peer is suspect / dead, how long a forward or a
# connection may take before the entry node tries elsewhere.
NETWORKS: dict[str, dict[str, object]] = {
    # one machine (loopback, `radixmesh cluster`, chaos runs): fast rounds, short timeouts
    "local": {"gossip_interval": 0.2, "forward_timeout": 1.0, "connect_timeout": 0.25},
    # a data-centre network: the defaults (0.5 s rounds, suspect after 4, dead after 20)
    "lan": {},
    # regions apart (tens to hundreds of ms, some loss): GossipConfig.wan()'s rounds and
    # timeouts, forwards allowed a slow first byte and a slow connect
    "wan": {"gossip_interval": 2.0, "suspect_timeout": 10.0, "dead_timeout": 60.0,
            "forward_timeout": 5.0, "connect_timeout": 2.0},
}


def gossip_config(
    interval_s: float,
    mode: str,
    fanout: int,
    announce_gap_s: float | None,
    suspect_s: float = 0.0,
    dead_s: float = 0.0,
    network: str = "lan",
) -> GossipConfig:
    """The core's gossip configuration from the options (``serve`` and ``sim`` both build it
    here): timeouts 4 and 20 rounds unless given (0), ``wan``'s round-counted cadences."""
    overrides: dict[str, Any] = {"mode": GossipMode.parse(mode), "fanout": fanout,
                                 "announce_gap_s": announce_gap_s}
    if suspect_s:
        overrides["suspect_after_s"] = suspect_s
    if dead_s:
        overrides["dead_after_s"] = dead_s
    if network == "wan":  # cadences counted in rounds: halved (GossipConfig.wan)
        wan = GossipConfig.wan()
        overrides |= {"membership": wan.membership, "exchange": wan.exchange}
    gossip = GossipConfig.for_interval(interval_s, **overrides)
    if gossip.dead_after_s < gossip.suspect_after_s:  # only suspect given: keep the order
        gossip = replace(gossip, dead_after_s=5 * gossip.suspect_after_s)
    return gossip


EXCLUDE_WARMUP_HELP = (
    "leave the first N requests (e.g. 50) or those sent in the first S seconds (e.g. 30s, "
    "unscaled) out of the figures; they are still sent and kept in requests.jsonl with "
    "\"warmup\": true"
)


def add_exclude_warmup(parser: argparse.ArgumentParser | Any) -> None:
    """``--exclude-warmup N|Ss`` (``bench`` and ``sim``): the value is (requests, seconds);
    ``results.records.in_warmup`` says which records it covers."""
    parser.add_argument("--exclude-warmup", type=_argtype(parse_warmup), default=None,
                        metavar="N|Ss", help=EXCLUDE_WARMUP_HELP)


def parse_warmup(text: str) -> tuple[int, float]:
    """``50`` (requests) or ``30s`` (seconds) -> (requests, seconds)."""
    if text.strip().isdigit():
        return int(text), 0.0
    try:
        return 0, parse_duration(text)
    except ValueError as exc:
        raise ValueError(f"expected N (requests) or a duration: {exc}") from None


def check_network(name: str) -> str:
    if name not in NETWORKS:
        raise ValueError(f"network must be one of {', '.join(NETWORKS)}, got {name!r}")
    return name


def warn_renamed(old: str, new: str, what: str = "flag") -> None:
    """One line on stderr: ``old`` is a deprecated name of ``new``."""
    print(f"radixmesh: warning: {what} {old} is deprecated, use {new} ({NEXT_RELEASE})",
          file=sys.stderr)


def canonical_key(key: str, what: str = "key") -> str:
    """A TOML key or option name with underscores, renamed ones mapped (with a warning)."""
    name = key.replace("-", "_")
    if name in RENAMED:
        warn_renamed(key, RENAMED[name].replace("_", "-"), what)
        return RENAMED[name]
    return name


class _Renamed(argparse.Action):
    """A deprecated flag: stores into the new one's ``dest`` and warns."""

    def __init__(self, *args: Any, new: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        warn_renamed(option_string or self.option_strings[0], self.new)
        setattr(namespace, self.dest, values)


def _argtype(parse: Callable[[Any], Any]) -> Callable[[str], Any]:
    def inner(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    inner.__name__ = getattr(parse, "__name__", "value")
    return inner


def _list_type(parse: Callable[[Any], Any]) -> Callable[[str], list[Any]]:
    return _argtype(lambda text: [parse(p.strip()) for p in text.split(",") if p.strip()])


def add_option(
    parser: argparse.ArgumentParser | Any,  # a parser or an argument group
    name: str,
    default: Any = argparse.SUPPRESS,
    *,
    sweep: bool = False,  # a comma-separated list of values (the sweeps of bench and sim)
    raw: bool = False,  # keep the text (the command parses it later)
    help: str | None = None,  # argparse's own keyword
    **kwargs: Any,
) -> None:
    """Add option ``name``'s flag (and its deprecated names, hidden) to ``parser``."""
    opt = OPTIONS[name]
    parse = opt.parse or str
    kind = str if raw else (_list_type(parse) if sweep else _argtype(parse))
    kind = kwargs.pop("type", kind)  # the command's own parser of the text
    text = help or opt.help + (", comma-separated" if sweep else "")
    if help is None and default is not argparse.SUPPRESS and default is not None:
        shown = ",".join(map(str, default)) if isinstance(default, list) else default
        text += f" (default {shown})"
    kwargs.setdefault("metavar", opt.metavar or name.upper())
    parser.add_argument(opt.flag, dest=name, default=default, type=kind, help=text, **kwargs)
    add_renamed(parser, opt, kind, **{k: v for k, v in kwargs.items() if k != "metavar"})


def add_renamed(parser: argparse.ArgumentParser | Any, opt: Option, kind: Any = None,
                **kwargs: Any) -> None:
    """``opt``'s old flags (hidden from --help): they set its value and warn."""
    for old in opt.old:
        parser.add_argument("--" + old.replace("_", "-"), dest=opt.name, type=kind,
                            new=opt.flag, action=_Renamed, default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS, **kwargs)


def add_options(parser: argparse.ArgumentParser | Any, defaults: Mapping[str, Any],
                **kwargs: Any) -> None:
    """:func:`add_option` for each name of ``defaults``, with that default."""
    for name, default in defaults.items():
        add_option(parser, name, default, **kwargs)
