"""Run benchmark configurations, each on a fresh cluster, and record every request.

Theory of operation
-------------------
For each :class:`~radixmesh.bench.spec.RunSpec`::

    build the workload (seeded; prompts that do not fit the engine's context are dropped)
    start a fresh cluster (cold caches) ── nodes run the spec's policy (``none`` for the
    │                                      client-side baselines ``oracle`` and ``sglang``)
    warm each node up with one short, unrelated prompt (torch's first-call cost, not a cache)
    replay: sequential  (the paper's: round-robin entry, one at a time)
    │       closed loop (``concurrency`` clients, each one at a time)
    │       open loop   (requests carry arrival times ``t``: Poisson or a trace)
    └─ each finished request → one :class:`Record` line in ``requests.jsonl`` (flushed)
    stop the cluster, summarize the run into ``summary.json`` (rewritten after every run)

Ctrl-C stops the sweep cleanly: the current run is cut short (its finished records are kept
and summarized with ``"interrupted": true``), the cluster is stopped, and no further run starts.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from radixmesh.bench import client
from radixmesh.bench.cluster import BenchCluster, ClusterFactory, local_cluster
from radixmesh.bench.oracle import Oracle
from radixmesh.bench.progress import Progress
from radixmesh.bench.sglang import INSTALL_HINT, SglangRouter, available
from radixmesh.bench.spec import RunSpec, engine_context
from radixmesh.results.records import Record
from radixmesh.results.summary import summarize
from radixmesh.workload import Request, build
from radixmesh.workload.build import Fits

BLOCK_SIZE = 16
WARMUP_PROMPT = "radixmesh warm-up {i}: hello"


@dataclass(slots=True)
class RunResult:
    spec: RunSpec
    records: list[Record] = field(default_factory=list)
    interrupted: bool = False
    skipped: str | None = None
    dropped: int = 0
    oracle_mismatches: int | None = None
    ideal_hit_rate: float | None = None


def make_fits(spec: RunSpec) -> Fits:
    """Requests whose prompt (in the engine's tokens) leaves room for the output."""
    context = engine_context(spec.preset, spec.model)
    tokenizer = tokenizer_for(spec)

    def fits(r: Request) -> bool:
        return len(tokenizer.encode(r.text)) + r.max_tokens + 8 < context

    return fits


def ideal_hit_rate(requests: Sequence[Request], tokenizer: Any) -> float | None:
    """Cached prompt tokens / prompt tokens if every request found every earlier prompt cached
    (one unbounded cache for the whole cluster; the engine always computes >= 1 token): the
    ceiling no router can beat on this request sequence."""
    from radixmesh.core.radix import RadixTree

    tree: RadixTree[None] = RadixTree(BLOCK_SIZE, 0)
    cached = total = 0
    for i, r in enumerate(requests):
        ids = tokenizer.encode(r.text)
        cached += min(tree.match(ids), len(ids) - 1)
        total += len(ids)
        tree.insert(ids, float(i))
    return cached / total if total else None


def tokenizer_for(spec: RunSpec) -> Any:
    from radixmesh.engine.tokenizers import ByteTokenizer, HFTokenizer

    return HFTokenizer(spec.model) if spec.model else ByteTokenizer()


def summary_entry(res: RunResult) -> dict[str, Any]:
    s, w = res.spec, res.spec.workload
    entry: dict[str, Any] = {
        "name": s.name,
        "policy": s.policy,
        "nodes": s.nodes,
        "workload": w.source,
        "skew": s.skew,
        "comm_delay_ms": s.comm_delay_s * 1000.0,
        "gossip_interval_ms": s.gossip_interval_s * 1000.0,
        "cache_tokens": s.cache_tokens,
    }
    entry.update(summarize(res.records))
    entry.update(
        {
            "group": s.group,
            "schedule": w.schedule.value if w.rate else "sequential",
            "concurrency": s.concurrency,
            "arrival_rate": w.rate,
            "planned_requests": w.requests,
            "seed": w.seed,
            "dropped_too_long": res.dropped,
            "interrupted": res.interrupted,
            "skipped": res.skipped,
            "oracle_mismatches": res.oracle_mismatches,
            "lockstep": s.lockstep,
            "ideal_hit_rate": res.ideal_hit_rate,
        }
    )
    return entry


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


def new_http_client() -> httpx.AsyncClient:
    # Idle connections expire well before uvicorn's 5 s keep-alive, or a reused connection can
    # race the server closing it (a client-side ReadError, not a node failure).
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64, keepalive_expiry=1.0)
    return httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits)


async def lockstep(pairs: Sequence[tuple[Replay, Sequence[Request]]]) -> None:
    """Interleave runs request by request: request i goes to every run's cluster in turn, one
    at a time. Each run still sees the paper's schedule, and all of them see the machine in the
    same state, so their ratios survive drifting background load."""
    async with new_http_client() as http:
        for replay, _ in pairs:
            await replay.setup(http)
        for i in range(max(len(reqs) for _, reqs in pairs)):
            for replay, reqs in pairs:
                if i < len(reqs):
                    await replay.one(http, i, reqs[i])


def batches(specs: Sequence[RunSpec], limit: int = 4) -> list[list[RunSpec]]:
    """Consecutive sequential runs sharing a ``lockstep`` key form one batch (at most
    ``limit`` clusters at once); everything else runs alone."""
    out: list[list[RunSpec]] = []
    for s in specs:
        prev = out[-1] if out else None
        if (
            prev is not None
            and s.lockstep
            and s.sequential
            and prev[0].lockstep == s.lockstep
            and prev[0].sequential
            and len(prev) < limit
        ):
            prev.append(s)
        else:
            out.append([s])
    return out


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
        self.router: SglangRouter | None = None
        self.oracle: Oracle | None = None
        self.tokenizer = tokenizer_for(spec)
        self.model = ""
        self.t0 = 0.0

    async def run(self, requests: Sequence[Request]) -> None:
        async with new_http_client() as http:
            await self.setup(http)
            if any(r.t is not None for r in requests):
                await self._open_loop(http, requests)
            else:
                await self._closed_loop(http, requests, self.spec.concurrency)

    async def setup(self, http: httpx.AsyncClient) -> None:
        self.model = await client.model_name(http, self.urls[0])
        await self._warm_up(http)
        self.t0 = time.perf_counter()

    async def _warm_up(self, http: httpx.AsyncClient) -> None:
        for i, url in enumerate(self.urls):
            req = Request(id=f"warmup/{i}", prompt=WARMUP_PROMPT.format(i=i), max_tokens=1)
            if self.oracle is not None:
                self.oracle.mirrors[i].serve(self.tokenizer.encode(req.text), 1)
            rec = self._record(-1, req, i)
            await client.send(http, url, self.model, req, rec, time.perf_counter())
            if rec.error:
                raise RuntimeError(f"warm-up of {url} failed: {rec.error}")

    async def _closed_loop(
        self, http: httpx.AsyncClient, requests: Sequence[Request], workers: int
    ) -> None:
        queue = iter(enumerate(requests))

        async def worker() -> None:
            for seq, req in queue:
                await self.one(http, seq, req)

        await asyncio.gather(*(worker() for _ in range(workers)))

    async def _open_loop(self, http: httpx.AsyncClient, requests: Sequence[Request]) -> None:
        tasks: list[asyncio.Task[None]] = []
        try:
            for seq, req in enumerate(requests):
                delay = (req.t or 0.0) - (time.perf_counter() - self.t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(self.one(http, seq, req)))
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

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

    async def one(self, http: httpx.AsyncClient, seq: int, req: Request) -> None:
        entry = (req.entry or 0) % len(self.urls)
        if self.oracle is not None:
            rec = await self._via_oracle(http, seq, req, entry)
        else:
            url = self.router.url if self.router else self.urls[entry]
            rec = self._record(seq, req, entry)
            await client.send(http, url, self.model, req, rec, self.t0)
        self.records.append(rec)
        self.sink(rec)

    async def _via_oracle(
        self, http: httpx.AsyncClient, seq: int, req: Request, entry: int
    ) -> Record:
        """Send to the entry node, naming the oracle's choice in ``x-radixmesh-target``: the
        entry node forwards it through the real peer path (emulated delay both ways)."""
        assert self.oracle is not None
        oracle = self.oracle
        tokens = self.tokenizer.encode(req.text)
        node, predicted = oracle.choose(tokens, req.max_tokens, entry)
        rec = self._record(seq, req, entry)
        cached = oracle.started(node, tokens, req.max_tokens)
        headers = {client.H_TARGET: self.ids[node]} if node != entry else None
        await client.send(http, self.urls[entry], self.model, req, rec, self.t0, headers)
        rec.expected_cached_tokens = predicted
        hop = oracle.rtt_s if node != entry else 0.0
        service = rec.latency_s - hop if rec.ok else None
        oracle.finished(node, len(tokens) - cached, cached, service, cached, rec.cached_tokens)
        if rec.ok and rec.served_by != self.ids[node]:  # a failed forward fell back elsewhere
            oracle.mismatches += 1
        return rec


class Runner:
    """Runs specs in order, writing ``requests.jsonl`` and ``summary.json`` into ``out``."""

    def __init__(
        self,
        out: str | Path,
        cluster_factory: ClusterFactory | None = None,
        progress: bool = True,
        log: Callable[[str], None] = print,
    ) -> None:
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.cluster_factory = cluster_factory or local_cluster(self.out / "logs")
        self.progress = progress
        self.log = log
        self.results: list[RunResult] = []
        self.previous = self._load_previous()

    def _load_previous(self) -> list[dict[str, Any]]:
        """Runs already summarized in ``out`` (a sweep can be resumed or extended)."""
        path = self.out / "summary.json"
        if not path.exists():
            return []
        return list(json.loads(path.read_text()).get("runs", []))

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

    def run_all(self, specs: Sequence[RunSpec], skip_done: bool = False) -> list[RunResult]:
        if skip_done:
            specs = [s for s in specs if not self.done(s)]
        for s in specs:
            self._purge(s.name)
        total, started = len(specs), 0
        with (self.out / "requests.jsonl").open("a", encoding="utf-8") as fh:
            for batch in batches(specs):
                results = [RunResult(s) for s in batch]
                self.results.extend(results)
                labels = [f"[{started + j + 1}/{total}] {s.name}" for j, s in enumerate(batch)]
                started += len(batch)
                try:
                    self._run_batch(results, fh, labels)
                except Exception as exc:  # a broken run must not lose the sweep
                    for res in results:
                        res.skipped = res.skipped or f"failed: {type(exc).__name__}: {exc}"[:500]
                    self.log(f"{', '.join(labels)}: failed — {exc}")
                except KeyboardInterrupt:
                    for res in results:
                        res.interrupted = not res.skipped
                    self.log(f"\n{', '.join(labels)}: interrupted — finished records kept")
                    break
                finally:
                    self.write_summary()
        return self.results

    def _run_batch(self, results: list[RunResult], fh: IO[str], labels: list[str]) -> None:
        live: list[tuple[RunResult, list[Request], Replay, BenchCluster, Progress | None]] = []
        try:
            for res, label in zip(results, labels, strict=True):
                if res.spec.policy == "sglang" and not available():
                    res.skipped = INSTALL_HINT
                    self.log(f"{label}: skipped — {INSTALL_HINT}")
                    continue
                live.append(self._prepare(res, fh, label, batched=len(results) > 1))
            if len(live) == 1:
                asyncio.run(live[0][2].run(live[0][1]))
            elif live:
                asyncio.run(lockstep([(replay, reqs) for _, reqs, replay, _, _ in live]))
        finally:
            for res, _, replay, cluster, progress in live:
                if progress is not None:
                    progress.close()
                if replay.router is not None:
                    replay.router.close()
                cluster.close()
                if replay.oracle is not None:
                    res.oracle_mismatches = replay.oracle.mismatches

    def _prepare(
        self, res: RunResult, fh: IO[str], label: str, batched: bool
    ) -> tuple[RunResult, list[Request], Replay, BenchCluster, Progress | None]:
        spec = res.spec
        fits = make_fits(spec)
        requests = build(spec.workload, spec.nodes, fits)
        res.dropped = self._count_dropped(spec, fits)
        res.ideal_hit_rate = ideal_hit_rate(requests, tokenizer_for(spec))
        progress = Progress(label, len(requests)) if self.progress else None
        if progress is not None and batched:
            progress.tty = False  # several runs advance together: plain lines, no \r bar
        cluster = self.cluster_factory(spec)
        replay = Replay(spec, cluster, Sink(fh, progress))
        res.records = replay.records
        try:
            self._attach_baseline(replay, spec, cluster)
        except BaseException:
            cluster.close()
            raise
        return res, requests, replay, cluster, progress

    @staticmethod
    def _attach_baseline(replay: Replay, spec: RunSpec, cluster: BenchCluster) -> None:
        if spec.policy == "sglang":
            replay.router = SglangRouter(cluster.urls)
        elif spec.policy == "oracle":
            replay.oracle = Oracle(
                cluster.node_ids, spec.cache_tokens, BLOCK_SIZE, spec.comm_delay_s, spec.seed
            )

    @staticmethod
    def _count_dropped(spec: RunSpec, fits: Fits) -> int:
        """Questions of the source left out because they do not fit the context."""
        from radixmesh.workload.build import groups_for

        if spec.workload.trace:
            return 0
        all_groups = groups_for(spec.workload)
        return sum(1 for reqs in all_groups.values() for r in reqs if not fits(r))

    def write_summary(self) -> dict[str, Any]:
        current = [summary_entry(r) for r in self.results]
        names = {r["name"] for r in current}
        kept = [r for r in self.previous if r["name"] not in names]
        summary = {"runs": kept + current}
        tmp = self.out / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        tmp.replace(self.out / "summary.json")
        return summary
