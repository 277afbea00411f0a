"""What an external engine says about its own load (``/metrics``), and how the shadow follows it.

Theory of operation
-------------------
A node's shadow of its engine (``core/shadow.py``) sees only the requests this node sent. An
engine shared with another router, or a client calling it directly, runs more: the shadow then
predicts too short a TTFT and routes too much here. The engine's ``/metrics`` say what it runs,
in vLLM's names (``vllm/v1/metrics/loggers.py``, vLLM 0.32; the emulated engine exposes the
same: ``emulate/metrics.py``):

* ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` — gauges, one series per engine
  core (label ``engine``): summed;
* ``vllm:kv_cache_usage_perc`` — gauge, 0..1 (older vLLM: ``vllm:gpu_cache_usage_perc``, read
  when the new name is absent): the mean over engine cores.

SGLang's are read the same way (``python/sglang/srt/metrics/collector.py``):
``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``.

:func:`parse_metrics` reads those from Prometheus text into an :class:`EngineReport`;
anything malformed is a ``ValueError`` naming the metric (the poller counts and ignores it).

:func:`reconcile` is the pure rule turning one report into what the shadow should carry
beyond its own requests — the *foreign* load (:class:`Foreign`). The node knows exactly
which of its requests are open at the engine (sent, not ended: ``own_open``); whatever the
engine counts beyond that is someone else's::

    foreign total   = max(0, running + waiting - own_open)
    foreign waiting = min(foreign total, max(0, waiting - own_waiting))
    foreign running = foreign total - foreign waiting
    foreign KV      = max(0, kv_usage * kv_tokens - own_kv)      (0 with no foreign running)

Counting against ``own_open`` (not the shadow's own running count) keeps the rule robust to
the shadow running a little ahead of or behind its engine: a request the node still awaits
is never taken for a stranger's; one the engine has not seen yet makes the engine's count
short, which the ``max`` clips to no foreign load (never negative). The shadow
(:meth:`~radixmesh.core.shadow.Shadow.observe`) then carries foreign waiting requests as
ghost requests in its scheduler (they wait, are admitted, prefill and decode as any request:
their prompt and output lengths are the node's own recent means, the best guess of the
workload) and foreign running ones as ghost decodes in every step (their count and KV),
so its own requests' predicted TTFT rises as the engine's would. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
# each metric's names, first found wins: vLLM V1, vLLM before the V1 rename, SGLang
_NAMES = {RUNNING: (RUNNING, "sglang:num_running_reqs"),
          WAITING: (WAITING, "sglang:num_queue_reqs"),
          KV_USAGE: (KV_USAGE, "vllm:gpu_cache_usage_perc", "sglang:token_usage")}
_ALIAS = {alias: (metric, rank) for metric, names in _NAMES.items()
          for rank, alias in enumerate(names)}
# a sample: name, optional {labels}, value (a timestamp may follow)
_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{.*\})?\s+(\S+)")
MAX_REQUESTS = 1 << 20  # a gauge above this is not a count of requests: refused


@dataclass(frozen=True, slots=True)
class EngineReport:
    """One scrape of an engine's ``/metrics``."""

    running: int
    waiting: int
    kv_usage: float  # 0..1: KV blocks held by running requests over the pool

    def __post_init__(self) -> None:
        for name in ("running", "waiting"):
            value = getattr(self, name)
            if not 0 <= value <= MAX_REQUESTS:
                raise ValueError(f"report.{name} must be in [0, {MAX_REQUESTS}], got {value}")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"report.kv_usage must be in [0, 1], got {self.kv_usage}")


@dataclass(frozen=True, slots=True)
class Foreign:
    """Load on the engine that this node did not send."""

    running: int = 0
    waiting: int = 0
    kv_tokens: int = 0  # KV the foreign running requests hold

    @property
    def total(self) -> int:
        return self.running + self.waiting


NO_FOREIGN = Foreign()


def parse_metrics(text: str) -> EngineReport:
    """The running / waiting gauges and KV usage of Prometheus exposition ``text`` (module
    docstring); ValueError naming the metric when one is missing or not a number."""
    seen: dict[tuple[str, int], list[float]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or m.group(1) not in _ALIAS:
            continue  # comments, other metrics, anything unreadable that is not ours
        seen.setdefault(_ALIAS[m.group(1)], []).append(_value(m.group(1), m.group(2)))
    got: dict[str, list[float]] = {}
    for metric, names in _NAMES.items():
        got[metric] = next((seen[(metric, r)] for r in range(len(names)) if (metric, r) in seen),
                           [])
        if not got[metric]:
            raise ValueError(f"/metrics: no {metric}")
    usage = got[KV_USAGE]
    return EngineReport(_count(RUNNING, sum(got[RUNNING])), _count(WAITING, sum(got[WAITING])),
                        _fraction(KV_USAGE, sum(usage) / len(usage)))


def _value(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"/metrics: {name} value {raw[:32]!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"/metrics: {name} value {raw[:32]!r} is not finite")
    return value


def _count(name: str, value: float) -> int:
    if not 0 <= value <= MAX_REQUESTS or value != int(value):
        raise ValueError(f"/metrics: {name} must be a count of requests, got {value}")
    return int(value)


def _fraction(name: str, value: float) -> float:
    if not -1e-9 <= value <= 1.0 + 1e-9:
        raise ValueError(f"/metrics: {name} must be in [0, 1], got {value}")
    return min(max(value, 0.0), 1.0)


def reconcile(report: EngineReport, own_open: int, own_waiting: int, own_kv: int,
              kv_tokens: int) -> Foreign:
    """The engine's load beyond this node's (module docstring): ``own_open`` requests sent
    and not ended, ``own_waiting`` of them waiting in the shadow, holding ``own_kv`` KV
    tokens there, of an engine with ``kv_tokens`` KV capacity."""
    if min(own_open, own_waiting, own_kv) < 0 or kv_tokens < 1:
        raise ValueError("reconcile: counts must be >= 0 and kv_tokens >= 1")
    total = max(0, report.running + report.waiting - own_open)
    waiting = min(total, max(0, report.waiting - own_waiting))
    running = total - waiting
    kv = max(0, round(report.kv_usage * kv_tokens) - own_kv) if running else 0
    return Foreign(running, waiting, min(kv, kv_tokens))
