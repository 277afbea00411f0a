"""Operating figures: a rolling restart under load, overload at 2x capacity.

``radixmesh chaos --operate rolling|overload`` (see ``chaos/cli.py``; ``--operate join`` is
``chaos/join.py``'s); each prints its figures and returns a JSON-able report. Nothing here
asserts a timing: these are benchmarks.

rolling (loopback cluster)
    Capacity first: a closed loop with ``4 x nodes`` clients for ``capacity_s`` gives the
    mesh's completions per second. Then open-loop arrivals at ``load`` x capacity, entry nodes
    picked round-robin from those whose ``/health`` answered 200 at the last probe (every
    ``probe_s``, like a load balancer's readiness check: a node that drains answers 503 and
    leaves the rotation within one probe). After ``before_s`` every node in turn gets SIGTERM,
    drains (``--drain-grace``), exits, is started again (new incarnation) and rejoins (every
    node sees every other alive, current incarnation) before the next one goes. Reported:
    failed requests (any answer but 200, or none), answers that differ from the single-node
    greedy reference, p50/p99 before / during / after.

overload (loopback cluster)
    Capacity as above, then open-loop arrivals at ``load`` (2) x capacity for ``duration_s``,
    round-robin over all nodes, clients without retries. Reported: admitted p50/p99, the share
    answered 429 (with Retry-After), requests lost (no answer, or any status but 200 or 429:
    must be 0), peak RSS per node (sampled every ``rss_every_s``) and queue depths.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import httpx

from radixmesh.chaos.env import ChaosConfig, ChaosEnv
from radixmesh.chaos.load import ClientOutcome, Prompt, open_loop, send_one
from radixmesh.chaos.report import rss_bytes
from radixmesh.results.run_summary import percentile
from radixmesh.runtime.metrics import parse_samples


# ------------------------------------------------------------------------------ shared
@dataclass(frozen=True, slots=True)
class OperateConfig:
    nodes: int = 3
    preset: str = "micro"
    max_tokens: int = 16  # output tokens per request (greedy)
    capacity_s: float = 15.0  # closed-loop measurement of the mesh's capacity
    load: float = 0.5  # open-loop rate as a multiple of the measured capacity
    duration_s: float = 60.0  # overload: how long arrivals go on
    before_s: float = 20.0  # rolling: load before the first SIGTERM
    after_s: float = 10.0  # rolling: load after the last node rejoined
    probe_s: float = 0.5  # rolling: readiness probe period of the emulated load balancer
    drain_grace: float = 30.0
    rss_every_s: float = 1.0
    timeout_s: float = 180.0  # client timeout: longer than any admitted wait
    extra: tuple[tuple[str, object], ...] = ()  # more `radixmesh serve` options for every node
    seed: int = 0


def _latency(outcomes: Sequence[ClientOutcome], status: int = 200) -> dict[str, float | None]:
    """Client latency of the outcomes with ``status`` (200: and no error), and for 200s the
    serving node's own queue + service time (its response headers)."""
    picked = [o for o in outcomes if o.status == status and (status != 200 or o.error is None)]
    lat = [o.latency_s for o in picked]
    out: dict[str, float | None] = {
        "n": float(len(lat)), "p50_s": _r(percentile(lat, 50)), "p99_s": _r(percentile(lat, 99)),
        "max_s": _r(max(lat) if lat else None)}
    ttft = [o.ttft_s for o in picked if o.ttft_s is not None]  # streamed (chaos/load.py)
    if ttft:
        out.update(ttft_p50_s=_r(percentile(ttft, 50)), ttft_p99_s=_r(percentile(ttft, 99)))
    server = [o.server_s for o in picked if o.server_s is not None]
    if server:
        out.update(server_p50_s=_r(percentile(server, 50)), server_p99_s=_r(percentile(server, 99)))
    return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _env(cfg: OperateConfig, log_dir: str | None) -> ChaosEnv:
    options: dict[str, object] = {"preset": cfg.preset, "seed": cfg.seed,
                                  "drain_grace": cfg.drain_grace, **dict(cfg.extra)}
    chaos = ChaosConfig(nodes=cfg.nodes, max_tokens=cfg.max_tokens, log_dir=log_dir,
                        serve=tuple(options.items()))
    return ChaosEnv(chaos)


def _prompts(env: ChaosEnv) -> list[Prompt]:
    """Every prompt of the environment, groups interleaved (hot prefixes on every node)."""
    groups = env.groups
    out: list[Prompt] = []
    for k in range(max(len(g) for g in groups)):
        out.extend(g[k] for g in groups if k < len(g))
    return out


def _warmed_capacity(env: ChaosEnv, cfg: OperateConfig) -> tuple[list[Prompt], dict[str, float]]:
    """The run's prompts (their reference answers recorded), every node warmed with some of
    their prefixes, then the mesh's measured capacity."""
    prompts = _prompts(env)
    env.references(prompts)
    for i in range(len(env.cluster)):
        env.warm(i, prompts[i::len(env.cluster)][:4])
    return prompts, measure_capacity(env, prompts, cfg.capacity_s, 4 * cfg.nodes)


def measure_capacity(env: ChaosEnv, prompts: Sequence[Prompt], seconds: float,
                     clients: int) -> dict[str, float]:
    """Completions per second of the whole mesh under a closed loop of ``clients``."""
    n = len(env.cluster)
    done: list[ClientOutcome] = []
    t0 = time.monotonic()
    cycle = [prompts[i % len(prompts)] for i in range(100_000)]

    async def run() -> None:
        stop_at = t0 + seconds
        index = 0

        async def worker(client: httpx.AsyncClient) -> None:
            nonlocal index
            while time.monotonic() < stop_at:
                i = index
                index += 1
                done.append(await send_one(client, env.url(i % n), cycle[i], env.model, t0))

        async with httpx.AsyncClient(trust_env=False) as client:
            await asyncio.gather(*(worker(client) for _ in range(clients)))

    asyncio.run(run())
    elapsed = time.monotonic() - t0
    ok = [o for o in done if o.ok]
    return {"clients": float(clients), "seconds": round(elapsed, 1),
            "completed": float(len(ok)), "failed": float(len(done) - len(ok)),
            "per_s": round(len(ok) / elapsed, 2)}


async def _open_loop_until(entry: Callable[[int], str], prompt_at: Callable[[int], Prompt],
                           model: str, rate: float, stop: asyncio.Event, timeout_s: float,
                           t0: float) -> list[ClientOutcome]:
    """Arrivals every ``1/rate`` s until ``stop`` is set; waits for every answer."""
    return await open_loop(entry, prompt_at, model, rate, None, timeout_s, stop=stop, t0=t0)


# ------------------------------------------------------------------------------ rolling
def run_rolling(cfg: OperateConfig, log_dir: str | None = None) -> dict[str, object]:
    with _env(cfg, log_dir) as env:
        prompts, capacity = _warmed_capacity(env, cfg)
        rate = max(cfg.load * capacity["per_s"], 0.5)
        print(f"[rolling] capacity {capacity['per_s']} req/s -> open loop at {rate:.2f} req/s",
              flush=True)
        report, outcomes = asyncio.run(_rolling(env, cfg, prompts, rate))
        lost = env.lost(outcomes)
    report.update(capacity=capacity, rate=round(rate, 2), wrong_or_lost=len(lost),
                  config=asdict(cfg))
    return report


async def _rolling(env: ChaosEnv, cfg: OperateConfig, prompts: Sequence[Prompt],
                   rate: float) -> tuple[dict[str, object], list[ClientOutcome]]:
    n = len(env.cluster)
    ready = set(range(n))
    stop = asyncio.Event()
    t0 = time.monotonic()
    marks: dict[str, float] = {}
    restarts: list[dict[str, object]] = []
    counters: dict[str, dict[str, dict[str, float]]] = {}

    def entry(i: int) -> str:
        live = sorted(ready) or list(range(n))
        return env.url(live[i % len(live)])

    async def restart_all() -> None:
        await asyncio.sleep(cfg.before_s)
        marks["first_sigterm"] = time.monotonic() - t0
        for i in range(n):
            restarts.append(await _restart(env, cfg, i, counters))
        marks["last_rejoined"] = time.monotonic() - t0
        await asyncio.sleep(cfg.after_s)
        counters["end"] = await _counters(env)
        stop.set()

    tasks = [asyncio.create_task(_probe(env, cfg.probe_s, ready, stop)),
             asyncio.create_task(restart_all())]
    try:
        outcomes = await _open_loop_until(entry, lambda i: prompts[i % len(prompts)],
                                          env.model, rate, stop, cfg.timeout_s, t0)
    finally:
        stop.set()
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        await asyncio.gather(*tasks, return_exceptions=True)
    return _rolling_report(outcomes, marks, restarts, counters), outcomes


async def _probe(env: ChaosEnv, every_s: float, ready: set[int], stop: asyncio.Event) -> None:
    """The emulated load balancer's readiness check: ``ready`` holds the nodes whose
    ``/health`` answered 200 at the last probe, every ``every_s`` until ``stop``."""
    async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
        while not stop.is_set():
            for i in range(len(env.cluster)):
                try:
                    ok = (await client.get(env.url(i) + "/health")).status_code == 200
                except httpx.HTTPError:
                    ok = False
                (ready.add if ok else ready.discard)(i)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(every_s):
                    await stop.wait()


async def _restart(env: ChaosEnv, cfg: OperateConfig, i: int,
                   counters: dict[str, dict[str, dict[str, float]]]) -> dict[str, object]:
    """SIGTERM node ``i``, wait for its exit, start it again until every node sees it alive;
    its row of the report (its counters just before the signal go into ``counters``)."""
    node = env.cluster.nodes[i]
    proc = node.process
    assert proc is not None
    old = node.incarnation
    counters[f"before SIGTERM {node.node_id}"] = await _counters(env)
    t_sig = time.monotonic()
    env.cluster.kill(i, signal.SIGTERM)
    rc = await asyncio.to_thread(proc.wait, cfg.drain_grace + 15)
    t_exit = time.monotonic()
    await asyncio.to_thread(env.cluster.restart, i, True)  # spawn + every node alive
    t_back = time.monotonic()
    print(f"[rolling] {node.node_id}: rc {rc}, drained in {t_exit - t_sig:.2f} s, "
          f"back and rejoined {t_back - t_exit:.1f} s later", flush=True)
    return {"node": node.node_id, "exit_rc": rc,
            "sigterm_to_exit_s": round(t_exit - t_sig, 2),
            "exit_to_rejoined_s": round(t_back - t_exit, 2),
            "incarnation_changed": node.incarnation != old}


def _rolling_report(outcomes: Sequence[ClientOutcome], marks: dict[str, float],
                    restarts: list[dict[str, object]],
                    counters: dict[str, dict[str, dict[str, float]]]) -> dict[str, object]:
    start, end = marks["first_sigterm"], marks["last_rejoined"]
    phases = {"before": [o for o in outcomes if o.t_start < start],
              "during": [o for o in outcomes if start <= o.t_start < end],
              "after": [o for o in outcomes if o.t_start >= end]}
    failed = [o for o in outcomes if not o.ok]
    return {
        "requests": len(outcomes),
        "failed": len(failed),
        "failure_examples": [f"{o.entry}: {o.status} {o.error}" for o in failed[:5]],
        "restarts": restarts,
        "rolling_s": round(end - start, 1),
        **{phase: _latency(outs) for phase, outs in phases.items()},
        "routes_during": _count(o.route or "none" for o in phases["during"]),
        "failed_at_s": [round(o.t_start, 1) for o in failed],
        "counters": counters,
    }


_COUNTERS = ("radixmesh_core_admission_full_", "radixmesh_core_requests_rejected",
             "radixmesh_core_forwards_refused", "radixmesh_drain_cancelled")


async def _counters(env: ChaosEnv) -> dict[str, dict[str, float]]:
    """Admission, rejection and drain counters of every running node (its /metrics)."""
    out: dict[str, dict[str, float]] = {}
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
        for node in env.cluster.nodes:
            if not node.running:
                continue
            with contextlib.suppress(httpx.HTTPError):
                samples = parse_samples((await client.get(node.url + "/metrics")).text)
                out[node.node_id] = {k.removeprefix("radixmesh_"): v for k, v in samples.items()
                                     if k.startswith(_COUNTERS) and v}
    return out


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


# ------------------------------------------------------------------------------ overload
def run_overload(cfg: OperateConfig, log_dir: str | None = None) -> dict[str, object]:
    with _env(cfg, log_dir) as env:
        prompts, capacity = _warmed_capacity(env, cfg)
        rate = cfg.load * capacity["per_s"]
        print(f"[overload] capacity {capacity['per_s']} req/s -> open loop at {rate:.2f} req/s "
              f"for {cfg.duration_s:.0f} s", flush=True)
        report, outcomes = asyncio.run(_overload(env, cfg, prompts, rate))
        wrong = env.lost([o for o in outcomes if o.status == 200])
    report.update(capacity=capacity, rate=round(rate, 2), wrong_answers=len(wrong),
                  config=asdict(cfg))
    return report


async def _overload(env: ChaosEnv, cfg: OperateConfig, prompts: Sequence[Prompt],
                    rate: float) -> tuple[dict[str, object], list[ClientOutcome]]:
    n = len(env.cluster)
    stop = asyncio.Event()
    sampling = asyncio.Event()
    peaks: dict[str, dict[str, float]] = {node.node_id: {"rss_mb": 0.0, "queue_depth": 0.0}
                                          for node in env.cluster.nodes}
    start_rss = {node.node_id: (rss_bytes(node.pid) or 0) / 2**20
                 for node in env.cluster.nodes if node.pid is not None}

    async def stop_later() -> None:
        await asyncio.sleep(cfg.duration_s)
        stop.set()

    t0 = time.monotonic()
    tasks = [asyncio.create_task(_sample_peaks(env, cfg.rss_every_s, peaks, sampling)),
             asyncio.create_task(stop_later())]
    try:
        outcomes = await _open_loop_until(lambda i: env.url(i % n),
                                          lambda i: prompts[i % len(prompts)], env.model,
                                          rate, stop, cfg.timeout_s, t0)
    finally:
        stop.set()
        sampling.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    report = _overload_report(outcomes, cfg.duration_s / 2)
    report.update(served_s=round(time.monotonic() - t0, 1),
                  rss_mb_at_start={k: round(v, 1) for k, v in start_rss.items()}, peaks=peaks)
    return report, outcomes


async def _sample_peaks(env: ChaosEnv, every_s: float, peaks: dict[str, dict[str, float]],
                        done: asyncio.Event) -> None:
    """Every ``every_s`` until ``done``: each node's RSS and queue depth (its /metrics),
    the highest seen kept in ``peaks``."""
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
        while not done.is_set():
            for node in env.cluster.nodes:
                peak = peaks[node.node_id]
                rss = rss_bytes(node.pid) if node.pid is not None else None
                if rss is not None:
                    peak["rss_mb"] = max(peak["rss_mb"], round(rss / 2**20, 1))
                with contextlib.suppress(httpx.HTTPError):
                    text = (await client.get(node.url + "/metrics")).text
                    depth = parse_samples(text).get("radixmesh_queue_depth", 0.0)
                    peak["queue_depth"] = max(peak["queue_depth"], depth)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(every_s):
                    await done.wait()


def _overload_report(outcomes: Sequence[ClientOutcome], half: float) -> dict[str, object]:
    """Admitted, rejected (429) and lost requests; ``half``: when the second half began."""
    ok = [o for o in outcomes if o.ok]
    rejected = [o for o in outcomes if o.status == 429]
    lost = [o for o in outcomes if not o.ok and o.status != 429]
    return {
        "requests": len(outcomes),
        "admitted": len(ok),
        "rejected_429": len(rejected),
        "rejected_share": round(len(rejected) / max(len(outcomes), 1), 3),
        "rejected_share_second_half": round(
            sum(1 for o in rejected if o.t_start >= half)
            / max(sum(1 for o in outcomes if o.t_start >= half), 1), 3),
        "lost": len(lost),
        "lost_examples": [f"{o.entry} at {o.t_start:.1f} s after {o.latency_s:.1f} s: "
                          f"{o.status} {o.error}" for o in lost[:5]],
        "admitted_latency": _latency(outcomes),
        "rejected_latency": _latency(outcomes, 429),
    }


def with_extra(cfg: OperateConfig, extra: dict[str, object]) -> OperateConfig:
    return replace(cfg, extra=tuple({**dict(cfg.extra), **extra}.items()))
