"""Soak: open-loop load at a sustainable rate for a long time, with kill -9s and restarts.

Theory of operation
-------------------
::

    load     ── arrivals every 1/rate s, each to an entry node ─────────────────────────▶
    chaos    ──── drain v ── kill -9 v ── restart v (new incarnation) ── undrain v ──── ...
    sampler  ── RSS of every node, every sample_every_s ───────────────────────────────▶

Victims cycle over nodes 1..N-1 (node 0 is always up). A victim is first removed from the
entry rotation ("drained", as a load balancer's health check would), so no *client* connection
ends at a dead node; requests that were forwarded *to* it are in flight when it dies, and those
must still succeed (fallback). Every answer is compared with the single-node greedy reference.

At the end the load stops, queues drain, and every node must report 0 locked radix-cache tokens
(``radixmesh_cache_locked_tokens``): a request that died half-way must not leak a lock. RSS is
reported over time per node, so unbounded growth is visible.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from dataclasses import dataclass, field

import httpx

from radixmesh.chaos.env import ChaosEnv
from radixmesh.chaos.load import ClientOutcome, Prompt, open_loop, summarize
from radixmesh.chaos.report import rss_bytes
from radixmesh.results.run_summary import percentile
from radixmesh.runtime.metrics import parse_samples


@dataclass(frozen=True, slots=True)
class SoakConfig:
    duration_s: float = 600.0
    rate: float = 3.0  # requests per second (open loop)
    kill_every_s: float = 45.0  # one kill -9 + restart cycle per this many seconds
    sample_every_s: float = 10.0
    hot_share: float = 0.8  # share of requests drawn from the 3 hottest groups
    seed: int = 0


@dataclass(slots=True)
class _State:
    drained: set[int] = field(default_factory=set)
    kills: int = 0
    restarts: int = 0
    events: list[str] = field(default_factory=list)
    rss: list[dict[str, object]] = field(default_factory=list)
    stop: bool = False
    chaos_error: str | None = None  # the kill/restart loop broke (e.g. a node never rejoined)
    down: list[str] = field(default_factory=list)  # nodes not running when the load ended
    locks: dict[str, float | str] = field(default_factory=dict)  # locked tokens at the end


def _prompt_picker(env: ChaosEnv, cfg: SoakConfig) -> list[Prompt]:
    rng = random.Random(cfg.seed)
    n = max(1, int(cfg.rate * cfg.duration_s))
    hot = env.groups[:3]
    out = []
    for _ in range(n):
        pool = rng.choice(hot) if rng.random() < cfg.hot_share else rng.choice(env.groups)
        out.append(rng.choice(pool))
    return out


async def _nap(st: _State, seconds: float) -> None:
    """Sleep up to ``seconds``, waking early when the soak stops."""
    end = time.monotonic() + seconds
    while not st.stop and time.monotonic() < end:
        await asyncio.sleep(min(0.2, end - time.monotonic()))


async def _chaos(env: ChaosEnv, cfg: SoakConfig, st: _State, t0: float) -> None:
    """Kill/restart cycles; a cycle in progress is always completed (node back up)."""
    n = len(env.cluster)
    victims = [i for i in range(1, n)] or [0]
    k = 0
    while not st.stop:
        await _nap(st, cfg.kill_every_s)
        if st.stop or n < 2:
            return
        v = victims[k % len(victims)]
        k += 1
        st.drained.add(v)
        await asyncio.sleep(1.0)  # in-flight client requests at v finish
        env.cluster.kill(v, signal.SIGKILL)
        st.kills += 1
        st.events.append(f"{time.monotonic() - t0:.1f}s kill -9 {env.cluster.nodes[v].node_id}")
        await asyncio.sleep(2.0)
        try:
            await asyncio.to_thread(env.cluster.restart, v, True)
        except Exception as exc:  # a node that does not come back is a failed soak
            st.chaos_error = f"{env.cluster.nodes[v].node_id} did not rejoin: {exc}"[:500]
            st.events.append(f"{time.monotonic() - t0:.1f}s {st.chaos_error[:120]}")
            return
        st.restarts += 1
        st.events.append(f"{time.monotonic() - t0:.1f}s {env.cluster.nodes[v].node_id} "
                         "restarted and rejoined")
        st.drained.discard(v)


async def _sampler(env: ChaosEnv, cfg: SoakConfig, st: _State, t0: float) -> None:
    while not st.stop:
        sample: dict[str, object] = {"t": round(time.monotonic() - t0, 1)}
        for node in env.cluster.nodes:
            pid = node.pid if node.running else None
            rss = rss_bytes(pid) if pid is not None else None
            sample[node.node_id] = None if rss is None else round(rss / 2**20, 1)
            sample[node.node_id + "_cache_tokens"] = await asyncio.to_thread(
                _gauge, env, node.index, "radixmesh_cache_tokens")
        st.rss.append(sample)
        await _nap(st, cfg.sample_every_s)


def _gauge(env: ChaosEnv, i: int, name: str) -> float | None:
    if not env.cluster.nodes[i].running:
        return None
    try:
        return env.metrics(i).get(name)
    except httpx.HTTPError:
        return None


async def _run(env: ChaosEnv, cfg: SoakConfig, prompts: list[Prompt], st: _State
               ) -> list[ClientOutcome]:
    t0 = time.monotonic()
    n = len(env.cluster)

    def entry(i: int) -> str:
        live = [j for j in range(n) if j not in st.drained] or [0]
        return env.url(live[i % len(live)])

    tasks = [asyncio.create_task(_chaos(env, cfg, st, t0)),
             asyncio.create_task(_sampler(env, cfg, st, t0))]
    try:
        outcomes = await open_loop(entry, lambda i: prompts[i], env.model, cfg.rate,
                                   cfg.duration_s, timeout_s=120.0)
    finally:
        st.stop = True  # both tasks finish what they are doing (a restart completes)
        await asyncio.gather(*tasks, return_exceptions=True)
    # Still inside the loop: nodes restarted from executor threads carry PR_SET_PDEATHSIG,
    # which fires when *that thread* exits, i.e. when asyncio.run shuts the executor down.
    st.down = [n.node_id for n in env.cluster.nodes if not n.running]
    if not st.down:
        await asyncio.to_thread(env.cluster.wait_ready, 120)
    st.locks = await asyncio.to_thread(_locks_at_end, env)
    return outcomes


def _locks_at_end(env: ChaosEnv, timeout_s: float = 30.0) -> dict[str, float | str]:
    """Locked radix-cache tokens per running node once queues are empty (must all be 0).

    A node whose /metrics cannot be read reports the error text instead (a failed check).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        locks: dict[str, float | str] = {}
        busy = False
        with httpx.Client(timeout=15.0, trust_env=False) as client:
            for node in env.cluster.nodes:
                if not node.running:
                    continue
                try:
                    text = client.get(node.url + "/metrics").text
                except httpx.HTTPError as exc:
                    locks[node.node_id] = f"error: {type(exc).__name__}: {exc}"[:200]
                    busy = True
                    continue
                m = parse_samples(text)
                locks[node.node_id] = m.get("radixmesh_cache_locked_tokens", "missing")
                busy |= m.get("radixmesh_queue_depth", 0.0) > 0
        settled = all(v == 0 for v in locks.values())
        if (not busy and settled) or time.monotonic() > deadline:
            return locks
        time.sleep(0.5)


def run_soak(env: ChaosEnv, cfg: SoakConfig) -> dict[str, object]:
    """Run the soak; returns a JSON-able report (see module docstring)."""
    prompts = _prompt_picker(env, cfg)
    env.references(list({p.id: p for p in prompts}.values()))
    st = _State()
    t0 = time.monotonic()
    outcomes = asyncio.run(_run(env, cfg, prompts, st))
    elapsed = time.monotonic() - t0
    down, locks = st.down, st.locks
    lost = env.lost(outcomes)
    stats = summarize(outcomes)
    lat = [o.latency_s for o in outcomes if o.ok]
    errors = [o.error for o in outcomes if not o.ok]
    return {
        "duration_s": round(elapsed, 1),
        "rate": cfg.rate,
        "requests": len(outcomes),
        "errors": len(errors),
        "error_examples": errors[:5],
        "lost_or_wrong": len(lost),
        "p50_s": stats["p50_s"],
        "p99_s": percentile(lat, 99),
        "max_s": stats["max_s"],
        "ttft_p50_s": stats["ttft_p50_s"],  # streamed requests (chaos/load.py)
        "ttft_p99_s": stats["ttft_p99_s"],
        "routes": stats["routes"],
        "kills": st.kills,
        "restarts": st.restarts,
        "events": st.events,
        "rss_mb": st.rss,
        "locked_tokens_at_end": locks,
        "nodes_down_at_end": down,
        "chaos_error": st.chaos_error,
        "passed": not errors and not lost and not down and st.chaos_error is None
        and len(locks) == len(env.cluster) and all(v == 0 for v in locks.values()),
    }
