"""``GET /metrics`` of the emulated engine: Prometheus text with vLLM 0.32's metric names.

Theory of operation
-------------------
The names a dashboard or a router scrapes from a real vLLM V1 engine
(``vllm/v1/metrics/loggers.py``, labels ``model_name`` and ``engine``): gauges
``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
(0..1), counters ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (prompt
tokens looked up / found), ``vllm:num_preemptions_total``, ``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``. Then the emulator's own: ``emulator_lag_seconds_total`` (how
much later than the profile planned its steps ended) against ``emulator_busy_seconds_total``
(the planned step time), steps, malformed requests, disconnects, KV-event batches, and an
``emulator_info`` line naming the profile. Rendered fresh from the engine's state on each
scrape; nothing here mutates.
"""

from __future__ import annotations

from collections.abc import Mapping

from radixmesh.emulate.loop import EngineLoop


def _line(name: str, labels: dict[str, str], value: float) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return f"{name}{{{inner}}} {float(value)}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(loop: EngineLoop, model: str, server: Mapping[str, float]) -> str:
    """The exposition text; ``server`` holds the HTTP side's counters (``bad_requests``,
    ``disconnects``, ``kv_event_batches``)."""
    labels = {"model_name": model, "engine": "0"}
    out: list[str] = []
    for name, kind, help_, value in _rows(loop, server):
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}",
                _line(name, labels, value)]
    info = {**labels, "profile": loop.profile.name, "hardware": loop.profile.hardware,
            "emulated": "true", "time_scale": str(loop.time_scale)}
    out += ["# HELP emulator_info The emulated engine's profile.", "# TYPE emulator_info gauge",
            _line("emulator_info", info, 1)]
    return "\n".join(out) + "\n"


def _rows(loop: EngineLoop, server: Mapping[str, float]
          ) -> list[tuple[str, str, str, float]]:
    """(name, type, help, value) of every metric but the info line."""
    sched = loop.scheduler
    c = loop.counters
    return [
        ("vllm:num_requests_running", "gauge", "Number of requests in model execution "
         "batches.", sched.running),
        ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
         sched.waiting),
        ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
         sched.kv_usage),
        ("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of "
         "number of queried tokens.", c.prefix_queries),
        ("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of "
         "cached tokens.", c.prefix_hits),
        ("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the "
         "engine.", sched.preemptions),
        ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
         c.prompt_tokens),
        ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
         c.generation_tokens),
        ("emulator_lag_seconds_total", "counter", "Seconds steps ended later than the "
         "profile planned.", c.lag_s),
        ("emulator_busy_seconds_total", "counter", "Planned step seconds (profile x time "
         "scale).", c.busy_s),
        ("emulator_steps_total", "counter", "Engine steps run.", c.steps),
        ("emulator_bad_requests_total", "counter", "Requests refused with HTTP 400.",
         server["bad_requests"]),
        ("emulator_disconnects_total", "counter", "Requests whose client went away.",
         server["disconnects"]),
        ("emulator_kv_event_batches_total", "counter", "KV-event batches published.",
         server["kv_event_batches"]),
    ]
