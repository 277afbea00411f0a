"""A benchmark mesh of emulated GPU engines: each node fronts its own ``radixmesh emulate``.

Theory of operation
-------------------
``radixmesh bench --engine emulated --profiles h100-llama3-8b:4,a10g-llama3-8b:12`` gives each
node an emulated vLLM engine (``radixmesh emulate``: the core scheduler on the wall clock, step
times from a cited profile, vLLM's HTTP API and KV events) in a process of its own, which the
node starts itself (``serve --launch``) and fronts with ``--engine vllm`` exactly as it fronts a
real vLLM: the node knows of its engine only what a gateway could (its API, its ``/metrics``,
its KV events). Profiles with counts are dealt to the nodes in order; a bare name is every node.

Time scale. A 2-core machine cannot run 16 GPU-speed engines and their nodes in real time (each
engine streams one SSE chunk per token). ``--time-scale S`` makes every emulated step last S
times the profile's time, and the harness stretches everything else that is time by the same S
— link delays, gossip intervals, silence timeouts, open-loop arrival times — so the whole mesh
runs S times slower than the deployment it stands for, as Dynamo's mocker's speed-up ratio
does. Every figure the harness records (latency, TTFT, TPOT, server timings, arrival and
completion times, measured capacity) is divided back by S: reports are in unscaled time. The
node's own CPU work is not stretched, so at large S the mesh's overhead is understated by S;
each engine exports its lag behind the profile (``emulator_lag_seconds_total`` against
``emulator_busy_seconds_total``), which the harness reads after a run (bench/after_run.py).

Tokens: the engines and nodes share the byte tokenizer (``--tokenizer bytes``); one prompt
character is one token, so prompts are ~4-5x longer in tokens than under a BPE vocabulary.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from radixmesh.core.profile import resolve
from radixmesh.core.profile_mix import parse_profiles
from radixmesh.workload.request import Request

BYTES = "bytes"  # the node's and the engines' tokenizer
PLANNED = "planned from the engines' profiles"  # the capacity basis of --load (CapacityProbe)
__all__ = [
    "BYTES", "PLANNED", "context_length", "engine_options", "parse_profiles", "planned_capacity",
]


def engine_options(profile: str, ports: Sequence[int], time_scale: float) -> dict[str, object]:
    """``serve`` options of one node fronting its own emulated engine; ``ports`` = the engine's
    HTTP, KV-event and replay ports."""
    http, events, replay = ports
    launch = [sys.executable, "-m", "radixmesh", "emulate", "--profile", profile,
              "--port", str(http), "--kv-events", f"tcp://*:{events}",
              "--kv-replay", f"tcp://*:{replay}", "--time-scale", f"{time_scale:g}"]
    return {
        "engine": "vllm",
        "engine_url": f"http://127.0.0.1:{http}",
        "kv_events": f"tcp://*:{events}",
        "kv_replay": f"tcp://*:{replay}",
        "tokenizer": BYTES,
        "launch": " ".join(launch),
        "profile": profile,
        "profile_time_scale": time_scale,
    }


def context_length(profiles: Sequence[str]) -> int:
    """The shortest context among the mesh's engines (a prompt must fit any of them)."""
    return min(resolve(p).context_length for p in set(profiles))


def planned_capacity(profiles: str, nodes: int, requests: Sequence[Request]) -> float:
    """Requests/s the mesh's engines sustain by their profiles, unscaled: what ``--load``
    is a fraction of on an emulated mesh, the simulator's figure (``sim.sweep.capacity_rate``:
    each engine's largest batch within the TPOT SLO, 85 % of a typical prompt cached; under
    mixed hardware what ``none``'s even spread sustains), so that ``bench`` and ``sim`` mean
    one load. A closed-loop probe cannot measure it here: one client per node leaves a
    batching engine nearly idle (16 clients measured 186 req/s where 16 H100s plan 1,067)."""
    from radixmesh.sim.sweep import capacity_rate, mean_prompt_tokens, profile_costs
    from radixmesh.sim.tokens import TOKENIZERS

    costs = profile_costs(profiles, nodes)
    tokenize, _ = TOKENIZERS[BYTES]()
    reqs = list(requests)
    prompt = mean_prompt_tokens(reqs, tokenize)
    return capacity_rate(costs[0], nodes, prompt, reqs[0].max_tokens, None, costs)
