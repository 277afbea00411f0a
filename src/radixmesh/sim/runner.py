"""One simulated run: a fresh cluster, a workload, a schedule -> records and a summary.

Theory of operation
-------------------
A run mirrors one configuration of ``radixmesh bench``: a fresh cluster with cold caches is
started and left to gossip for ``warmup_s`` (the real cluster launcher waits until every node
is healthy and has gossiped once), then the workload is replayed against the entry nodes:

* ``sequential`` (the paper's schedule): one request at a time, round-robin entries, each
  sent the instant the previous one completed (closed loop; ``concurrency`` clients);
* ``poisson``: open-loop arrivals at the times the workload module drew (``Request.t``).

Either way a request that waits for an earlier one (``Request.after``: the next turn of a
conversation) goes only once that one has finished, as in the benchmark
(:class:`radixmesh.workload.schedule.Sessions`).

Each completed request becomes a :class:`radixmesh.results.records.Record`, the benchmark's
record type, and the run is summarized by the benchmark's ``summarize``
(:mod:`radixmesh.results.run_summary`) — so ``summary.json`` is the same schema, computed by the
same code. Simulator-only figures (gossip bytes per node per second, estimate error and view
age at decision time, events/s: :mod:`radixmesh.sim.figures`) are added beside the standard
keys; all but a labelled few leave the warm-up out as the records' do.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from radixmesh.results.records import Record, in_warmup
from radixmesh.results.run_summary import summarize
from radixmesh.sim.figures import WHOLE_RUN, Counts, Window, sim_figures
from radixmesh.sim.shell import ClusterConfig, Journey, SimCluster, routable_count
from radixmesh.sim.tokens import Tokenize
from radixmesh.workload.request import Request
from radixmesh.workload.schedule import Sessions


@dataclass(frozen=True, slots=True)
class SimSpec:
    name: str
    cluster: ClusterConfig
    workload: str = "synthetic"  # label: synthetic | mmlu | trace
    skew: str = "uniform"  # label: uniform | skewed
    schedule: str = "sequential"  # sequential | poisson | bursty (open loop: requests are timed)
    concurrency: int = 1  # sequential: closed-loop clients (1 = the paper's one at a time)
    warmup_s: float | None = None  # None: 4 gossip intervals (>= 0.5 s), then until joined
    max_join_s: float = 120.0  # with warmup_s None: give up waiting for the join after this
    max_virtual_s: float | None = None  # stop the run after this much virtual time
    # --exclude-warmup (as bench's): the first N requests / those sent in the first S seconds
    # of the workload are sent but left out of the figures (records carry "warmup": true)
    excluded: tuple[int, float] = (0, 0.0)
    # the positions of the requests that are warm-up, when known one by one (``--validate``:
    # the replayed records' own flags; an agent's steps are not sent in workload order):
    # overrides ``excluded``
    warm: frozenset[int] | None = None

    def warmup(self) -> float:
        if self.warmup_s is not None:
            return self.warmup_s
        return max(0.5, 4 * self.cluster.gossip.interval_s)


@dataclass(slots=True)
class SimResult:
    spec: SimSpec
    records: list[Record]
    summary: dict[str, Any]
    extras: list[dict[str, Any]] = field(default_factory=list)  # per record, sim-only fields

    def write_records(self, fh: TextIO) -> None:
        """Its records as ``requests.jsonl`` lines (each with its sim-only fields)."""
        for rec, extra in zip(self.records, self.extras, strict=True):
            obj = rec.to_json()
            obj.update(extra)
            fh.write(json.dumps(obj, separators=(",", ":")) + "\n")


ProgressFn = Callable[[int, int], None]
JOIN_PEERS = 64  # warm-up: routable peers each node needs before clients start (large N)


class _Driver:
    """Feeds the workload into a cluster and turns completions into records."""

    def __init__(self, spec: SimSpec, requests: Sequence[Request], tokenize: Tokenize) -> None:
        self.spec = spec
        self.requests = requests
        self.tokenize = tokenize
        self.cluster = SimCluster(spec.cluster)
        self.cluster.on_complete = self._completed
        self.records: list[Record | None] = [None] * len(requests)
        self.extras: list[dict[str, Any] | None] = [None] * len(requests)
        self.done = 0
        self.t0 = 0.0
        self.sessions = Sessions(requests)
        self.idle_clients = 0  # closed loop: clients with nothing they may send yet
        self.progress: ProgressFn | None = None
        self.joined_after_s: float | None = None
        self.journeys: list[Journey | None] = [None] * len(requests)
        self.warm_sent = 0  # warm-up requests sent
        self.measuring = False  # a measured request was sent
        self.since: Counts | None = None  # the counters when the warm-up ended

    def warm(self, i: int, t_arrival: float) -> bool:
        """Whether request ``i``, sent at ``t_arrival``, is warm-up (``--exclude-warmup``)."""
        if self.spec.warm is not None:
            return i in self.spec.warm
        return in_warmup(i, t_arrival - self.t0, *self.spec.excluded)

    def _entry(self, i: int) -> int:
        req = self.requests[i]
        n = self.spec.cluster.nodes
        return (req.entry if req.entry is not None else i) % n

    def _send(self, i: int) -> None:
        req = self.requests[i]
        if self.warm(i, self.cluster.loop.now):
            self.warm_sent += 1
        elif not self.measuring:  # the first measured request: the counters count from here
            self.measuring = True
            if self.warm_sent:
                self.since = Counts.of(self.cluster)
        self.journeys[i] = self.cluster.submit(i, req, self.tokenize(req), self._entry(i))

    def _send_open(self, i: int) -> None:
        if self.sessions.arrive(i):  # else held until its predecessor finishes
            self._send(i)
        nxt = i + 1
        if nxt < len(self.requests):
            t = self.requests[nxt].t
            self.cluster.loop.at(self.t0 + (t or 0.0), self._send_open, nxt)

    def _completed(self, f: Journey) -> None:
        self.records[f.index] = self._record(f)
        extra: dict[str, Any] = {
            "estimate_error_tokens": f.estimate_error,
            "view_age_s": f.view_age_s,
            "predicted_ttft_s": f.predicted_ttft_s,
            "queue_s": f.queue_s,
            "service_s": f.service_s,
        }
        if f.considered is not None:
            extra["considered"] = f.considered
        self.extras[f.index] = extra
        self.done += 1
        if self.done >= len(self.requests):
            self.cluster.loop.stop()
        if self.progress is not None and (self.done % 1000 == 0 or self.done == len(self.requests)):
            self.progress(self.done, len(self.requests))
        released = self.sessions.finish(f.index)
        if self.spec.schedule == "sequential":
            self.idle_clients += 1
            self._dispatch()
        else:
            for j in released:
                self.cluster.loop.at(self.cluster.loop.now, self._send, j)

    def _dispatch(self) -> None:
        """Closed loop: every idle client sends the next request that may go."""
        while self.idle_clients > 0 and (i := self.sessions.take()) is not None:
            self.idle_clients -= 1
            self.cluster.loop.at(self.cluster.loop.now, self._send, i)

    def _record(self, f: Journey) -> Record:
        nodes = self.cluster.nodes
        ok = f.error is None
        return Record(
            run=self.spec.name,
            policy=self.spec.cluster.policy_name,
            seq=f.index,
            id=f.req.id,
            group=f.req.group,
            entry=f.entry,
            entry_node=nodes[f.entry].node_id,
            t_send=f.t_arrival - self.t0,
            t_done=f.t_done - self.t0,
            latency_s=f.t_done - f.t_arrival,
            served_by=nodes[f.served_by].node_id if ok and f.served_by >= 0 else None,
            route=f.route if ok else None,
            expected_cached_tokens=f.expected_cached if ok else None,
            placement=f.placement if ok else None,
            cached_tokens=f.cached if ok else None,
            prompt_tokens=len(f.tokens),
            completion_tokens=f.req.max_tokens if ok else None,
            server_timing={"queue": f.queue_s, "service": f.service_s} if ok else {},
            status=200 if ok else 503,
            error=f.error,
            # a streamed response: every token crosses the same way back, so the client sees
            # the first one the engine's decode time before the last
            ttft_s=f.t_done - f.t_arrival - f.decode_s if ok else None,
            tpot_s=f.decode_s / (f.decode_tokens - 1) if ok and f.decode_tokens > 1 else None,
            warmup=self.warm(f.index, f.t_arrival),
        )

    def _wait_joined(self) -> None:
        """Like the cluster launcher, start the clients once the mesh has formed: every node
        routes to every other (alive, with a load report) — to at least ``JOIN_PEERS`` of
        them in large meshes, where the router only ever ranks a handful of candidates — or
        ``max_join_s`` has passed."""
        cluster = self.cluster
        want = min(self.spec.cluster.nodes - 1, JOIN_PEERS)
        step = self.spec.cluster.gossip.interval_s / 2
        start = cluster.loop.now
        while cluster.loop.now - start < self.spec.max_join_s:
            if all(routable_count(n.core) >= want for n in cluster.nodes):
                break
            cluster.loop.run(until=cluster.loop.now + step)
        self.joined_after_s = cluster.loop.now

    def run(self) -> None:
        cluster = self.cluster
        cluster.start()
        cluster.loop.run(until=self.spec.warmup())
        if self.spec.warmup_s is None:
            self._wait_joined()
        self.t0 = cluster.loop.now
        cluster.schedule_faults(self.t0)
        self.since = Counts.of(cluster)
        if not self.requests:
            return
        if self.spec.schedule != "sequential":  # open loop: poisson or bursty
            cluster.loop.at(self.t0 + (self.requests[0].t or 0.0), self._send_open, 0)
        else:  # closed loop: each client sends the next request when its last one is done
            self.idle_clients = self.spec.concurrency
            self._dispatch()
        until = None if self.spec.max_virtual_s is None else self.t0 + self.spec.max_virtual_s
        cluster.loop.run(until=until)


def run(
    spec: SimSpec,
    requests: Sequence[Request],
    tokenize: Tokenize,
    progress: ProgressFn | None = None,
) -> SimResult:
    driver = _Driver(spec, requests, tokenize)
    driver.progress = progress
    wall0 = time.perf_counter()
    # The simulated mesh is millions of long-lived small objects without reference cycles;
    # CPython's cyclic collector re-scanned them all the time (23-27 % of the wall time at
    # 1,024 nodes, same peak memory without it). Reference counting still frees everything.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        driver.run()
    finally:
        if was_enabled:
            gc.enable()
    wall = time.perf_counter() - wall0
    records = [r for r in driver.records if r is not None]
    extras = [e for e in driver.extras if e is not None]
    summary = _summary(spec, driver, records, extras, wall)
    return SimResult(spec, records, summary, extras)


def _summary(
    spec: SimSpec, driver: _Driver, records: list[Record], extras: list[dict[str, Any]], wall: float
) -> dict[str, Any]:
    c = spec.cluster
    out: dict[str, Any] = {
        "name": spec.name,
        "policy": c.policy_name,
        "nodes": c.nodes,
        "workload": spec.workload,
        "skew": spec.skew,
        "net_delay_ms": c.network.delay_s * 1000.0,
        "gossip_interval_ms": c.gossip.interval_s * 1000.0,
        "gossip_announce_ms": None if c.gossip.announce_gap_s is None
        else c.gossip.announce_gap_s * 1000.0,
        "cache_tokens": c.cache_tokens,
    }  # fmt: skip
    measured = [(r, e) for r, e in zip(records, extras, strict=True) if not r.warmup]
    kept = [r for r, _ in measured], [e for _, e in measured]
    out.update(summarize(kept[0]))
    since = driver.since
    assert since is not None  # (taken when the workload starts)
    out["warmup"] = {"requests": spec.excluded[0], "seconds": spec.excluded[1],
                     "excluded": len(records) - len(measured),
                     "counters_from_s": since.t - driver.t0, "whole_run": list(WHOLE_RUN)}
    out["schedule"] = spec.schedule
    out["concurrency"] = spec.concurrency if spec.schedule == "sequential" else None
    journeys = [j for j in driver.journeys if j and not driver.warm(j.index, j.t_arrival)]
    window = Window(driver.t0, since, journeys, len(driver.requests) - driver.warm_sent)
    out["sim"] = sim_figures(c, driver.cluster, window, *kept, wall)
    return out
