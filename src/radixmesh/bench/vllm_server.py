"""The real vLLM CPU server of the real-engine checks: its argv, process group, readiness,
prefix-cache counters, and the random-weight model directory it loads.

Theory of operation
-------------------
vLLM lives in its own virtual environment (``.venv-vllm``: it pins other versions than
radixmesh); radixmesh only talks to it over HTTP and ZMQ. ``VllmServer`` starts one
``vllm.entrypoints.openai.api_server`` in its own process group (``stop`` ends the group:
SIGTERM, SIGKILL after a timeout) with KV events on a ZMQ PUB and a replay ROUTER
(``kv_events_config``), the prompt-token details on, a fixed number of KV blocks, and
``VLLM_SERVER_DEV_MODE=1`` for ``POST /reset_prefix_cache``. ``counters`` reads the
``vllm:prefix_cache_queries`` / ``_hits`` counters of ``/metrics``. ``save_model_dir`` writes
the ``tiny`` preset (random weights) as a directory vLLM loads. Used by ``bench/vllm_check.py``,
``bench/vllm_tenants.py``, ``chaos/engines.py``, ``chaos/kv_socket.py`` and
``bench/llamacpp_check.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from radixmesh.runtime.metrics import parse_samples, sample_sum

DEFAULT_VLLM_PYTHON = ".venv-vllm/bin/python"
READY_TIMEOUT_S = 600.0


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



def stop_group(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
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
    buffer_steps: int = 10_000  # batches its replay socket keeps
    extra_env: dict[str, str] = field(default_factory=dict)
    cpus: str | None = None  # taskset list ("0"): the engine and its OpenMP threads bound there
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
                "--kv-events-config", kv_events_config(self.events_port, self.replay_port,
                                                     self.buffer_steps),
                *self.extra_args]

    def launch_argv(self) -> list[str]:
        """``argv`` as launched: pinned, the API server and its engine core (children
        inherit the affinity) run on ``cpus``, OpenMP's threads bound there too (vLLM CPU's
        ``VLLM_CPU_OMP_THREADS_BIND``, set by :meth:`start`)."""
        return ["taskset", "-c", self.cpus, *self.argv()] if self.cpus else self.argv()

    def start(self) -> None:
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_CPU_OMP_THREADS_BIND=self.cpus or "nobind",
                   OMP_NUM_THREADS=str(self.threads), VLLM_SERVER_DEV_MODE="1",
                   PYTHONUNBUFFERED="1", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1",
                   **self.extra_env)
        argv = self.launch_argv()
        with open(self.log_path, "ab") as log:
            log.write(f"--- {' '.join(argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
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
            stop_group(self.proc)


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



def wait_subscribed(cluster: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = [cluster.mesh(i).get("kv_events") or {} for i in range(len(cluster))]
        if all(s.get("connected") for s in states):
            return
        time.sleep(0.2)
    raise RuntimeError("the nodes' KV-event subscribers did not connect")


def vllm_parser(module: str, doc: str | None, out: str) -> argparse.ArgumentParser:
    """The real-vLLM checks' command line: ``--vllm-python`` (the vLLM venv's interpreter)
    and ``--out`` (the run folder, default ``out``); each check adds its own flags."""
    ap = argparse.ArgumentParser(prog=f"python -m {module}",
                                 description=(doc or "").split("\n\n")[0])
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    ap.add_argument("--out", default=out)
    return ap
