"""``make vllm-check``: two real vLLM CPU servers, two radixmesh nodes in front, one workload.

Theory of operation
-------------------
vLLM lives in its own virtual environment (``.venv-vllm``: it pins other versions than
radixmesh); this program runs in radixmesh's and only talks to it over HTTP and ZMQ::

    save_random_model_dir (Qwen2 "tiny", random weights, tokenizer.json)
    2 x  <vllm-python> -m vllm.entrypoints.openai.api_server --model DIR --block-size B
            --kv-events-config {zmq PUB tcp://*:P, replay ROUTER tcp://*:R}
            --enable-prompt-tokens-details --num-gpu-blocks-override K
    for policy in (cost, none), back to back:
        POST /reset_prefix_cache on both engines (VLLM_SERVER_DEV_MODE=1)
        2 x  radixmesh serve --engine vllm --engine-url ... --kv-events tcp://*:P
                --kv-replay tcp://*:R --tokenizer DIR --engine-block-size B --policy P
             (peers of each other: ``runtime.cluster.LocalCluster``)
        the same requests, one in flight at a time (``--concurrency``: more), entry node
        round-robin; with one in flight both engines' ``/metrics``
        (``vllm:prefix_cache_queries`` / ``_hits``) are read around each request, so the
        served engine's hit delta is that request's true cached-token count

Requests stream, so the response headers carry what radixmesh knew before the engine ran:
``x-radixmesh-cached-tokens`` is the serving node's KV-event index match at acceptance (any
policy), ``x-radixmesh-expected-cached-tokens`` the router's estimate it routed on (``none``
claims 0 by design). Both are compared per request with the engine's truth, the served
engine's ``/metrics`` hit delta (and that with the engine's own
``usage.prompt_tokens_details.cached_tokens``, which must agree). ``--capture DIR`` also
subscribes to the first engine's publisher itself and saves its first batches (and one replay
answer) as golden fixtures for the decoder tests. Figures are
printed and written to ``OUT/vllm_check.md`` and ``OUT/vllm_check.json``; records per request
to ``OUT/records-<policy>.jsonl``. Every process it starts is stopped on exit (process
groups; the nodes die with this process too).

Why one file over 400 lines: it is one script outside CI, read top to bottom (model dir,
engines, nodes, replay, per-request index check, report); ``chaos/engines.py`` and
``bench/llamacpp_check.py`` reuse its engine and workload parts. ``--concurrency 4,16`` runs
every policy at each level on the same engines; every mismatch at concurrency is classified
(``bench/mismatch.py``) from the engines' own KV events, which the bench subscribes to itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from radixmesh.bench.client import request_body
from radixmesh.bench.mismatch import Seen, classify_all, stream_of
from radixmesh.core.headers import HEADER_CACHED, HEADER_EXPECTED, HEADER_ROUTE, HEADER_SERVED_BY
from radixmesh.results.records import Record
from radixmesh.results.summary import summarize
from radixmesh.runtime.cluster import free_ports
from radixmesh.runtime.metrics import parse_samples, sample_sum
from radixmesh.workload.request import Request

DEFAULT_VLLM_PYTHON = ".venv-vllm/bin/python"
READY_TIMEOUT_S = 600.0
METRIC_WAIT_S = 2.0


# ---------------------------------------------------------------------------- pure helpers
def prefix_counters(text: str) -> tuple[float, float]:
    """(queries, hits) in tokens from a vLLM ``/metrics`` page, summed over label sets
    (``vllm:prefix_cache_queries_total{engine="0",...} 606.0``; ``_created`` lines skipped)."""
    samples = parse_samples(text)

    def total(name: str) -> float:  # counters end in _total; older vLLM pages lack the suffix
        return sample_sum(samples, name + "_total") or sample_sum(samples, name)

    return total("vllm:prefix_cache_queries"), total("vllm:prefix_cache_hits")


def kv_events_config(events_port: int, replay_port: int, buffer_steps: int = 10_000) -> str:
    """vLLM's ``--kv-events-config`` JSON: publisher binds ``*`` (radixmesh connects)."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": f"tcp://*:{events_port}",
                       "replay_endpoint": f"tcp://*:{replay_port}",
                       "buffer_steps": buffer_steps, "topic": ""})


@dataclass(frozen=True, slots=True)
class Observed:
    """One request's cached-token figures: radixmesh's two predictions, the engine's two."""

    index: int  # x-radixmesh-cached-tokens of a stream: the serving node's index match
    router: int  # x-radixmesh-expected-cached-tokens: what the router routed on
    usage: int | None  # the engine's usage.prompt_tokens_details.cached_tokens
    actual: int  # the served engine's vllm:prefix_cache_hits delta


@dataclass(slots=True)
class Agreement:
    """Predicted vs actual cached tokens over the requests of one run."""

    requests: int = 0
    equal: int = 0  # index prediction == actual
    router_equal: int = 0  # router estimate == actual
    usage_equal: int = 0  # the engine's usage figure == its /metrics delta
    by_route: dict[str, list[int]] = field(default_factory=dict)  # route -> [n, equal]
    misses: list[dict[str, Any]] = field(default_factory=list)
    usage_sum: int = 0  # the engines' usage cached_tokens, summed
    counter_check: tuple[int, int] | None = None  # (counters' hit delta, usage_sum) of a run
    prompts: Any = None  # request -> prompt token ids (set by the caller: the tokenizer)
    seen: list[tuple[int, Seen]] = field(default_factory=list)  # (engine, request) to classify
    mismatch: dict[str, Any] | None = None  # bench/mismatch.py's tally, once classified
    verdicts: list[str] = field(default_factory=list)  # per entry of ``seen``

    def note_seen(self, rec: Record, req: Request, marks: dict[str, float], actual: int,
                  node_engine: dict[str, int]) -> None:
        idx = node_engine.get(rec.served_by or "")
        if self.prompts is None or idx is None or "headers" not in marks:
            return
        end = marks["sent"] + rec.latency_s
        self.seen.append((idx, Seen(rec.id, tuple(self.prompts(req)), rec.cached_tokens or 0,
                                    actual, marks["sent"], marks["headers"],
                                    marks.get("first", end))))

    def add(self, rec: Record, seen: Observed) -> None:
        self.requests += 1
        self.usage_sum += seen.usage or 0
        same = seen.index == seen.actual
        self.equal += same
        self.router_equal += seen.router == seen.actual
        self.usage_equal += seen.usage == seen.actual
        slot = self.by_route.setdefault(rec.route or "?", [0, 0])
        slot[0] += 1
        slot[1] += same
        if not same and len(self.misses) < 20:
            self.misses.append({"id": rec.id, "route": rec.route, "served_by": rec.served_by,
                                "predicted": seen.index, "router": seen.router,
                                "actual": seen.actual, "prompt_tokens": rec.prompt_tokens})

    @property
    def share(self) -> float | None:
        return self.equal / self.requests if self.requests else None

    def to_json(self) -> dict[str, Any]:
        return {"requests": self.requests, "equal": self.equal, "share_equal": self.share,
                "router_equal": self.router_equal, "usage_equals_metrics": self.usage_equal,
                "counter_hits_vs_usage_sum": self.counter_check,
                "by_route": {k: {"requests": v[0], "equal": v[1]}
                             for k, v in sorted(self.by_route.items())},
                "first_mismatches": self.misses, "classified": self.mismatch}


# ---------------------------------------------------------------------------- processes
def _stop_group(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    """SIGTERM the process group, SIGKILL what is left after ``timeout``."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


@dataclass(slots=True)
class VllmServer:
    """One vLLM OpenAI server with KV events, in its own process group."""

    name: str
    python: str
    model_dir: Path
    port: int
    events_port: int
    replay_port: int
    block_size: int
    num_blocks: int
    log_path: Path
    threads: int = 1
    max_model_len: int = 4096
    extra_args: tuple[str, ...] = ()  # chaos/engines.py restarts it with other settings
    extra_env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        return [self.python, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model_dir), "--served-model-name", "tiny",
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
                "--max-model-len", str(self.max_model_len),
                "--block-size", str(self.block_size),
                "--num-gpu-blocks-override", str(self.num_blocks),
                "--enable-prompt-tokens-details",
                "--kv-events-config", kv_events_config(self.events_port, self.replay_port),
                *self.extra_args]

    def start(self) -> None:
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                   OMP_NUM_THREADS=str(self.threads), VLLM_SERVER_DEV_MODE="1",
                   PYTHONUNBUFFERED="1", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1",
                   **self.extra_env)
        with open(self.log_path, "ab") as log:
            log.write(f"--- {' '.join(self.argv())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    def wait_ready(self, deadline: float) -> None:
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited (rc {self.proc.returncode}); "
                                   f"log tail:\n{tail(self.log_path)}")
            with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(
                    self.url + "/v1/models", timeout=2) as resp:
                if resp.status == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready; log tail:\n{tail(self.log_path)}")
            time.sleep(1.0)

    def counters(self) -> tuple[float, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as resp:
            return prefix_counters(resp.read().decode("utf-8", "replace"))

    def reset_prefix_cache(self) -> None:
        req = urllib.request.Request(self.url + "/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()

    def stop(self) -> None:
        if self.proc is not None:
            _stop_group(self.proc)


def tail(path: Path, lines: int = 25) -> str:
    """The last lines of a log, without pip's index warnings."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join([t for t in text if "Location 'file:" not in t][-lines:])


def vllm_version(python: str) -> str:
    out = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"],
                         capture_output=True, text=True, timeout=300, check=False)
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "unknown"


# ---------------------------------------------------------------------------- capture
class Capture:
    """Subscribes to the engines' publishers itself and keeps their raw frames (fixtures)."""

    def __init__(self, endpoints: Sequence[str]) -> None:
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        # per publisher: (arrival on the perf_counter clock, [topic, seq, payload])
        self.timed: list[list[tuple[float, list[bytes]]]] = [[] for _ in endpoints]
        self._stop = threading.Event()
        self._socks = []
        for ep in endpoints:
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.setsockopt(zmq.RCVTIMEO, 200)
            sock.connect(ep)
            self._socks.append(sock)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = self._zmq.Poller()
        for s in self._socks:
            poller.register(s, self._zmq.POLLIN)
        which = {id(s): i for i, s in enumerate(self._socks)}
        while not self._stop.is_set():
            for sock, _ in poller.poll(200):
                frames = list(sock.recv_multipart())
                self.timed[which[id(sock)]].append((time.perf_counter(), frames))

    @property
    def frames(self) -> list[list[bytes]]:
        """The first publisher's messages, in arrival order (the fixtures' source)."""
        return [f for _, f in self.timed[0]]

    def replay(self, endpoint: str, start_seq: int = 0) -> list[list[bytes]]:
        """One replay answer (DEALER): every buffered batch from ``start_seq``, end marker."""
        sock = self._ctx.socket(self._zmq.DEALER)
        sock.setsockopt(self._zmq.RCVTIMEO, 3000)
        sock.connect(endpoint)
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out: list[list[bytes]] = []
        try:
            while True:
                msg = list(sock.recv_multipart())
                out.append(msg)
                if len(msg) >= 2 and msg[-2] == (-1).to_bytes(8, "big", signed=True):
                    break
        finally:
            sock.close(0)
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        for s in self._socks:
            s.close(0)
        self._ctx.term()


def pick_fixture_frames(frames: Sequence[list[bytes]], max_bytes: int = 256 * 1024
                        ) -> list[list[bytes]]:
    """Live messages of one publisher, in order, from the first one until a batch with a
    removal has been taken (at least 3), within ``max_bytes``: a run of consecutive seqs a
    test can apply to an index as a node would."""
    import msgpack

    def kinds(payload: bytes) -> set[str]:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        return {str(e.get("type") if isinstance(e, dict) else e[0]) for e in batch[1]}

    chosen: list[list[bytes]] = []
    size = 0
    wanted = {"BlockRemoved", "AllBlocksCleared"}
    for f in frames:
        if size + len(f[2]) > max_bytes and chosen:
            break
        chosen.append(f)
        size += len(f[2])
        wanted -= kinds(f[2])
        if "BlockRemoved" not in wanted and len(chosen) >= 3:
            break
    return chosen


def save_run_fixture(path: Path, timed: Sequence[tuple[float, list[bytes]]],
                     agreement: Agreement, block_size: int, engine_block_size: int,
                     max_bytes: int = 384 * 1024) -> int:
    """Engine 0's batches from the start of a concurrent run up to its first requests that
    include 3 classified mismatches (at most 24 requests, ``max_bytes`` of batches), with
    those requests and their verdicts (a match re-judged with the replay: it must agree with
    its stream too): the classifier's test fixture at ``path``."""
    import msgpack

    picked: list[dict[str, Any]] = []
    for (idx, s), kind in zip(agreement.seen, agreement.verdicts, strict=True):
        if idx != 0:
            continue
        picked.append({"id": s.id, "prompt": list(s.prompt), "predicted": s.predicted,
                       "actual": s.actual, "t_sent": s.t_sent, "t_headers": s.t_headers,
                       "t_first": s.t_first, "class": kind})
        if sum(p["class"] != "match" for p in picked) >= 3 or len(picked) >= 24:
            break
    end = max((p["t_first"] for p in picked), default=0.0) + 1.0
    frames: list[list[Any]] = []
    size, cut = 0, False
    for t, f in timed:
        if t > end:
            break
        if size > max_bytes:
            cut = True
            break
        frames.append([t, list(f)])
        size += len(f[-1])
    if cut:  # keep the requests whose whole window the kept batches cover
        picked = [p for p in picked if p["t_first"] + 1.0 <= frames[-1][0]]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgpack.packb(
        {"frames": frames, "requests": picked, "block_size": block_size,
         "engine_block_size": engine_block_size}))
    return len(picked)


def save_fixtures(directory: Path, live: Sequence[list[bytes]],
                  replay: Sequence[list[bytes]], meta: dict[str, Any]) -> None:
    import msgpack

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "live.msgpack").write_bytes(msgpack.packb([list(f) for f in live]))
    (directory / "replay.msgpack").write_bytes(msgpack.packb([list(f) for f in replay]))
    (directory / "README.md").write_text(
        "Raw ZMQ messages captured from a real vLLM by `make vllm-check` "
        "(`radixmesh.bench.vllm_check --capture`).\n\n"
        "- `live.msgpack`: a msgpack array of PUB messages, each `[topic, seq, payload]` "
        "(bytes, as received).\n"
        "- `replay.msgpack`: one replay answer to `[b\"\", seq 0]` as a DEALER received it, "
        "each `[b\"\", topic, seq, payload]`, the last the end marker.\n\n"
        f"```json\n{json.dumps(meta, indent=2)}\n```\n", encoding="utf-8")


# ---------------------------------------------------------------------------- workload
def build_workload(requests: int, groups: int, scale: float, seed: int) -> list[Request]:
    from radixmesh.workload.skew import uniform
    from radixmesh.workload.synthetic import synthetic_groups

    pool = synthetic_groups(seed=seed, scale=scale, groups=groups,
                            max_per_group=max(1, requests // groups + 1))
    reqs = uniform(pool, requests, seed)
    return [r.with_entry(i % 2).with_time(None) for i, r in enumerate(reqs)]


async def replay_run(policy: str, urls: Sequence[str], node_ids: Sequence[str],
                     engines: Sequence[VllmServer], node_engine: dict[str, int],
                     reqs: Sequence[Request], concurrency: int = 1,
                     prompts: Callable[[Request], list[int]] | None = None
                     ) -> tuple[list[Record], Agreement]:
    """Send ``reqs`` in order, ``concurrency`` in flight (closed loop). One in flight: each
    request's truth is the served engine's counter delta around it. More: the counters mix
    requests, so the truth is the engine's per-request usage figure, and the run's summed
    usage is checked against the counters' total delta (``Agreement.counter_check``)."""
    agreement = Agreement(prompts=prompts)
    records: list[Record] = []
    t0 = time.perf_counter()
    start = [e.counters() for e in engines]
    queue = list(enumerate(reqs))[::-1]

    async def worker(http: httpx.AsyncClient) -> None:
        while queue:
            seq, req = queue.pop()
            entry = req.entry or 0
            before = [e.counters() for e in engines] if concurrency == 1 else []
            rec = Record(run="vllm-check", policy=policy, seq=seq, id=req.id, group=req.group,
                         entry=entry, entry_node=node_ids[entry], t_send=time.perf_counter() - t0)
            usage = await send_stream(http, urls[entry], req, rec, t0, marks := {})
            records.append(rec)
            if not rec.ok:
                continue
            actual = (await _served_delta(rec, engines, node_engine, before)
                      if concurrency == 1 else usage)
            if actual is not None:
                agreement.add(rec, Observed(rec.cached_tokens or 0,
                                            rec.expected_cached_tokens or 0, usage, actual))
                agreement.note_seen(rec, req, marks, actual, node_engine)

    async with httpx.AsyncClient(timeout=600.0, trust_env=False) as http:
        await asyncio.gather(*(worker(http) for _ in range(max(1, concurrency))))
    await asyncio.sleep(METRIC_WAIT_S)  # let the engines' stats loops catch up
    hits = sum(e.counters()[1] - s[1] for e, s in zip(engines, start, strict=True))
    agreement.counter_check = (int(hits), agreement.usage_sum)
    records.sort(key=lambda r: r.seq)
    return records, agreement


async def send_stream(http: httpx.AsyncClient, base_url: str, req: Request, rec: Record,
                      t0: float, marks: dict[str, float] | None = None) -> int | None:
    """POST ``req`` streaming; fills ``rec`` from the start headers and the usage chunk;
    returns the engine's ``cached_tokens`` from that chunk (None if absent). ``marks`` gets
    the perf_counter instants "sent", "headers" and "first" (the first chunk)."""
    path, body = request_body(req, "tiny")
    body.update(stream=True, stream_options={"include_usage": True})
    start = time.perf_counter()
    marks = {} if marks is None else marks
    marks["sent"] = start
    engine_cached: int | None = None
    try:
        async with http.stream("POST", base_url.rstrip("/") + path, json=body) as resp:
            marks["headers"] = time.perf_counter()
            rec.status = resp.status_code
            h = resp.headers
            rec.served_by, rec.route = h.get(HEADER_SERVED_BY), h.get(HEADER_ROUTE)
            rec.expected_cached_tokens = _int(h.get(HEADER_EXPECTED))
            rec.cached_tokens = _int(h.get(HEADER_CACHED))
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            async for line in resp.aiter_lines():
                data = line[5:].strip() if line.startswith("data:") else ""
                if not data or data == "[DONE]":
                    continue
                marks.setdefault("first", time.perf_counter())
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = str(chunk["error"])[:300]
                usage = chunk.get("usage") or {}
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens")
                    rec.completion_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    engine_cached = details.get("cached_tokens")
    except (httpx.HTTPError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    end = time.perf_counter()
    rec.latency_s, rec.t_done = end - start, end - t0
    return engine_cached if isinstance(engine_cached, int) else None


async def _served_delta(rec: Record, engines: Sequence[VllmServer], node_engine: dict[str, int],
                        before: Sequence[tuple[float, float]]) -> int | None:
    """The served engine's prefix-cache hit delta for this request (None: not readable)."""
    idx = node_engine.get(rec.served_by or "")
    if idx is None:
        return None
    deadline = time.monotonic() + METRIC_WAIT_S
    while True:  # the counters are updated by the engine's stats loop: wait until they moved
        queries, hits = engines[idx].counters()
        dq, dh = queries - before[idx][0], hits - before[idx][1]
        if dq >= (rec.prompt_tokens or 1) or time.monotonic() > deadline:
            return int(dh) if dq > 0 else None
        await asyncio.sleep(0.02)


# ---------------------------------------------------------------------------- report
def markdown(result: dict[str, Any]) -> str:
    lines = [f"vLLM {result['vllm_version']} (CPU build, `vllm-cpu`), {result['date']}; "
             f"model: random-weight Qwen2 `tiny` preset ({result['model']}); "
             f"engine block size {result['block_size']}, {result['num_blocks']} KV blocks "
             f"per engine; {result['requests']} requests ({result['groups']} prefix groups, "
             f"mean {result['prompt_tokens_mean']:.0f} prompt tokens), "
             f"{result.get('concurrency', 1)} in flight (closed loop), entry "
             "round-robin over 2 nodes; policies back to back, caches reset between.", "",
             "| policy | index == engine | router == engine | hit rate (engine) | "
             "forwarded | mean latency | p99 latency | errors |",
             "|---|---|---|---|---|---|---|---|"]
    for p in result["policies"]:
        s, a = p["summary"], p["agreement"]
        share = "n/a" if a["share_equal"] is None else f"{100 * a['share_equal']:.1f} %"
        lines.append(
            f"| {p['policy']} | {share} ({a['equal']}/{a['requests']}) | "
            f"{a['router_equal']}/{a['requests']} | {_pct(s['actual_hit_rate'])} | "
            f"{_pct(s['forwarded_share'])} | {_ms(s['mean_latency_s'])} | "
            f"{_ms(s['p99_latency_s'])} | {s['errors']} |")
    checks = "; ".join(
        f"{p['policy']}: counters {c[0]}, usage {c[1]}" for p in result["policies"]
        if (c := p["agreement"].get("counter_hits_vs_usage_sum")) is not None)
    if str(result.get("concurrency", 1)) == "1":
        truth = ("\"engine\": the served engine's `vllm:prefix_cache_hits` delta for that "
                 "request (its usage `cached_tokens` agreed on "
                 + ", ".join(f"{p['agreement']['usage_equals_metrics']}/"
                             f"{p['agreement']['requests']}" for p in result["policies"])
                 + " requests)")
    else:
        truth = ("\"engine\": the served engine's usage `prompt_tokens_details.cached_tokens` "
                 "for that request (with requests overlapping, the counters are checked in "
                 "total only)")
    lines += [*_classified_lines(result), "", truth + f"; run totals of cached tokens ({checks}). "
              "\"index\": the serving node's KV-event index match when it "
              "accepted the request (`x-radixmesh-cached-tokens` of a stream). \"router\": the "
              "estimate the entry node routed on (`x-radixmesh-expected-cached-tokens`; "
              "`none` claims 0 by design). Hit rate: engine-cached / prompt tokens. "
              "Latency: whole stream, client side."]
    return "\n".join(lines) + "\n"


def _classified_lines(result: dict[str, Any]) -> list[str]:
    return [f"- {p['policy']}: mismatches {c['counts']} (events {c['events']}, seq gaps "
            f"{c['seq_gaps']})" for p in result["policies"]
            if (c := p["agreement"].get("classified"))]


def _int(value: str | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f} %"


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{1000 * v:.0f} ms"


# ---------------------------------------------------------------------------- model
def save_model_dir(path: Path, seed: int) -> Path:
    """The ``tiny`` preset as a model directory vLLM loads, its vocabulary cut to the
    tokenizer's: vLLM samples from the whole LM head (the built-in engine masks the ids above
    the tokenizer's), and a peer rejects forwarded ids the tokenizer does not have."""
    import dataclasses

    from tokenizers import Tokenizer

    from radixmesh.engine.presets import build_random_model, get_preset
    from radixmesh.engine.testing import save_random_model_dir

    root = save_random_model_dir(path, "tiny", seed=seed)
    vocab = Tokenizer.from_file(str(root / "tokenizer.json")).get_vocab_size(
        with_added_tokens=True)
    model = build_random_model(dataclasses.replace(get_preset("tiny"), vocab_size=vocab), seed)
    model.config.eos_token_id = 0  # <|endoftext|>, as save_random_model_dir sets it
    model.save_pretrained(root)
    return root


# ---------------------------------------------------------------------------- main
@contextlib.contextmanager
def engines_running(args: argparse.Namespace, model_dir: Path, out: Path
                    ) -> Iterator[list[VllmServer]]:
    ports = free_ports(6)
    engines = [VllmServer(f"vllm{i}", args.vllm_python, model_dir, ports[3 * i],
                          ports[3 * i + 1], ports[3 * i + 2], args.block_size, args.num_blocks,
                          out / f"vllm{i}.log", threads=args.engine_threads)
               for i in range(2)]
    try:
        for e in engines:
            e.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        for e in engines:
            e.wait_ready(deadline)
        yield engines
    finally:
        for e in engines:
            e.stop()


def node_options(policy: str, args: argparse.Namespace, model_dir: Path) -> dict[str, object]:
    return {"policy": policy, "log_level": "warning", "gossip_interval": args.gossip_interval,
            "engine": "vllm", "tokenizer": str(model_dir), "model": "tiny",
            "engine_block_size": args.block_size, "threads": 1}


def run_policy(policy: str, args: argparse.Namespace, model_dir: Path, out: Path,
               engines: Sequence[VllmServer], reqs: Sequence[Request]
               ) -> tuple[list[Record], Agreement]:
    from radixmesh.runtime.cluster import LocalCluster

    for e in engines:
        e.reset_prefix_cache()
    per_node = {i: {"engine_url": e.url, "kv_events": f"tcp://*:{e.events_port}",
                    "kv_replay": f"tcp://*:{e.replay_port}"} for i, e in enumerate(engines)}
    cluster = LocalCluster(2, node_options(policy, args, model_dir), per_node=per_node,
                           log_dir=out / f"nodes-{policy}", python=sys.executable)
    with cluster:
        _wait_subscribed(cluster)
        node_engine = {nid: i for i, nid in enumerate(cluster.node_ids)}
        return asyncio.run(replay_run(policy, cluster.urls, cluster.node_ids, engines,
                                      node_engine, reqs, args.concurrency,
                                      prompt_ids(model_dir)))


def prompt_ids(model_dir: Path) -> Callable[[Request], list[int]]:
    """A request's prompt token ids as the node makes them (``runtime/app.py``)."""
    from radixmesh.engine.tokenizers import HFTokenizer

    tok = HFTokenizer(model_dir)

    def ids(req: Request) -> list[int]:
        if req.prompt is not None:
            return list(tok.encode(req.prompt))
        assert req.messages is not None
        return list(tok.apply_chat_template([{"role": m.role, "content": m.content}
                                             for m in req.messages]))
    return ids


def classify_run(agreement: Agreement, capture: Capture, block_size: int, since: float) -> None:
    """Every mismatch of one policy's run classified against the engines' own streams, from
    ``since`` on (the caches' reset before the run: its nodes start with empty indexes, and a
    reset need not publish AllBlocksCleared, so earlier batches would haunt the replay)."""
    mesh = _mesh_block(block_size)
    streams = [stream_of([f for f in t if f[0] >= since], mesh, block_size)
               for t in capture.timed]
    tally = classify_all(streams, agreement.seen)
    agreement.verdicts = [v.kind for v in tally.verdicts]
    agreement.mismatch = tally.to_json() | {
        "events": [len(st.events) for st in streams],
        "messages": [len(t) for t in capture.timed],
        "seq_gaps": [_seq_gaps(t) for t in capture.timed]}


def _mesh_block(engine_block_size: int) -> int:
    """The nodes' block size in front of engines of ``engine_block_size``."""
    from radixmesh.core.blocks import DEFAULT_BLOCK_SIZE
    from radixmesh.engine.http_engine import mesh_block_size

    return mesh_block_size(DEFAULT_BLOCK_SIZE, engine_block_size)


def _seq_gaps(timed: Sequence[tuple[float, Sequence[bytes]]]) -> int:
    """Messages the bench's own subscriber missed (seq jumps), which would blur its replay."""
    seqs = [int.from_bytes(f[1], "big") for _, f in timed if len(f) == 3]
    return sum(1 for a, b in itertools.pairwise(seqs) if b != a + 1)


def _wait_subscribed(cluster: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = [cluster.mesh(i).get("kv_events") or {} for i in range(len(cluster))]
        if all(s.get("connected") for s in states):
            return
        time.sleep(0.2)
    raise RuntimeError("the nodes' KV-event subscribers did not connect")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m radixmesh.bench.vllm_check",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    ap.add_argument("--out", default="runs/vllm-check")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--scale", type=float, default=0.5, help="prompt length scale")
    ap.add_argument("--block-size", type=int, default=128, help="vLLM's (CPU: multiple of 32)")
    ap.add_argument("--num-blocks", type=int, default=48, help="KV blocks per engine")
    ap.add_argument("--engine-threads", type=int, default=1)
    ap.add_argument("--gossip-interval", default="0.1")
    ap.add_argument("--policies", default="cost,none")
    ap.add_argument("--concurrency", default="1",
                    help="requests in flight; a list (4,16) runs every policy at each")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--capture", metavar="DIR", help="save raw event batches as fixtures")
    ap.add_argument("--capture-run", metavar="DIR",
                    help="save engine 0's timed batches and requests of each run with their "
                    "verdicts (the mismatch classifier's fixtures)")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = save_model_dir(out / "model", args.seed)
    reqs = build_workload(args.requests, args.groups, args.scale, args.seed)
    version = vllm_version(args.vllm_python)
    print(f"vllm {version}; {len(reqs)} requests; starting 2 engines (logs in {out})",
          flush=True)
    levels = [int(c) for c in str(args.concurrency).split(",")]
    t_start = time.perf_counter()
    with engines_running(args, model_dir, out) as engines:
        print(f"engines ready in {time.perf_counter() - t_start:.0f} s", flush=True)
        # both publishers, each in its own seq order, as the nodes see them (fixtures: #0)
        capture = Capture([f"tcp://127.0.0.1:{e.events_port}" for e in engines])
        try:
            policies = [run_one(level, policy, args, model_dir, out, engines, reqs, capture,
                                len(levels) > 1)
                        for level, policy in itertools.product(levels,
                                                               args.policies.split(","))]
            if args.capture:
                _save_capture(args, capture, engines, version)
        finally:
            capture.close()
    result = {"vllm_version": version, "date": time.strftime("%Y-%m-%d"),
              "model": "hidden 256, 4 layers, fp32", "block_size": args.block_size,
              "num_blocks": args.num_blocks, "requests": len(reqs), "groups": args.groups,
              "concurrency": ",".join(map(str, levels)),
              "prompt_tokens_mean": summarize_prompt_mean(policies), "policies": policies,
              "command": " ".join(["python -m radixmesh.bench.vllm_check",
                                   *(argv or sys.argv[1:])])}
    (out / "vllm_check.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    text = markdown(result)
    (out / "vllm_check.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


def run_one(level: int, policy: str, args: argparse.Namespace, model_dir: Path, out: Path,
            engines: Sequence[VllmServer], reqs: Sequence[Request], capture: Capture,
            several: bool) -> dict[str, Any]:
    """One policy at one concurrency: records, agreement, classified mismatches."""
    args.concurrency = level
    t0 = time.perf_counter()
    records, agreement = run_policy(policy, args, model_dir, out, engines, reqs)
    classify_run(agreement, capture, args.block_size, since=t0)
    name = f"{policy}-c{level}" if several else policy
    if args.capture_run:
        n = save_run_fixture(Path(args.capture_run) / f"run-{name}.msgpack",
                             [f for f in capture.timed[0] if f[0] >= t0], agreement,
                             _mesh_block(args.block_size), args.block_size)
        print(f"captured {n} requests of a {level}-in-flight run into {args.capture_run}",
              flush=True)
    with open(out / f"records-{name}.jsonl", "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r.to_json()) + "\n")
    summary = summarize(records)
    print(f"{name}: {len(records)} requests in {time.perf_counter() - t0:.0f} s; "
          f"predicted==actual {agreement.equal}/{agreement.requests}; "
          f"hit rate {_pct(summary['actual_hit_rate'])}; "
          f"mean {_ms(summary['mean_latency_s'])}, p99 {_ms(summary['p99_latency_s'])}",
          flush=True)
    return {"policy": name, "summary": summary, "agreement": agreement.to_json()}


def _save_capture(args: argparse.Namespace, capture: Capture, engines: Sequence[VllmServer],
                  version: str) -> None:
    replay = capture.replay(f"tcp://127.0.0.1:{engines[0].replay_port}")
    live = pick_fixture_frames(capture.frames)
    save_fixtures(Path(args.capture), live, replay[:2] + replay[-1:],
                  {"vllm": version, "block_size": args.block_size,
                   "captured": time.strftime("%Y-%m-%d"),
                   "live_messages_seen": len(capture.frames)})
    print(f"captured {len(live)} live + {min(len(replay), 3)} replay messages into "
          f"{args.capture}", flush=True)


def summarize_prompt_mean(policies: Sequence[dict[str, Any]]) -> float:
    values = [p["summary"].get("prompt_tokens_mean") or 0.0 for p in policies]
    return sum(values) / len(values) if values else 0.0


if __name__ == "__main__":
    raise SystemExit(main())
