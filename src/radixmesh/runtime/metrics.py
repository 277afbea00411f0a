"""The node's own counters and their Prometheus text exposition (format 0.0.4).

The core's ``NodeCore.metrics()`` (gossip bytes, rejected messages, ...) is exported next to
these as ``radixmesh_core_<name>``; peer states come from ``NodeCore.mesh_state``.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

_NAME_RE = re.compile(r"[^a-zA-Z0-9_]")


@dataclass
class RuntimeMetrics:
    requests: Counter[str] = field(default_factory=Counter)  # by route: local|forwarded|fallback
    served_for_peers: int = 0  # forwarded requests this node executed for others
    refused_for_peers: int = 0  # forwarded requests refused as busy (at the push-back threshold)
    client_errors: Counter[int] = field(default_factory=Counter)  # by HTTP status
    prompt_tokens: int = 0  # prompt tokens executed on this node's engine
    cached_tokens: int = 0  # of which reused from the KV cache (cache hit tokens)
    completion_tokens: int = 0  # generated here, including by requests cancelled midway
    cancelled: int = 0  # engine requests stopped because their client went away
    client_disconnects: int = 0  # non-streaming clients that went away before their answer
    rejected: int = 0  # client requests answered 429: full here and no peer took them
    forwards_rejected: int = 0  # peers' forwards refused as malformed (400), never executed
    forward_attempts: int = 0
    forward_failures: Counter[str] = field(default_factory=Counter)  # by reason
    forward_overhead_s_sum: float = 0.0  # RequestDone.forward_rtt_s, summed
    forward_overhead_count: int = 0
    gossip_in_messages: int = 0
    gossip_in_bytes: int = 0
    gossip_out_messages: int = 0
    gossip_out_bytes: int = 0
    gossip_send_failures: int = 0
    gossip_oversize: int = 0  # gossip bodies refused before decoding (too large)
    peer_state_changes: Counter[str] = field(default_factory=Counter)  # by new state
    core_errors: int = 0  # exceptions escaping NodeCore.handle (a bug; never expected)


def _sanitize(name: str) -> str:
    return _NAME_RE.sub("_", name)


def _value(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


def _escape(label: str) -> str:
    return label.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Exposition:
    """Accumulates metric families and renders Prometheus text."""

    def __init__(self, prefix: str = "radixmesh_") -> None:
        self._prefix = prefix
        self._lines: list[str] = []

    def family(
        self,
        name: str,
        kind: str,
        help_: str,
        samples: Iterable[tuple[Mapping[str, str], float]],
    ) -> None:
        full = self._prefix + _sanitize(name)
        self._lines.append(f"# HELP {full} {help_}")
        self._lines.append(f"# TYPE {full} {kind}")
        for labels, value in samples:
            if labels:
                text = ",".join(f'{_sanitize(k)}="{_escape(v)}"' for k, v in labels.items())
                self._lines.append(f"{full}{{{text}}} {_value(value)}")
            else:
                self._lines.append(f"{full} {_value(value)}")

    def single(self, name: str, kind: str, help_: str, value: float) -> None:
        self.family(name, kind, help_, [({}, value)])

    def render(self) -> str:
        return "\n".join(self._lines) + "\n"


def render(
    m: RuntimeMetrics,
    gauges: Mapping[str, float],
    core: Mapping[str, float],
    peer_states: Mapping[str, str],
    node_id: str,
) -> str:
    """Prometheus text for one node."""
    ex = Exposition()
    _requests(ex, m)
    _forwards(ex, m)
    _gossip(ex, m)
    _state(ex, gauges, core, peer_states, node_id)
    return ex.render()


def _requests(ex: Exposition, m: RuntimeMetrics) -> None:
    routes = ("local", "forwarded", "fallback")
    ex.family("requests_total", "counter", "Client requests by route taken.",
              [({"route": r}, m.requests[r]) for r in routes])
    ex.single("served_for_peers_total", "counter",
              "Forwarded requests executed here for other nodes.", m.served_for_peers)
    ex.single("refused_for_peers_total", "counter",
              "Forwarded requests refused as busy (queue at the push-back threshold).",
              m.refused_for_peers)
    ex.family("client_errors_total", "counter", "Client requests answered with an error.",
              [({"status": str(s)}, n) for s, n in sorted(m.client_errors.items())])
    ex.single("prompt_tokens_total", "counter", "Prompt tokens run on this engine.",
              m.prompt_tokens)
    ex.single("cache_hit_tokens_total", "counter",
              "Prompt tokens whose KV was reused from this node's cache.", m.cached_tokens)
    ex.single("completion_tokens_total", "counter", "Tokens generated here.",
              m.completion_tokens)
    ex.single("cancelled_requests_total", "counter",
              "Engine requests stopped because their client went away.", m.cancelled)
    ex.single("rejected_requests_total", "counter",
              "Client requests answered 429: this node full and no peer took them.", m.rejected)
    ex.single("client_disconnects_total", "counter",
              "Non-streaming clients that went away before their answer.", m.client_disconnects)
    ex.single("forwards_rejected_total", "counter",
              "Peers' forwards refused as malformed, never executed.", m.forwards_rejected)


def _forwards(ex: Exposition, m: RuntimeMetrics) -> None:
    ex.single("forward_attempts_total", "counter", "Forwards started.", m.forward_attempts)
    ex.family("forward_failures_total", "counter", "Forwards that failed, by reason.",
              [({"reason": r}, n) for r, n in sorted(m.forward_failures.items())])
    ex.single("forward_overhead_seconds_sum", "counter",
              "Sum of forward overheads (client time minus remote handling).",
              m.forward_overhead_s_sum)
    ex.single("forward_overhead_seconds_count", "counter", "Successful forwards measured.",
              m.forward_overhead_count)


def _state(
    ex: Exposition,
    gauges: Mapping[str, float],
    core: Mapping[str, float],
    peer_states: Mapping[str, str],
    node_id: str,
) -> None:
    """Gauges, peer membership, the core's own metrics and the node's identity."""
    for name, value in sorted(gauges.items()):
        ex.single(name, "gauge", f"Current {name.replace('_', ' ')}.", value)
    counts: Counter[str] = Counter(peer_states.values())
    ex.family("peers", "gauge", "Known peers by membership state.",
              [({"state": s}, counts[s]) for s in ("alive", "suspect", "dead")])
    ex.family("peer_state", "gauge", "1 for each peer's current membership state.",
              [({"peer": p, "state": s}, 1) for p, s in sorted(peer_states.items())])
    for name, value in sorted(core.items()):
        ex.single(f"core_{name}", "gauge", f"NodeCore metric {name}.", float(value))
    ex.family("node_info", "gauge", "Static node identity.", [({"node_id": node_id}, 1)])


def _gossip(ex: Exposition, m: RuntimeMetrics) -> None:
    ex.single("gossip_in_messages_total", "counter", "Gossip messages received (before "
              "validation).", m.gossip_in_messages)
    ex.single("gossip_in_bytes_total", "counter", "Gossip bytes received.", m.gossip_in_bytes)
    ex.single("gossip_out_messages_total", "counter", "Gossip messages sent.",
              m.gossip_out_messages)
    ex.single("gossip_out_bytes_total", "counter", "Gossip bytes sent.", m.gossip_out_bytes)
    ex.single("gossip_send_failures_total", "counter", "Gossip pushes that failed.",
              m.gossip_send_failures)
    ex.single("gossip_oversize_total", "counter", "Gossip bodies refused as too large.",
              m.gossip_oversize)
    ex.family("peer_state_changes_total", "counter", "Peer membership transitions, by new "
              "state.", [({"state": s}, n) for s, n in sorted(m.peer_state_changes.items())])
    ex.single("core_errors_total", "counter", "Internal errors in the core (bugs).",
              m.core_errors)
