"""Run benchmark configurations, each on a fresh cluster, and record every request.

Theory of operation
-------------------
For a list of :class:`~radixmesh.bench.spec.RunSpec`::

    plan every run first: build its workload (seeded) through admission — prompts that do
    │   not fit the engine's context are dropped, truncated or fail the sweep (--too-long);
    │   what was dropped, per reason and group, is printed before any cluster starts
    batch runs: consecutive runs sharing a ``lockstep`` key and a mode (sequential / closed
    │   loop / open loop) run together, at most ``batch_limit`` (4) clusters at once; any
    │   other run alone
    per batch: start a fresh cluster per run (cold caches; the batch's clusters start at
    │   once) ── nodes run the spec's policy
    │   (``none`` for the client-side baselines ``oracle``, ``sglang`` and ``smg``; the two
    │   gateways start in front of their cluster, or the run is skipped if not installed)
    │   warm each node up with one short, unrelated prompt (torch's first-call cost)
    │   open loop at a fraction of capacity (``load``): measure the capacity first on the
    │   same clusters (bench/replay.py ``CapacityProbe``; a point's later batches and a
    │   ``--resume`` reuse its first capacity, kept in ``capacity.json``), then time the requests
    │   replay them paired in time (bench/replay.py): interleaved one at a time, closed loops
    │   side by side, or one shared arrival schedule sent to every cluster
    └─ each finished request → one :class:`Record` line in ``requests.jsonl`` (flushed)
    stop the clusters, summarize into ``summary.json`` (rewritten after every batch): the
    schedule that ran, what was dropped, per-node served counts, who ran beside whom

Ctrl-C stops the sweep cleanly: the current batch is cut short (its finished records are kept
and summarized with ``"interrupted": true``), the clusters are stopped, and no further run
starts.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import IO, Any

from radixmesh.bench.after_run import (
    engine_lag,
    placement_counts,
    save_decisions,
)
from radixmesh.bench.capacities import Capacities
from radixmesh.bench.launcher import BenchCluster, ClusterFactory, local_cluster
from radixmesh.bench.oracle import Oracle
from radixmesh.bench.progress import Progress
from radixmesh.bench.prompts import BLOCK_SIZE, ideal_hit_rate, make_admit, tokenizer_for
from radixmesh.bench.replay import Replay, mode_of, replay_together, timing_probe
from radixmesh.bench.run_result import RunResult, summary_entry
from radixmesh.bench.sglang import Gateway, SglangRouter
from radixmesh.bench.smg import Smg
from radixmesh.bench.spec import RunSpec, engine_context
from radixmesh.bench.usage import CpuMeter, write_load
from radixmesh.core.profile import resolve as resolve_profile
from radixmesh.results.records import Record
from radixmesh.results.run_summary import load_summary
from radixmesh.workload import Request, Schedule
from radixmesh.workload.build import Drops, build_counted
from radixmesh.workload.schedule import DEFAULT_CV, arrival_text, describe

BATCH_LIMIT = 4  # clusters up at once (default)
GATEWAYS: dict[str, type[Gateway]] = {"sglang": SglangRouter, "smg": Smg}
PROBE_SEED_OFFSET = 7919  # the capacity probe's workload: same generator, another seed
PROBE_REQUESTS = 48
PROBE_CLIENTS = 16
CAPACITY_FILE = "capacity.json"  # measured capacities by rate key: --resume times runs at them


def process_ids(cluster: BenchCluster, replay: Replay) -> dict[str, int | None]:
    """The processes the bench started for a run, by label: each node (by id), and a
    gateway's process and its relay."""
    pids: dict[str, int | None] = dict(getattr(cluster, "pids", {}))
    if replay.router is not None:
        pids |= replay.router.pids
    return pids


def _rate_key(spec: RunSpec) -> RunSpec:
    """What makes runs meet one open-loop rate: everything but the policy and the arrivals."""
    w = replace(spec.workload, schedule=Schedule.POISSON, arrival_cv=DEFAULT_CV)
    return replace(spec, name="", policy="none", lockstep="", group="", workload=w)


def rate_id(spec: RunSpec) -> str:
    """:func:`_rate_key` as canonical JSON (``capacity.json``'s key)."""
    return json.dumps(asdict(_rate_key(spec)), sort_keys=True, default=str)


class Sink:
    """Appends records to ``requests.jsonl`` (flushed per line) and drives the progress bar."""

    def __init__(self, fh: IO[str], progress: Progress | None) -> None:
        self.fh = fh
        self.progress = progress

    def __call__(self, rec: Record) -> None:
        self.fh.write(json.dumps(rec.to_json(), ensure_ascii=False) + "\n")
        self.fh.flush()
        if self.progress is not None:
            self.progress.update(rec.latency_s, rec.ok)


def batches(results: Sequence[RunResult], limit: int = BATCH_LIMIT) -> list[list[RunResult]]:
    """Consecutive runs sharing a ``lockstep`` key and a replay mode form one batch (at most
    ``limit`` clusters at once); everything else runs alone."""
    out: list[list[RunResult]] = []
    for r in results:
        prev = out[-1] if out else None
        if (
            prev is not None
            and r.spec.lockstep
            and prev[0].spec.lockstep == r.spec.lockstep
            and prev[0].mode == r.mode
            and len(prev) < limit
        ):
            prev.append(r)
        else:
            out.append([r])
    return out


LiveRun = tuple[RunResult, Replay, BenchCluster, Progress | None]


class Runner:
    """Runs specs in order, writing ``requests.jsonl`` and ``summary.json`` into ``out``."""

    def __init__(
        self,
        out: str | Path,
        cluster_factory: ClusterFactory | None = None,
        progress: bool = True,
        log: Callable[[str], None] = print,
        too_long: str = "drop",
        batch_limit: int = BATCH_LIMIT,
        probe_requests: int = PROBE_REQUESTS,
        probe_clients: int = PROBE_CLIENTS,
    ) -> None:
        if batch_limit < 1 or probe_requests < 1 or probe_clients < 1:
            raise ValueError("batch limit, probe requests and probe clients must be >= 1")
        self.batch_limit = batch_limit
        self.probe_n = probe_requests
        self.probe_clients = probe_clients
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.cluster_factory = cluster_factory or local_cluster(self.out / "logs")
        self.progress = progress
        self.log = log
        self.too_long = too_long
        self.results: list[RunResult] = []
        self.previous = self._load_previous()
        self._built: dict[tuple[Any, ...], tuple[list[Request], Drops, float | None]] = {}
        self._capacity = Capacities(self.out / CAPACITY_FILE)  # the first batch's, by rate_id

    def _load_previous(self) -> list[dict[str, Any]]:
        """Runs already summarized in ``out`` (a sweep can be resumed or extended)."""
        path = self.out / "summary.json"
        if not path.exists():
            return []
        return list(load_summary(path).get("runs", []))

    def done(self, spec: RunSpec) -> bool:
        """Whether ``out`` already holds a complete run of ``spec`` (same name, at least as
        many requests)."""
        return any(
            r["name"] == spec.name
            and not r.get("interrupted")
            and not r.get("skipped")
            and (r.get("planned_requests") or 0) >= (spec.workload.requests or 0)
            for r in self.previous
        )

    def _purge(self, name: str) -> None:
        """Drop an earlier attempt's records of run ``name`` from requests.jsonl."""
        path = self.out / "requests.jsonl"
        if not path.exists():
            return
        tag = json.dumps(name)
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [ln for ln in lines if f'"run": {tag},' not in ln]
        if len(kept) != len(lines):
            path.write_text("".join(kept), encoding="utf-8")

    def plan(self, spec: RunSpec) -> RunResult:
        """A run's workload, admitted (drops printed the first time a workload is built), its
        schedule and replay mode; no cluster yet. ``PromptTooLong`` under ``--too-long fail``."""
        key = (spec.workload, spec.nodes, spec.preset, spec.model)
        if key not in self._built:
            reqs, drops = build_counted(spec.workload, spec.nodes, make_admit(spec, self.too_long))
            self._built[key] = (reqs, drops, ideal_hit_rate(reqs, tokenizer_for(spec)))
            self.log(f"workload for {spec.name}: {len(reqs)} requests; {drops.text()}")
        reqs, drops, ideal = self._built[key]
        res = RunResult(spec, drops=drops, requests=reqs, ideal_hit_rate=ideal)
        res.mode = mode_of(spec, reqs)
        w = spec.workload
        res.schedule = describe(reqs, spec.concurrency, w.rate, w.arrivals, w.arrival_cv)
        if w.load is not None:  # timed once the capacity is measured
            res.probe_requests = self._probe_workload(spec)
            text = (f"open loop, {arrival_text(w.arrivals, w.arrival_cv)} at {100 * w.load:g} % "
                    "of capacity (unmeasured)")  # fmt: skip
            res.schedule.update({"schedule": w.arrivals.value, "schedule_text": text})
        return res

    def _probe_workload(self, spec: RunSpec) -> list[Request]:
        """The capacity probe's requests: the run's generator under another seed, untimed."""
        w = replace(spec.workload, seed=spec.workload.seed + PROBE_SEED_OFFSET,
                    requests=self.probe_n, load=None, rate=None,
                    schedule=Schedule.SEQUENTIAL)  # fmt: skip
        key = (w, spec.nodes, spec.preset, spec.model)
        if key not in self._built:
            reqs, drops = build_counted(w, spec.nodes, make_admit(spec, "drop"))
            self._built[key] = (reqs, drops, None)
        probe = self._built[key][0]
        return [replace(r, id=f"probe/{r.id}") for r in probe]

    def run_all(self, specs: Sequence[RunSpec], skip_done: bool = False) -> list[RunResult]:
        if skip_done:  # resumed: at the capacities the first attempt measured
            specs = [s for s in specs if not self.done(s)]
            try:
                self._capacity = Capacities.load(self.out / CAPACITY_FILE)
            except ValueError as exc:
                self.log(f"{exc}: capacities are measured anew")
        planned = [self.plan(s) for s in specs]
        for s in specs:
            self._purge(s.name)
        total, started = len(planned), 0
        with (self.out / "requests.jsonl").open("a", encoding="utf-8") as fh:
            for batch in batches(planned, self.batch_limit):
                self.results.extend(batch)
                labels = [f"[{started + j + 1}/{total}] {r.spec.name}" for j, r in enumerate(batch)]
                started += len(batch)
                if not self._run_guarded(batch, fh, labels):
                    break
        return self.results

    def _run_guarded(self, batch: list[RunResult], fh: IO[str], labels: list[str]) -> bool:
        """Run one batch; False when the sweep must stop (Ctrl-C)."""
        try:
            self._run_batch(batch, fh, labels)
        except Exception as exc:  # a broken run must not lose the sweep
            for res in batch:
                res.skipped = res.skipped or f"failed: {type(exc).__name__}: {exc}"[:500]
            self.log(f"{', '.join(labels)}: failed — {exc}")
        except KeyboardInterrupt:
            for res in batch:
                res.interrupted = not res.skipped
            self.log(f"\n{', '.join(labels)}: interrupted — finished records kept")
            return False
        finally:
            self.write_summary()
        return True

    def _run_batch(self, results: list[RunResult], fh: IO[str], labels: list[str]) -> None:
        live: list[LiveRun] = []
        try:
            todo = []
            for res, label in zip(results, labels, strict=True):
                gateway = GATEWAYS.get(res.spec.policy)
                if gateway is not None and not gateway.available():
                    res.skipped = gateway.install_hint
                    self.log(f"{label}: skipped — {gateway.install_hint}")
                    continue
                todo.append((res, label))
            self._start_all(todo, fh, len(results) > 1, live)
            names = [res.spec.name for res, *_ in live]
            for res, *_ in live:
                res.batch = names[0]
                res.paired_with = [n for n in names if n != res.spec.name]
            if live:
                self._replay(live)
        finally:
            for res, replay, cluster, progress in live:
                self._stop(res, replay, cluster, progress)

    def _start_all(
        self, todo: list[tuple[RunResult, str]], fh: IO[str], batched: bool, live: list[LiveRun]
    ) -> None:
        """Boot the batch's clusters at once — spawn every cluster's nodes first, then wait
        for each (one after another, six 4-node clusters took minutes on a loaded box) —
        appending each to ``live`` in order; a cluster that was spawned is closed on failure
        (the caller stops the ones in ``live``)."""
        spawned: list[tuple[RunResult, str, BenchCluster]] = []
        try:
            for res, label in todo:
                spawned.append((res, label, self.cluster_factory(res.spec)))
            while spawned:
                res, label, cluster = spawned.pop(0)  # _start closes it if it fails
                live.append(self._start(res, fh, label, batched, cluster))
        finally:
            for _, _, cluster in spawned:
                cluster.close()

    def _replay(self, live: list[LiveRun]) -> None:
        first = live[0][0]
        pairs = [(replay, res.requests) for res, replay, _, _ in live]
        load = first.spec.workload.load
        probe = None if load is None else timing_probe(
            first.spec, first.requests, first.probe_requests, load,
            self._capacity.get(rate_id(first.spec)), self.probe_clients, self.log)
        meters = [CpuMeter(process_ids(cluster, replay)) for _, replay, cluster, _ in live]
        try:
            ran = asyncio.run(replay_together(pairs, first.mode, probe,
                                              started=lambda: [m.start() for m in meters]))
        finally:
            for (res, *_), meter in zip(live, meters, strict=True):
                res.cpu = meter.stop()
            if probe is not None and probe.rate is not None:  # measured (even if cut short)
                self._capacity.remember(rate_id(first.spec), probe.capacity_rps or 0.0)
        if probe is None:
            return
        info = probe.to_json()
        w = first.spec.workload
        probed = "".join(f"; {k} {v:.2f}" for k, v in probe.throughput.items())
        self.log(f"capacity {probe.capacity_rps:.2f} req/s ({probe.basis}{probed}); "
                 f"{arrival_text(w.arrivals, w.arrival_cv)} at {100 * probe.load:g} %: "
                 f"{probe.rate:.2f} req/s")  # fmt: skip
        for (res, *_), (_, timed) in zip(live, ran, strict=True):
            res.requests = list(timed)
            res.capacity = info
            res.schedule = describe(res.requests, 1, probe.rate, w.arrivals, w.arrival_cv)

    def _stop(self, res: RunResult, replay: Replay, cluster: BenchCluster, progress: Any
              ) -> None:
        if progress is not None:
            progress.close()
        res.load = write_load(self.out / "load" / f"{res.spec.name}.csv", res.records,
                              res.node_ids)  # fmt: skip
        if replay.router is not None:
            replay.router.close()
        if res.spec.policy == "cost":
            res.placements = placement_counts(cluster.urls)
        if replay.router is None:  # the nodes routed: keep why (scripts/why.py reads it)
            save_decisions(cluster.urls, self.out / "decisions" / f"{res.spec.name}.jsonl")
        engines = getattr(cluster, "engine_urls", [])
        if engines:
            res.engine_lag = engine_lag(engines, res.spec.name, self.log)
        cluster.close()
        if replay.oracle is not None:
            res.oracle_mismatches = replay.oracle.mismatches

    def _start(
        self, res: RunResult, fh: IO[str], label: str, batched: bool, cluster: BenchCluster
    ) -> LiveRun:
        """Make a spawned cluster ready (closed if that fails) and attach the run to it."""
        spec = res.spec
        try:
            wait = getattr(cluster, "wait_ready", None)
            if wait is not None:
                wait()
            progress = Progress(label, len(res.requests)) if self.progress else None
            if progress is not None and batched:
                progress.tty = False  # several runs advance together: plain lines, no \r bar
            replay = Replay(spec, cluster, Sink(fh, progress))
            res.records = replay.records
            res.node_ids = list(cluster.node_ids)
            self._attach_baseline(replay, spec, cluster, self.out / "logs" / spec.name)
        except BaseException:
            cluster.close()
            raise
        return res, replay, cluster, progress

    @staticmethod
    def _attach_baseline(
        replay: Replay, spec: RunSpec, cluster: BenchCluster, log_dir: Path | None = None
    ) -> None:
        gateway = GATEWAYS.get(spec.policy)
        delay = spec.net_delay_s * spec.time_scale  # stretched as the nodes' links are
        if gateway is not None:
            log = log_dir / f"{spec.policy}.log" if log_dir is not None else None
            # its hop to the workers crosses the same emulated link as a peer forward (with
            # regions: from the gateway's region to each worker's), in the mesh's time
            scale, regions = spec.time_scale, spec.region_map
            links = None if regions is None else [
                (o * scale, b * scale) for o, b in regions.gateway_links(spec.nodes)]
            replay.router = gateway(cluster.urls, log_path=log, link_delay_s=delay, links=links,
                                    time_scale=scale)
        elif spec.policy == "oracle":
            context = engine_context(spec.preset, spec.model, spec.node_profiles)
            shadowed = [resolve_profile(p) for p in spec.node_profiles] or None
            replay.oracle = Oracle(cluster.node_ids, spec.cache_tokens, BLOCK_SIZE, delay,
                                   spec.seed, context, profiles=shadowed,
                                   time_scale=spec.time_scale)  # fmt: skip

    def write_summary(self) -> dict[str, Any]:
        current = [summary_entry(r) for r in self.results]
        names = {r["name"] for r in current}
        kept = [r for r in self.previous if r["name"] not in names]
        summary = {"runs": kept + current}
        tmp = self.out / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        tmp.replace(self.out / "summary.json")
        return summary
