"""Operating figures: join time, a rolling restart under load, overload at 2x capacity.

``radixmesh chaos --operate join|rolling|overload`` (see ``chaos/cli.py``); each prints its
figures and returns a JSON-able report. Nothing here asserts a timing: these are benchmarks.

join (emulated hosts, root only)
    N hosts (Linux network namespaces on one bridge, ``testing/netns.py``), one
    ``radixmesh serve`` per host bound to the host's own address, every node given ONE seed
    (h1). N-1 nodes start, each executes one request (so every node has a cache view worth
    sending), and the mesh converges. Then the N-th node starts, and we measure from its spawn
    to (1) ``/health`` answering (process start, model build) and (2) a converged view: every
    node lists every other node alive, with its current incarnation and ``view_version`` equal
    to that node's own summary version (``GET /mesh``). Repeated ``trials`` times: the new
    node is stopped with SIGTERM and started again (a new incarnation) each time.

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
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from radixmesh.chaos.env import HOP, ChaosConfig, ChaosEnv
from radixmesh.chaos.load import Outcome, Prompt, open_loop, send_one
from radixmesh.chaos.report import rss_bytes
from radixmesh.results.summary import percentile
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


def _latency(outcomes: Sequence[Outcome], status: int = 200) -> dict[str, float | None]:
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
    done: list[Outcome] = []
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
                           t0: float) -> list[Outcome]:
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
                   rate: float) -> tuple[dict[str, object], list[Outcome]]:
    n = len(env.cluster)
    ready = set(range(n))
    stop = asyncio.Event()
    t0 = time.monotonic()
    marks: dict[str, float] = {}
    restarts: list[dict[str, object]] = []
    counters: dict[str, dict[str, dict[str, float]]] = {}

    async def probe() -> None:
        async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
            while not stop.is_set():
                for i in range(n):
                    try:
                        ok = (await client.get(env.url(i) + "/health")).status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    (ready.add if ok else ready.discard)(i)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(cfg.probe_s):
                        await stop.wait()

    def entry(i: int) -> str:
        live = sorted(ready) or list(range(n))
        return env.url(live[i % len(live)])

    async def restart_all() -> None:
        await asyncio.sleep(cfg.before_s)
        marks["first_sigterm"] = time.monotonic() - t0
        for i in range(n):
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
            restarts.append({"node": node.node_id, "exit_rc": rc,
                             "sigterm_to_exit_s": round(t_exit - t_sig, 2),
                             "exit_to_rejoined_s": round(t_back - t_exit, 2),
                             "incarnation_changed": node.incarnation != old})
            print(f"[rolling] {node.node_id}: rc {rc}, drained in {t_exit - t_sig:.2f} s, "
                  f"back and rejoined {t_back - t_exit:.1f} s later", flush=True)
        marks["last_rejoined"] = time.monotonic() - t0
        await asyncio.sleep(cfg.after_s)
        counters["end"] = await _counters(env)
        stop.set()

    tasks = [asyncio.create_task(probe()), asyncio.create_task(restart_all())]
    try:
        outcomes = await _open_loop_until(entry, lambda i: prompts[i % len(prompts)],
                                          env.model, rate, stop, cfg.timeout_s, t0)
    finally:
        stop.set()
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        await asyncio.gather(*tasks, return_exceptions=True)
    start, end = marks["first_sigterm"], marks["last_rejoined"]
    phases = {"before": [o for o in outcomes if o.t_start < start],
              "during": [o for o in outcomes if start <= o.t_start < end],
              "after": [o for o in outcomes if o.t_start >= end]}
    failed = [o for o in outcomes if not o.ok]
    report: dict[str, object] = {
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
    return report, outcomes


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
                    rate: float) -> tuple[dict[str, object], list[Outcome]]:
    n = len(env.cluster)
    stop = asyncio.Event()
    sampling = asyncio.Event()
    peaks: dict[str, dict[str, float]] = {node.node_id: {"rss_mb": 0.0, "queue_depth": 0.0}
                                          for node in env.cluster.nodes}
    start_rss = {node.node_id: (rss_bytes(node.pid) or 0) / 2**20
                 for node in env.cluster.nodes if node.pid is not None}

    async def sample() -> None:
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            while not sampling.is_set():
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
                    async with asyncio.timeout(cfg.rss_every_s):
                        await sampling.wait()

    async def stop_later() -> None:
        await asyncio.sleep(cfg.duration_s)
        stop.set()

    t0 = time.monotonic()
    tasks = [asyncio.create_task(sample()), asyncio.create_task(stop_later())]
    try:
        outcomes = await _open_loop_until(lambda i: env.url(i % n),
                                          lambda i: prompts[i % len(prompts)], env.model,
                                          rate, stop, cfg.timeout_s, t0)
    finally:
        stop.set()
        sampling.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    ok = [o for o in outcomes if o.ok]
    rejected = [o for o in outcomes if o.status == 429]
    lost = [o for o in outcomes if not o.ok and o.status != 429]
    half = cfg.duration_s / 2
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
        "served_s": round(time.monotonic() - t0, 1),
        "rss_mb_at_start": {k: round(v, 1) for k, v in start_rss.items()},
        "peaks": peaks,
    }, outcomes


# ------------------------------------------------------------------------------ join
@dataclass(frozen=True, slots=True)
class JoinConfig:
    hosts: int = 4
    preset: str = "micro"
    trials: int = 3
    gossip_interval: float = 0.5  # the default (GossipConfig.lan)
    port: int = 8000
    start_timeout_s: float = 600.0  # N torch processes starting on a shared 2-core box
    converge_timeout_s: float = 120.0
    poll_s: float = 0.1


def _serve_argv(net: Any, host: str, cfg: JoinConfig) -> list[str]:
    script = Path(sys.executable).parent / "radixmesh"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "radixmesh.cli"]
    return [*cmd, "serve", "--host", net.address(host), "--port", str(cfg.port),
            "--node-id", host, "--preset", cfg.preset, "--threads", "1",
            "--gossip-interval", str(cfg.gossip_interval),
            "--join", f"{net.address('h1')}:{cfg.port}", "--drain-grace", "5s",
            "--dead-timeout", "60"]


class _Meshes:
    """``GET /mesh`` of every host, and the convergence test over them."""

    def __init__(self, net: Any, port: int) -> None:
        self.net, self.port = net, port
        self.http = httpx.Client(timeout=2.0, trust_env=False)

    def url(self, host: str) -> str:
        return f"http://{self.net.address(host)}:{self.port}"

    def get(self, host: str) -> dict[str, Any] | None:
        try:
            resp = self.http.get(self.url(host) + "/mesh")
        except httpx.HTTPError:
            return None
        return resp.json() if resp.status_code == 200 else None

    def stale(self, hosts: Sequence[str]) -> str | None:
        """Why the views among ``hosts`` are not converged, or None when they are."""
        meshes = {}
        for host in hosts:
            mesh = self.get(host)
            if mesh is None:
                return f"{host} not answering"
            meshes[host] = mesh
        for host, mesh in meshes.items():
            seen = {p["node_id"]: p for p in mesh.get("peers", [])}
            for other, truth in meshes.items():
                if other == host:
                    continue
                p = seen.get(other)
                if p is None or p.get("state") != "alive":
                    return f"{host} -> {other}: {'unknown' if p is None else p.get('state')}"
                if p.get("incarnation") != truth["incarnation"]:
                    return f"{host} -> {other}: old incarnation"
                if p.get("view_version") != truth["version"]:
                    return f"{host} -> {other}: view {p.get('view_version')} != {truth['version']}"
        return None

    def wait(self, check: Callable[[], bool], timeout_s: float, poll_s: float, what: str,
             procs: dict[str, Any]) -> float:
        t0 = time.monotonic()
        while not check():
            for host, proc in procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{host} exited (rc {proc.returncode}) waiting for {what}")
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
            time.sleep(poll_s)
        return time.monotonic() - t0


def run_join(cfg: JoinConfig, log_dir: str | None = None) -> dict[str, object]:
    """The join figure on ``cfg.hosts`` emulated hosts (see the module doc). Root only."""
    from radixmesh.testing.netns import EmulatedHosts, netns_unavailable, reap_stale

    reason = netns_unavailable()
    if reason is not None:
        raise RuntimeError(f"emulated hosts need Linux network namespaces: {reason}")
    reap_stale()
    names = [f"h{i + 1}" for i in range(cfg.hosts)]
    logs = Path(log_dir or tempfile.mkdtemp(prefix="radixmesh-join-"))
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RADIXMESH_CLUSTER_KEY", None)
    trials: list[dict[str, float]] = []
    with EmulatedHosts(names) as net:
        meshes = _Meshes(net, cfg.port)
        old, new = names[:-1], names[-1]
        t0 = time.monotonic()
        procs = {h: net.spawn(h, _serve_argv(net, h, cfg), logs / f"{h}.log", env=env)
                 for h in old}
        meshes.wait(lambda: meshes.stale(old) is None, cfg.start_timeout_s, 0.5,
                    f"{len(old)} nodes to converge", procs)
        started = time.monotonic() - t0
        for host in old:  # a cache worth gossiping on every node
            body = {"model": cfg.preset, "prompt": f"Host {host} caches this prefix. " * 8,
                    "max_tokens": 2, "temperature": 0}
            meshes.http.post(meshes.url(host) + "/v1/completions", json=body, headers=HOP,
                             timeout=60.0).raise_for_status()
        meshes.wait(lambda: meshes.stale(old) is None, cfg.converge_timeout_s, cfg.poll_s,
                    "views of the caches", procs)
        print(f"[join] {len(old)} hosts up and converged {started:.1f} s after spawn",
              flush=True)
        for trial in range(cfg.trials):
            t_spawn = time.monotonic()
            procs[new] = net.spawn(new, _serve_argv(net, new, cfg), logs / f"{new}.log", env=env)
            ready = meshes.wait(lambda: meshes.get(new) is not None, cfg.start_timeout_s,
                                cfg.poll_s, f"{new} to answer", procs)
            converged = meshes.wait(lambda: meshes.stale(names) is None,
                                    cfg.converge_timeout_s, cfg.poll_s,
                                    "the new node's view to converge", procs)
            trials.append({"spawn_to_health_s": round(ready, 2),
                           "health_to_converged_s": round(converged, 2),
                           "spawn_to_converged_s": round(time.monotonic() - t_spawn, 2)})
            print(f"[join] {cfg.hosts} hosts, trial {trial + 1}: {new} answered "
                  f"{ready:.2f} s after spawn, converged view {converged:.2f} s later",
                  flush=True)
            proc = procs.pop(new)
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
            # the others mark the old incarnation dead only after --dead-timeout; the next
            # trial's node is a new incarnation, which they must take over at once
    gossip = cfg.gossip_interval
    after = [t["health_to_converged_s"] for t in trials]
    return {"hosts": cfg.hosts, "preset": cfg.preset, "gossip_interval_s": gossip,
            "existing_nodes_start_s": round(started, 1), "trials": trials,
            "health_to_converged_s_max": max(after),
            "health_to_converged_rounds_max": round(max(after) / gossip, 1),
            "config": asdict(cfg)}


def with_extra(cfg: OperateConfig, extra: dict[str, object]) -> OperateConfig:
    return replace(cfg, extra=tuple({**dict(cfg.extra), **extra}.items()))
