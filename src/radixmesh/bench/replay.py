"""Replaying request lists against started clusters — alone, or several paired in time.

Modes (what :func:`mode_of` says a request list is):

* ``sequential`` — one request at a time. Several runs together are *interleaved*: request i
  goes to every run's cluster in turn, one at a time, so each run still sees the paper's
  schedule and all of them see the machine in the same state.
* ``closed`` — ``concurrency`` clients per run, each one request at a time. Several runs
  together run their clients at the same time (same machine, same period).
* ``open`` — requests carry arrival times ``t``. Several runs together share one clock and one
  arrival schedule: at ``t_i`` request i is sent to *every* cluster (the order rotating with
  i), so each pair of runs saw the same machine when each request arrived.

One run alone is the same code with one cluster. In every mode a request that waits for an
earlier one (``Request.after``: the next turn of a conversation, the next step of an agent's
task) is sent only once that one has finished on its run's cluster
(:class:`~radixmesh.workload.schedule.Sessions`): a closed-loop client takes the next request
that may go; an open-loop arrival is held until then, and timed from when it is sent.

Open loop at a fraction of capacity (``--load 0.5``; :class:`CapacityProbe`): after warm-up,
every cluster of the batch runs a short saturating closed loop (``clients`` at once, no request
waiting for another) over probe requests — the same generator under another seed, so the
measured run's own prefixes stay cold apart from a generator's constant header (the chat
preamble, the agent's rules, the RAG instruction: a few hundred characters) — all clusters at
the same time, as their open loop will run. The capacity is the ``none`` cluster's throughput
(requests completed / wall time; the median cluster's if the batch has no ``none``), and the
batch's one arrival schedule is Poisson at ``load`` × that capacity. A later batch of the same
point (bench/runner.py) is timed at the first one's capacity, kept in the output folder's
``capacity.json`` (bench/capacities.py) for a resumed sweep. On an emulated mesh (``--engine
emulated``) no probe runs: the capacity is the engines' planned one (bench/emulated.py).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from radixmesh.bench import client
from radixmesh.bench.emulated import PLANNED, planned_capacity
from radixmesh.bench.launcher import BenchCluster
from radixmesh.bench.oracle import Oracle, fed_output, output_ids
from radixmesh.bench.prompts import prompt_ids, tokenizer_for
from radixmesh.bench.sglang import Gateway
from radixmesh.bench.spec import RunSpec, engine_context
from radixmesh.core.headers import HEADER_TARGET
from radixmesh.results.records import Record
from radixmesh.workload import Request
from radixmesh.workload.schedule import Sessions, is_open_loop, think_time, timed

WARMUP_PROMPT = "radixmesh warm-up {i}: hello"
GATEWAY_MODEL_WAIT_S = 120.0  # a gateway must list the served model by then (wait_for_model)
MODES = ("sequential", "closed", "open")


def mode_of(spec: RunSpec, requests: Sequence[Request]) -> str:
    if spec.workload.load is not None or is_open_loop(requests):
        return "open"
    return "closed" if spec.concurrency > 1 else "sequential"


def new_http_client(time_scale: float = 1.0) -> httpx.AsyncClient:
    """The bench's client: its timeouts ``time_scale`` times longer, as the nodes' are (an
    emulated mesh at 160 % of 16 H100s' capacity kept ~500 streams open at once whatever the
    scale, and 254 of 1,484 connects timed out at an unscaled 10 s)."""
    # Idle connections expire well before uvicorn's 5 s keep-alive, or a reused connection can
    # race the server closing it (a client-side ReadError, not a node failure).
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64, keepalive_expiry=1.0)
    timeout = httpx.Timeout(600.0 * time_scale, connect=10.0 * time_scale)
    return httpx.AsyncClient(timeout=timeout, limits=limits)


Pair = tuple["Replay", Sequence[Request]]


@dataclass(slots=True)
class CapacityProbe:
    """Measures a batch's capacity, then times its requests: Poisson at ``load`` × capacity.
    ``earlier``: the capacity an earlier batch of the same runs measured (another policy or
    arrival schedule, bench/runner.py): still measured here, but the rate comes from it, so
    that every policy of a sweep meets one rate (one batch's ``none`` measured 141.9 req/s,
    the next batch, without ``none``, took its median 156.7)."""

    requests: Sequence[Request]
    clients: int
    load: float
    earlier: float | None = None
    planned: float | None = None  # the engines' planned capacity (emulated): no probe is run
    throughput: dict[str, float] = field(default_factory=dict)  # run name -> requests/s
    capacity_rps: float | None = None
    basis: str = ""
    rate: float | None = None

    async def apply(self, http: httpx.AsyncClient, pairs: Sequence[Pair]) -> list[Pair]:
        if self.planned is not None:
            self.basis, self.capacity_rps = PLANNED, self.planned
        else:
            await self._probe(http, [r for r, _ in pairs])
        if self.earlier is not None and self.planned is None:  # planned: the same every batch
            self.basis, self.capacity_rps = "an earlier batch's", self.earlier
        if not self.capacity_rps or self.capacity_rps <= 0:
            raise RuntimeError("capacity probe completed no request")
        self.rate = self.load * self.capacity_rps
        return [(r, timed(reqs, r.spec.nodes, self.rate, r.spec.workload.seed,
                          r.spec.workload.arrivals, r.spec.workload.arrival_cv))
                for r, reqs in pairs]  # fmt: skip

    async def _probe(self, http: httpx.AsyncClient, replays: Sequence[Replay]) -> None:
        rates = await asyncio.gather(*(self._measure(http, r) for r in replays))
        self.throughput = {r.spec.name: x for r, x in zip(replays, rates, strict=True)}
        base = [x for r, x in zip(replays, rates, strict=True) if r.spec.policy == "none"]
        self.basis = "none" if base else "median"
        self.capacity_rps = base[0] if base else statistics.median(rates)

    async def _measure(self, http: httpx.AsyncClient, replay: Replay) -> float:
        # Saturating: every probe request may go at once (no turn waits for the last one's
        # answer), or a conversation's turns would measure its round trips, not the cluster.
        reqs = [replace(r, after=None) for r in self.requests]
        start = time.perf_counter()
        recs = await replay.closed_loop(http, reqs, self.clients, record=False)
        wall = (time.perf_counter() - start) / replay.spec.time_scale  # unscaled seconds
        return sum(1 for r in recs if r.ok) / wall if wall > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"probe_requests": len(self.requests), "probe_clients": self.clients,
                "load": self.load, "throughput_rps": self.throughput,
                "capacity_rps": self.capacity_rps, "basis": self.basis,
                "rate": self.rate}  # fmt: skip


def timing_probe(spec: RunSpec, requests: Sequence[Request], probe_requests: Sequence[Request],
                 load: float, earlier: float | None, probe_clients: int,
                 log: Callable[[str], None]) -> CapacityProbe:
    """What times a batch at ``load``: the engines' planned capacity on an emulated mesh, else
    a probe (or the capacity an earlier batch of the point measured: ``earlier``)."""
    planned = (planned_capacity(spec.profiles, spec.nodes, requests)
               if spec.engine == "emulated" else None)
    if planned is not None and earlier is not None and abs(earlier - planned) > planned / 100:
        log(f"warning: this point's earlier runs were timed at {earlier:.2f} req/s (a probe's: "
            f"--load was of a probe then), these at {planned:.2f} (planned): compare with care")
    clients = min(probe_clients, len(probe_requests))
    return CapacityProbe(probe_requests, clients, load, earlier, planned)


async def replay_together(
    pairs: Sequence[Pair], mode: str, probe: CapacityProbe | None = None,
    started: Callable[[], None] | None = None,
) -> list[Pair]:
    """Run every pair's requests in ``mode`` (see the module docstring), paired in time; with
    ``probe``, measure the capacity first and run the timed requests it returns; ``started``
    is called as the run's own requests start (after warm-up and probe). Returns what ran (the
    pairs as timed)."""
    async with new_http_client(pairs[0][0].spec.time_scale if pairs else 1.0) as http:
        for replay, _ in pairs:
            await replay.setup(http)
        if probe is not None:
            pairs = await probe.apply(http, pairs)
        if started is not None:
            started()
        t0 = time.perf_counter()
        for replay, _ in pairs:
            replay.t0 = t0
        if mode == "open":
            await _open_loop(http, pairs)
        elif mode == "closed":
            await asyncio.gather(*(r.closed_loop(http, reqs) for r, reqs in pairs))
        else:
            await _interleaved(http, pairs)
    return list(pairs)


async def _interleaved(http: httpx.AsyncClient, pairs: Sequence[Pair]) -> None:
    for i in range(max(len(reqs) for _, reqs in pairs)):
        for replay, reqs in pairs:
            if i < len(reqs):
                await replay.one(http, i, reqs[i])


def arrival_times(pairs: Sequence[Pair]) -> list[float]:
    """The one arrival schedule of paired open-loop runs (they must agree on it)."""
    times = [[r.t or 0.0 for r in reqs] for _, reqs in pairs]
    n = min(len(t) for t in times)
    if any(t[:n] != times[0][:n] for t in times):
        raise ValueError("paired open-loop runs must share one arrival schedule")
    return max(times, key=len)


async def _open_loop(http: httpx.AsyncClient, pairs: Sequence[Pair]) -> None:
    tasks: list[asyncio.Task[Record]] = []
    sessions = [Sessions(reqs) for _, reqs in pairs]

    def launch(k: int, i: int) -> None:
        replay, reqs = pairs[k]
        task = asyncio.create_task(replay.one(http, i, reqs[i]))

        def finished(task: asyncio.Task[Record]) -> None:
            if not task.cancelled():  # cancelled: the run is being torn down
                for j in sessions[k].finish(i):
                    launch(k, j)

        task.add_done_callback(finished)
        tasks.append(task)

    t0 = pairs[0][0].t0
    scale = pairs[0][0].spec.time_scale  # arrival times are unscaled (bench/emulated.py)
    try:
        for i, t in enumerate(arrival_times(pairs)):
            delay = t * scale - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            for m in range(len(pairs)):
                k = (i + m) % len(pairs)
                if i < len(pairs[k][1]) and sessions[k].arrive(i):  # else held for its turn
                    launch(k, i)
        while running := [task for task in tasks if not task.done()]:
            await asyncio.gather(*running)  # a finished one may launch those held for it
    finally:
        for task in tasks:
            task.cancel()


def unscale(rec: Record, scale: float) -> None:
    """A record of a mesh run ``scale`` times slower than the one it stands for, in that one's
    time (bench/emulated.py): every time divided by ``scale``."""
    rec.t_send /= scale
    rec.t_done /= scale
    rec.latency_s /= scale
    rec.ttft_s = None if rec.ttft_s is None else rec.ttft_s / scale
    rec.tpot_s = None if rec.tpot_s is None else rec.tpot_s / scale
    rec.server_timing = {k: v / scale for k, v in rec.server_timing.items()}


class Replay:
    """Replays one run's requests against a started cluster."""

    def __init__(
        self, spec: RunSpec, cluster: BenchCluster, sink: Callable[[Record], None]
    ) -> None:
        self.spec = spec
        self.urls = list(cluster.urls)
        self.ids = list(cluster.node_ids)
        self.sink = sink
        self.records: list[Record] = []
        self.router: Gateway | None = None
        self.oracle: Oracle | None = None
        self.tokenizer = tokenizer_for(spec)
        self.max_context = engine_context(spec.preset, spec.model, spec.node_profiles)
        self.model = ""
        self.t0 = 0.0
        self.regions = spec.region_map  # clients enter in every region (bench/regions.py)
        self.answered: dict[str, float] = {}  # request id -> when its answer was in (clock)

    async def setup(self, http: httpx.AsyncClient) -> None:
        self.model = await client.model_name(http, self.urls[0])
        if self.router is not None and self.router.lists_models:  # it routes by model name
            await client.wait_for_model(http, self.router.url, self.model, GATEWAY_MODEL_WAIT_S)
        await self._warm_up(http)
        self.t0 = time.perf_counter()

    async def _warm_up(self, http: httpx.AsyncClient) -> None:
        for i, url in enumerate(self.urls):
            req = Request(id=f"warmup/{i}", prompt=WARMUP_PROMPT.format(i=i), max_tokens=1)
            rec = self._record(-1, req, i)
            if self.oracle is not None:
                await self._via_oracle(http, rec, req, i, node=i)
            else:
                await client.send(http, url, self.model, req, rec, time.perf_counter())
            if rec.error:
                raise RuntimeError(f"warm-up of {url} failed: {rec.error}")

    async def closed_loop(
        self,
        http: httpx.AsyncClient,
        requests: Sequence[Request],
        clients: int | None = None,
        record: bool = True,
    ) -> list[Record]:
        """``clients`` (default: the spec's concurrency) each send their next request when the
        previous one finished — the next in order that may go (``Sessions``); returns the
        records in completion order."""
        sessions = Sessions(requests)
        changed = asyncio.Condition()
        done: list[Record] = []

        async def worker() -> None:
            while True:
                async with changed:
                    seq = sessions.take()
                    while seq is None and len(sessions):  # all left wait for running ones
                        await changed.wait()
                        seq = sessions.take()
                if seq is None:
                    return
                try:
                    done.append(await self.one(http, seq, requests[seq], record))
                finally:
                    async with changed:
                        sessions.finish(seq)
                        changed.notify_all()

        await asyncio.gather(*(worker() for _ in range(clients or self.spec.concurrency)))
        return done

    def _record(self, seq: int, req: Request, entry: int) -> Record:
        return Record(
            run=self.spec.name,
            policy=self.spec.policy,
            seq=seq,
            id=req.id,
            group=req.group,
            entry=entry,
            entry_node="router" if self.router else self.ids[entry],
            t_send=time.perf_counter() - self.t0,
        )

    async def _think(self, req: Request) -> None:
        """A later turn of a session waits for its user's think time after the answer to the
        turn before (``--think-time``; in the mesh's scaled time)."""
        w = self.spec.workload
        done = self.answered.get(req.after) if req.after is not None else None
        if done is None or w.think_s <= 0:
            return
        think = think_time(req.id, w.think_s, w.seed) * self.spec.time_scale
        wait = done + think - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)

    def client_link(self, entry: int) -> tuple[float, float] | None:
        """The (out, back) delays of a client whose request enters at node ``entry``, to
        where it sends (its node, or the gateway), in the mesh's (scaled) time."""
        if self.regions is None:
            return None
        out, back = self.regions.client_link(entry, gateway=self.router is not None)
        return out * self.spec.time_scale, back * self.spec.time_scale

    async def one(
        self, http: httpx.AsyncClient, seq: int, req: Request, record: bool = True
    ) -> Record:
        """Send one request (through the gateway or oracle if the run has one); ``record`` =
        False for requests that are not part of the run (a capacity probe): the oracle's
        mirrors still see them, the run's records and sink do not."""
        entry = (req.entry or 0) % len(self.urls)
        await self._think(req)
        rec = self._record(seq, req, entry)
        if self.oracle is not None:
            await self._via_oracle(http, rec, req, entry)
        else:
            url = self.router.url if self.router else self.urls[entry]
            await client.send(http, url, self.model, req, rec, self.t0,
                              link=self.client_link(entry))
        self.answered[req.id] = time.perf_counter()
        if self.spec.time_scale != 1.0:
            unscale(rec, self.spec.time_scale)
        rec.warmup = self.spec.is_warmup(seq, rec.t_send)
        if record:
            self.records.append(rec)
            self.sink(rec)
        return rec

    async def _via_oracle(
        self, http: httpx.AsyncClient, rec: Record, req: Request, entry: int, node: int = -1
    ) -> None:
        """Send to the entry node, naming the oracle's choice in ``x-radixmesh-target`` (the
        entry node forwards it through the real peer path); ``node`` >= 0 forces the node."""
        assert self.oracle is not None
        oracle = self.oracle
        tokens = prompt_ids(self.tokenizer, req)
        chosen, predicted = oracle.choose(tokens, req.max_tokens, entry)
        node = chosen if node < 0 else node
        lease = oracle.started(node, tokens, req.max_tokens)
        headers = {HEADER_TARGET: self.ids[node]} if node != entry else None
        await client.send(http, self.urls[entry], self.model, req, rec, self.t0, headers,
                          link=self.client_link(entry))
        rec.expected_cached_tokens = predicted if node == chosen else lease.cached
        fed = None
        if rec.ok:
            gen = output_ids(self.tokenizer, rec.output, rec.completion_tokens or 0)
            fed = tokens + fed_output(gen, rec.finish_reason)
        hop = oracle.rtt_s if node != entry else 0.0
        service = rec.server_timing.get("service", rec.latency_s - hop) if rec.ok else None
        oracle.finished(node, lease, len(tokens), fed, service)
        oracle.check(lease.cached, rec.cached_tokens)
        if rec.ok and rec.served_by != self.ids[node]:  # a failed forward fell back elsewhere
            oracle.mismatches += 1
