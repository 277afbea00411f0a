"""``make vllm-emulated``: the emulated engine against the real vLLM CPU it was calibrated from,
on one trace.

Theory of operation
-------------------
::

    vLLM CPU (bench/vllm_server.py: tiny random-weight Qwen2, block 128, 48 KV blocks, 1 thread)
        radixmesh calibrate --engine-url URL ... --profile-out OUT/vllm-cpu-tiny.calibrated.toml
    radixmesh emulate of that profile without its admission_s: the same prefill probe;
        admission_s = vLLM's TTFT intercept - the emulator's (what vLLM spends before a
        request's first step beyond what the emulator's own HTTP path spends), written to
        OUT/vllm-cpu-tiny.toml (the calibration stays as it was: closing it again gives the
        same profile)
    per --concurrency level: POST /reset_prefix_cache, the trace on vLLM (closed loop); then
        the same trace on a fresh ``radixmesh emulate --profile OUT/vllm-cpu-tiny.toml
        --tokenizer DIR --served-model-name tiny``; stop vLLM at the end

Real and emulated take turns level by level, so that each pair meets the same load on a shared
machine (``os.getloadavg()`` is written beside each level). Run it under ``nice -n -10`` (every
process it starts inherits that) when other work shares the cores.

The trace: ``--requests`` prefix-sharing completions (``bench/vllm_replay.build_workload``,
``--max-tokens`` each), streamed straight to the engine (no node: the engines are compared,
not the routing). Per request: TTFT (first content chunk), end-to-end latency, the engine's
cached tokens and completion tokens. Per level: each engine's median and p90 of both, and the
per-request ratio emulated ÷ real (median, and its 10th-90th percentiles); hit rates. Written to
``OUT/vllm_emulated.json`` and ``.md``. With ``--profile FILE`` it skips the calibration and
emulates that profile (a shipped one: ``src/radixmesh/profiles/vllm-cpu-tiny.toml``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from radixmesh.bench.engine_calibrate import prefill_points
from radixmesh.bench.profilefit import fit_prefill
from radixmesh.bench.vllm_replay import build_workload, send_stream
from radixmesh.bench.vllm_server import (
    READY_TIMEOUT_S,
    VllmServer,
    save_model_dir,
    stop_group,
    vllm_parser,
    vllm_version,
)
from radixmesh.core.profile import Profile, dumps
from radixmesh.results.records import Record
from radixmesh.runtime.cluster import free_ports
from radixmesh.workload.request import Request

PROFILE = "vllm-cpu-tiny.toml"  # the closed profile, in the output folder
CALIBRATE = ("--lengths", "128,512,1024,2048", "--fractions", "0,0.5", "--repeats", "5",
             "--batches", "1,4", "--decode-tokens", "32")
# vLLM 0.32's CPU defaults for the OpenAI server (vllm/engine/arg_utils.py,
# _set_default_max_num_seqs_and_batched_tokens_args: is_cpu -> 128 seqs, 2048 tokens)
SHAPE = ("--max-running", "128", "--step-tokens", "2048", "--context-length", "4096")


async def run_trace(url: str, reqs: Sequence[Request], concurrency: int
                    ) -> list[dict[str, Any]]:
    """The trace, ``concurrency`` in flight (closed loop, in order); one row per request."""
    rows: dict[int, dict[str, Any]] = {}
    queue = list(enumerate(reqs))[::-1]

    async def worker(http: httpx.AsyncClient) -> None:
        while queue:
            i, req = queue.pop()
            rec = Record(run="emulated", policy="none", seq=i, id=req.id, group=req.group,
                         entry=0, entry_node="engine", t_send=0.0)
            marks: dict[str, float] = {}
            cached = await send_stream(http, url, req, rec, time.perf_counter(), marks)
            rows[i] = {"id": req.id, "ok": rec.ok, "error": rec.error,
                       "ttft_s": marks.get("first", marks["sent"] + rec.latency_s)
                       - marks["sent"], "latency_s": rec.latency_s,
                       "prompt_tokens": rec.prompt_tokens, "cached_tokens": cached,
                       "completion_tokens": rec.completion_tokens}

    async with httpx.AsyncClient(timeout=300.0, trust_env=False) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return [rows[i] for i in sorted(rows)]


def _q(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else float("nan")


def compare(real: Sequence[dict[str, Any]], emu: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Distributions side by side and per-request ratios (requests both answered)."""
    pairs = [(r, e) for r, e in zip(real, emu, strict=True) if r["ok"] and e["ok"]]
    out: dict[str, Any] = {"requests": len(real), "paired": len(pairs)}
    for key in ("ttft_s", "latency_s"):
        rv, ev = [r[key] for r, _ in pairs], [e[key] for _, e in pairs]
        ratios = [e / r for r, e in zip(rv, ev, strict=True) if r > 0]
        out[key] = {"real_median": statistics.median(rv), "real_p90": _q(rv, 0.9),
                    "emulated_median": statistics.median(ev), "emulated_p90": _q(ev, 0.9),
                    "ratio_median": statistics.median(ratios), "ratio_p10": _q(ratios, 0.1),
                    "ratio_p90": _q(ratios, 0.9)}
    for name, rows in (("real", real), ("emulated", emu)):
        prompt = sum(r["prompt_tokens"] or 0 for r in rows)
        out[f"{name}_hit_rate"] = sum(r["cached_tokens"] or 0 for r in rows) / max(prompt, 1)
        out[f"{name}_completion_tokens"] = sum(r.get("completion_tokens") or 0 for r in rows)
    return out


def calibrate(engine: VllmServer, out: Path) -> tuple[Path, str]:
    """Fit a profile to the running engine; the file and the command. The profile follows
    vLLM's caching rules (``cache_rule = "vllm"``, no "pioneers first") and counts the KV
    blocks vLLM can use: all but the null block (vllm/v1/core/block_pool.py)."""
    path = out / "vllm-cpu-tiny.calibrated.toml"
    vocab = json.loads((engine.model_dir / "config.json").read_text())["vocab_size"]
    argv = [sys.executable, "-m", "radixmesh", "calibrate", "--engine-url", engine.url,
            "--served-model-name", "tiny", "--vocab-size", str(vocab), *CALIBRATE,
            "--kv-blocks", str(engine.num_blocks - 1),
            "--block-size", str(engine.block_size), *SHAPE, "--name", "vllm-cpu-tiny",
            "--hardware", "vLLM 0.32 CPU on a shared 2-core x86_64 VM, 1 OpenMP thread",
            "--profile-out", str(path)]
    subprocess.run(argv, check=True, timeout=1800)
    path.write_text(dumps(replace(Profile.load(path), cache_rule="vllm", prefix_aware=False)),
                    encoding="utf-8")
    return path, " ".join(["radixmesh", *argv[3:]])


@contextlib.contextmanager
def emulator(profile: Path, model_dir: Path, out: Path) -> Iterator[str]:
    """A ``radixmesh emulate`` process of ``profile`` with the model's tokenizer; its URL."""
    (port,) = free_ports(1)
    argv = [sys.executable, "-m", "radixmesh", "emulate", "--profile", str(profile),
            "--port", str(port), "--tokenizer", str(model_dir), "--served-model-name", "tiny"]
    with open(out / "emulate.log", "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        _wait_http(f"http://127.0.0.1:{port}/v1/models", proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_group(proc)


def close_admission(calibrated: Path, model_dir: Path, out: Path, vocab: int) -> Path:
    """Refit ``admission_s`` of the calibration at ``calibrated`` against the emulator's own
    HTTP path (the module docstring) into ``out / PROFILE``, its path. The calibration is
    left as it is: closing it again gives the same profile (but for the probe's noise)."""
    path = out / PROFILE
    if path.resolve() == calibrated.resolve():
        raise ValueError(f"{calibrated}: the calibration must not be {PROFILE}, which closing "
                         f"overwrites")
    prof = Profile.load(calibrated)
    a_real = intercept(prof)
    probe = out / "emulator-probe.toml"
    probe.write_text(dumps(closed(prof, a_real, None, [])), encoding="utf-8")
    lengths, repeats = CALIBRATE[1], int(CALIBRATE[5])
    with emulator(probe, model_dir, out) as url:
        points = asyncio.run(prefill_points(url, "tiny", lengths, repeats, 1, vocab))
    path.write_text(dumps(closed(prof, a_real, fit_prefill(points)[0], points)),
                    encoding="utf-8")
    return path


def intercept(calibrated: Profile) -> float:
    """The engine's TTFT at 0 tokens as its calibration (not yet closed) models it."""
    return calibrated.admission_s + calibrated.step_base_s + calibrated.prefill_seq_s


def closed(prof: Profile, a_real: float, a_emu: float | None,
           points: Sequence[tuple[int, float]]) -> Profile:
    """``prof`` with ``admission_s`` = ``a_real``, its engine's TTFT intercept
    (:func:`intercept` of its calibration), - ``a_emu``, the emulator's own intercept for
    ``prof`` without admission (measured at ``points``); None: without. Its own
    ``admission_s`` is not read: closing the result again changes nothing."""
    citations = {k: v for k, v in prof.citations.items() if k != "admission_s"}
    admission = 0.0 if a_emu is None else max(0.0, a_real - a_emu)
    if admission:
        citations["admission_s"] = (
            f"{prof.source}: vLLM's TTFT intercept a = {a_real * 1e3:.2f} ms - the emulator's "
            f"own (radixmesh emulate of this profile without admission_s, the same probe: "
            f"{', '.join(f'{n}: {s * 1e3:.2f} ms' for n, s in points)}) a = "
            f"{(a_emu or 0.0) * 1e3:.2f} ms")
    return replace(prof, admission_s=admission, citations=citations)


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the emulator exited (rc {proc.returncode})")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready in {timeout:.0f} s")


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"vLLM {doc['vllm']} CPU against `radixmesh emulate --profile "
             f"{doc['profile']}`, {doc['date']}; {doc['requests']} requests "
             f"(max_tokens {doc['max_tokens']}), straight to the engine.", "",
             "| in flight | metric | real median / p90 | emulated median / p90 | "
             "emulated ÷ real per request: median (p10–p90) |", "|---|---|---|---|---|"]
    for level, c in doc["levels"].items():
        for key, name in (("ttft_s", "TTFT"), ("latency_s", "end-to-end")):
            m = c[key]
            lines.append(f"| {level} | {name} | {1000 * m['real_median']:.0f} / "
                         f"{1000 * m['real_p90']:.0f} ms | {1000 * m['emulated_median']:.0f} / "
                         f"{1000 * m['emulated_p90']:.0f} ms | {m['ratio_median']:.2f} "
                         f"({m['ratio_p10']:.2f}–{m['ratio_p90']:.2f}) |")
        lines.append(f"| {level} | hit rate | {100 * c['real_hit_rate']:.1f} % | "
                     f"{100 * c['emulated_hit_rate']:.1f} % | load average "
                     f"{c['load'][0]:.1f} → {c['load'][1]:.1f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = vllm_parser("radixmesh.bench.vllm_emulated", __doc__, "runs/vllm-emulated")
    ap.add_argument("--profile", help="emulate this profile instead of calibrating one")
    ap.add_argument("--vllm-port", type=int, help="use the vLLM already serving on this port "
                    "(started with this bench's settings and the same --seed) instead")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def both_levels(args: argparse.Namespace, model_dir: Path, reqs: Sequence[Request],
                levels: Sequence[int], out: Path) -> tuple[Path, str, dict[int, Any]]:
    """The profile (calibrated, or ``--profile``), its command, and per level the trace's
    rows on vLLM and on the emulator, one after the other, with the load averages."""
    port, events, replay = free_ports(3)
    engine = VllmServer("vllm0", args.vllm_python, model_dir, port, events, replay, 128, 48,
                        out / "vllm0.log")
    if args.vllm_port:  # one already running (the same model directory and settings)
        engine.port = args.vllm_port
    rows: dict[int, Any] = {}
    try:
        if not args.vllm_port:
            engine.start()
        engine.wait_ready(time.monotonic() + READY_TIMEOUT_S)
        if args.profile:
            profile, command = Path(args.profile), "given"
        else:
            profile, command = calibrate(engine, out)
            vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
            profile = close_admission(profile, model_dir, out, vocab)
        for level in levels:
            engine.reset_prefix_cache()
            load = [os.getloadavg()[0]]
            real = asyncio.run(run_trace(engine.url, reqs, level))
            with emulator(profile, model_dir, out) as url:
                emu = asyncio.run(run_trace(url, reqs, level))
            rows[level] = {"real": real, "emulated": emu, "load": [*load, os.getloadavg()[0]]}
            print(f"{level} in flight: done", flush=True)
    finally:
        engine.stop()
    return profile, command, rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = save_model_dir(out / "model", args.seed)
    reqs = [dataclasses.replace(r, max_tokens=args.max_tokens)
            for r in build_workload(args.requests, 8, 0.5, args.seed)]
    levels = [int(x) for x in args.concurrency.split(",")]
    profile, command, rows = both_levels(args, model_dir, reqs, levels, out)
    doc = {"vllm": vllm_version(args.vllm_python), "date": time.strftime("%Y-%m-%d %H:%M"),
           "profile": profile.name, "calibrate": command, "requests": len(reqs),
           "max_tokens": args.max_tokens,
           "levels": {lvl: {**compare(rows[lvl]["real"], rows[lvl]["emulated"]),
                            "load": rows[lvl]["load"]} for lvl in levels},
           "rows": rows,
           "command": " ".join(["python -m radixmesh.bench.vllm_emulated",
                                *(argv or sys.argv[1:])])}
    (out / "vllm_emulated.json").write_text(json.dumps(doc, indent=2), encoding="utf-8")
    text = markdown(doc)
    (out / "vllm_emulated.md").write_text(text, encoding="utf-8")
    print(text)
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
