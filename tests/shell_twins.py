"""The two shells of ``NodeCore`` side by side, for ``test_shells_differential.py``.

Theory of operation
-------------------
One script (rounds of requests, each with its entry node and prompt, between settling
periods in which gossip converges; a node may crash as a round begins) runs on

* the simulator shell: ``sim.shell.SimCluster`` on its event loop (no network delay, no
  forward overhead: time is spent in engines only), :func:`run_simulator`;
* the runtime shell: N ``runtime.node.NodeService``s on a virtual clock (:class:`RuntimeMesh`),
  talking through the in-memory peer transport (``testing.memtransport``), each on the
  simulator's engine behind the ``AsyncEngine`` interface (:class:`SimBackedEngine`, stepped as
  the simulator steps it), with the cores the simulator boots (incarnation 0, its random
  streams), :func:`run_runtime`.

Engines, configurations, random streams and outputs are the same by construction, so what
differs between the two is what each shell reports to its cores and when.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from radixmesh.core.blocks import Fingerprint
from radixmesh.core.events import Tick
from radixmesh.core.node import NodeCore
from radixmesh.core.prefix_cache import CacheUsage
from radixmesh.core.router_config import Policy, RouterConfig
from radixmesh.engine.base import CacheDelta, GenerateRequest, GenerateResult, SamplingParams
from radixmesh.runtime.config import ServeConfig
from radixmesh.runtime.node import NodeService
from radixmesh.runtime.transport import ForwardFailure
from radixmesh.sim import costs
from radixmesh.sim.clock import EventLoop
from radixmesh.sim.engine import Planned, SimEngine
from radixmesh.sim.network import NetworkConfig
from radixmesh.sim.shell import ClusterConfig, SimCluster, _generated
from radixmesh.testing.memtransport import MemoryNet
from radixmesh.workload.request import Request

N = 3
SETTLE_S = 3.0  # virtual seconds between requests: gossip converges, load reports age
COST = replace(costs.resolve("gpu-7b"), forward_overhead_s=0.0)
CONFIG = ClusterConfig(nodes=N, cost=COST, network=NetworkConfig(delay_s=0.0),
                       start_spread_s=0.0, seed=0)
FINGERPRINT = Fingerprint(CONFIG.model, CONFIG.tokenizer, CONFIG.block_size)

# ------------------------------------------------------------------------------ the script
Step = tuple[int, str, list[int], int]  # entry node, request id, prompt tokens, max_tokens
Round = list[Step]  # requests that arrive at the same instant


Crash = tuple[int, int] | None  # (round, node): the node crashes as that round begins


def script(seed: int, rounds: int = 12, burst: int = 1, crash: Crash = None,
           families: int = 4) -> list[Round]:
    """Rounds of up to ``burst`` simultaneous requests over ``families`` shared prefixes (long
    enough that where they are cached matters), from every entry node (but a crashed one)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 30_000) for _ in range(rng.choice((256, 512, 1024)))]
                for _ in range(families)]
    out, ids = [], itertools.count()
    for i in range(rounds):
        live = [n for n in range(N) if crash is None or i < crash[0] or n != crash[1]]
        steps = []
        for _ in range(rng.randint(1, burst)):
            p = prefixes[rng.randrange(len(prefixes))]
            tail = [rng.randrange(1, 30_000) for _ in range(rng.randrange(8, 40))]
            steps.append((rng.choice(live), f"r{next(ids)}", p + tail, rng.choice((1, 4, 16))))
        out.append(steps)
    return out


def outputs_of(rounds: list[Round]) -> dict[tuple[int, ...], list[int]]:
    """The output ids the simulator generates for each request (by prompt)."""
    return {tuple(p): _generated(SimpleNamespace(req=Request(rid, prompt="x", max_tokens=m)))
            for steps in rounds for _, rid, p, m in steps}


# --------------------------------------------------------------------- the simulator shell
def run_simulator(rounds: list[Round], policy: Policy, crash: Crash = None) -> None:
    sim = SimCluster(replace(CONFIG, router=RouterConfig(policy=policy)))
    sim.start()
    t, index = SETTLE_S, itertools.count()
    sim.loop.run(until=t)
    for i, steps in enumerate(rounds):
        if crash is not None and crash[0] == i:
            sim.crash(sim.nodes[crash[1]])
        for entry, rid, prompt, max_tokens in steps:
            req = Request(rid, prompt="x", max_tokens=max_tokens)
            sim.submit(next(index), req, prompt, entry)
        t += SETTLE_S
        sim.loop.run(until=t)
        assert not sim.active, f"{steps} still in flight after {SETTLE_S} s"


# ------------------------------------------------------------------------ the runtime shell
class SimBackedEngine:
    """The simulator's engine as an ``AsyncEngine`` on virtual time, stepped as the
    simulator's shell steps it (``SimCluster._run_next`` / ``_cut_run`` / ``_stepped``): plan
    a step or decode run, apply it at its planned end; a request arriving during a decode
    run cuts the run at the step then running."""

    def __init__(self, loop: EventLoop, outputs: dict[tuple[int, ...], list[int]]) -> None:
        self.sim = SimEngine(COST, CONFIG.cache_tokens, CONFIG.block_size, FINGERPRINT.digest)
        self.loop, self.outputs = loop, outputs
        self.fingerprint, self.model_name, self.max_context = FINGERPRINT, "diff", 1 << 20
        self.tokenizer = SimpleNamespace(vocab_size=1 << 20)
        self._seqs = itertools.count()
        self._waiting: dict[int, tuple[asyncio.Future[Any], Any, list[int]]] = {}
        self._planned: Planned | None = None
        self._planned_at, self._version = 0.0, 0

    def match(self, prompt_ids: Any) -> int:
        return self.sim.match(prompt_ids)

    def usage(self) -> CacheUsage:
        return CacheUsage(self.sim.total_tokens, CONFIG.cache_tokens, 0)

    def drain_cache_delta(self) -> CacheDelta:
        added, removed = self.sim.drain_delta()
        return CacheDelta(tuple(added), tuple(removed))

    def cache_hashes(self) -> frozenset[int]:
        return frozenset(self.sim.cache.hashes())

    @property
    def running(self) -> int:
        return self.sim.sched.running

    @property
    def waiting(self) -> int:
        return self.sim.sched.waiting

    async def generate(self, req: GenerateRequest, on_token: Any = None) -> GenerateResult:
        seq, prompt = next(self._seqs), req.prompt_ids
        output = self.outputs[prompt][: req.sampling.max_tokens]
        self.sim.add(seq, prompt, output, self.loop.now)
        done = asyncio.get_running_loop().create_future()
        self._waiting[seq] = (done, on_token, [0, *output])  # [tokens sent, *output]
        if self._planned is None:
            self._plan()
        elif self._planned.step is None:
            self._cut()
        finished, run = await done
        return GenerateResult(req.request_id, list(finished.output), "length", len(prompt),
                              run.cached_tokens, run.queue_s, run.prefill_s, run.decode_s)

    def _plan(self) -> None:
        now = self.loop.now
        self._planned = planned = self.sim.plan(now, coalesce=True)
        if planned is not None:
            self._planned_at, self._version = now, self._version + 1
            version = self._version
            self.loop.at(now + planned.duration_s, self._stepped, version)

    def _cut(self) -> None:
        planned = self._planned
        assert planned is not None
        k = self.sim.steps_by(planned, self.loop.now - self._planned_at)
        if k < planned.k:
            self._planned = cut = self.sim.cut(planned, k)
            self._version += 1
            version = self._version
            self.loop.at(self._planned_at + cut.duration_s, self._stepped, version)

    def _stepped(self, version: int) -> None:
        if version != self._version or self._planned is None:
            return
        finished = self.sim.apply(self._planned, self.loop.now)
        for seq, (_, on_token, sent) in self._waiting.items():
            upto = self.sim._emitted.get(seq, len(sent) - 1)  # what apply took of it
            for tok in sent[1 + sent[0]: 1 + upto]:
                if on_token is not None:
                    on_token(tok)
            sent[0] = max(sent[0], upto)
        for f, run in finished:
            self._waiting.pop(f.seq)[0].set_result((f, run))
        self._plan()

    async def aclose(self) -> None:
        pass


async def idle() -> None:
    """Run the event loop until every task waits (on virtual time or on another task)."""
    loop = asyncio.get_running_loop()
    for _ in range(100_000):
        await asyncio.sleep(0)
        if not loop._ready:  # type: ignore[attr-defined]  # nothing left to run now
            return
    raise AssertionError("the event loop never goes idle")


class RuntimeMesh:
    """N ``NodeService``s on one virtual clock, connected in memory."""

    def __init__(self, rounds: list[Round], policy: Policy) -> None:
        self.loop = EventLoop()  # the simulator's loop: its clock and the engines' timers
        self.net = net = MemoryNet(ForwardFailure)
        outputs = outputs_of(rounds)
        addresses = [f"10.0.0.{i}:8000" for i in range(N)]
        self.services = []
        for i, address in enumerate(addresses):
            cfg = ServeConfig(node_id=f"n{i}", advertise=address, peers=tuple(addresses),
                              decision_log=0, policy=policy.value)
            service = NodeService(cfg, SimBackedEngine(self.loop, outputs),
                                  clock=lambda: self.loop.now, incarnation=1,
                                  peers=net.transport(f"n{i}", address))
            # the core the simulator boots: incarnation 0, its random stream (its seeding)
            config = replace(service.node_config, incarnation=0)
            rng = random.Random(f"node/{CONFIG.seed}/{i}/0")
            service.core = NodeCore(config, rng, self.loop.now)
            net.listen(address, service)
            self.services.append(service)
        self.live = list(self.services)

    async def start(self) -> None:
        for service in self.services:  # what start() does, without the wall-clock timer
            service.push_cache_and_load()
            service.dispatch(Tick())

    def crash(self, node: int) -> None:
        """``node`` stops at once: nothing listens at its address, its timers stop."""
        service = self.services[node]
        self.net.stop_listening(service.address)
        self.live.remove(service)

    async def step(self, t_end: float) -> bool:
        """Run what is due now, then move the clock to the next deadline or timer (False:
        that is past ``t_end``; the clock is at ``t_end``)."""
        await idle()
        loop = self.loop
        engine = loop.next_time()  # the engines' next step end (None: all idle)
        t = min(min(s.core.next_deadline() for s in self.live),
                math.inf if engine is None else engine)
        if t > t_end:
            loop.now = max(loop.now, t_end)
            return False
        loop.run(until=t)  # the engines' steps due by then (callbacks in time order)
        loop.now = max(loop.now, t)
        for s in self.live:
            if s.core.next_deadline() <= loop.now:
                s.dispatch(Tick())
        return True

    async def run_until(self, t_end: float) -> None:
        while await self.step(t_end):
            pass

    async def requests(self, steps: Round) -> None:
        """Submit ``steps`` now (in order) and run until every one has its answer."""
        async def one(entry: int, prompt: list[int], max_tokens: int) -> None:
            ex = await self.services[entry].execute(
                prompt, SamplingParams(max_tokens=max_tokens), stream=False)
            await ex.result()

        tasks = []
        for entry, _rid, prompt, max_tokens in steps:
            tasks.append(asyncio.create_task(one(entry, prompt, max_tokens)))
        while not all(t.done() for t in tasks):
            await self.step(math.inf)
        await asyncio.gather(*tasks)

    async def stop(self) -> None:
        for service in self.services:
            await service.stop()


async def _runtime(rounds: list[Round], policy: Policy, crash: Crash) -> None:
    mesh = RuntimeMesh(rounds, policy)
    await mesh.start()
    t = SETTLE_S
    await mesh.run_until(t)
    for i, steps in enumerate(rounds):
        if crash is not None and crash[0] == i:
            mesh.crash(crash[1])
        await mesh.requests(steps)
        t = max(t + SETTLE_S, mesh.loop.now)
        await mesh.run_until(t)
    await mesh.stop()


def run_runtime(rounds: list[Round], policy: Policy, crash: Crash = None) -> None:
    asyncio.run(_runtime(rounds, policy, crash))


# ------------------------------------------------------------------------------- the tests
