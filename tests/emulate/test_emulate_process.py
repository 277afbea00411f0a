"""``radixmesh emulate`` as its own process, fronted by a node (``radixmesh serve --engine
vllm``) on loopback, as a node fronts a real vLLM: the start-up line says "emulated" and names
the profile; the node learns the engine's cache from its KV events alone, and for a request
sharing a cached prefix the cached tokens it predicted (``x-radixmesh-expected-cached-tokens``)
are what the engine reported (``usage.prompt_tokens_details.cached_tokens``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from radixmesh.runtime.cluster import free_ports

if TYPE_CHECKING:
    from conftest import Poll

START_S = 90.0
PREFIX = "You are a careful assistant. Answer the multiple choice question below. " * 3


def _start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "radixmesh.cli", *argv],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


@pytest.fixture
def mesh(tokenizer_dir: Path, tmp_path: Path, poll: Poll) -> Iterator[tuple[str, str, Path]]:
    """(node url, engine url, engine log): an emulated engine and a node in front of it."""
    node_port, port, kv, replay = free_ports(4)
    engine = _start(["emulate", "--profile", "h100-llama3-8b", "--port", str(port),
                     "--tokenizer", str(tokenizer_dir), "--time-scale", "0.2",
                     "--served-model-name", "emulated-llama",
                     "--kv-events", f"tcp://127.0.0.1:{kv}",
                     "--kv-replay", f"tcp://127.0.0.1:{replay}"], tmp_path / "engine.log")
    node = None
    try:
        engine_url = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=5.0, trust_env=False) as http:
            def engine_up() -> bool:
                assert engine.poll() is None, (tmp_path / "engine.log").read_text()
                try:
                    return http.get(engine_url + "/health").status_code == 200
                except httpx.HTTPError:
                    return False

            poll.until(engine_up, "the emulated engine", START_S, interval=0.1)
        node = _start(["serve", "--port", str(node_port), "--engine", "vllm",
                       "--engine-url", engine_url, "--tokenizer", str(tokenizer_dir),
                       "--kv-events", f"connect:tcp://127.0.0.1:{kv}",
                       "--kv-replay", f"tcp://127.0.0.1:{replay}",
                       "--drain-grace", "1", "--drain-linger", "0"], tmp_path / "node.log")
        yield f"http://127.0.0.1:{node_port}", engine_url, tmp_path / "engine.log"
    finally:
        if node is not None:
            _stop(node)
        _stop(engine)


def test_a_node_fronts_the_emulated_engine_with_an_exact_index(
        mesh: tuple[str, str, Path], poll: Poll) -> None:
    url, engine_url, engine_log = mesh
    with httpx.Client(timeout=30.0, trust_env=False) as http:
        def node_up() -> bool:
            try:
                return http.get(url + "/health").status_code == 200
            except httpx.HTTPError:
                return False

        poll.until(node_up, "the node", START_S, interval=0.1)
        line = engine_log.read_text().splitlines()[0]
        assert "EMULATED" in line and "h100-llama3-8b" in line
        card = http.get(engine_url + "/v1/models").json()["data"][0]
        assert card["id"] == "emulated-llama" and card["emulated"] is True

        def indexed() -> int:
            return int(http.get(url + "/mesh").json()["engine"]["indexed_tokens"])

        def ask(text: str) -> httpx.Response:
            resp = http.post(url + "/v1/completions", json={
                "model": "emulated-llama", "prompt": text, "max_tokens": 6})
            assert resp.status_code == 200, resp.text
            return resp

        def warmed_up() -> bool:  # past ZMQ's slow joiner: the first batch the node sees
            ask("a warm-up request, long enough for a whole block")  # makes it replay from 0
            return indexed() > 0

        poll.until(warmed_up, "the node indexing a KV event", 30, interval=0.1)
        before = indexed()
        ask(PREFIX + "Question 1: which is larger, 3 or 7?")
        poll.until(lambda: indexed() > before, "the first prompt's blocks in the node's index",
                   10, interval=0.1)
        resp = ask(PREFIX + "Question 2: which is smaller, 3 or 7?")
        expected = int(resp.headers["x-radixmesh-expected-cached-tokens"])
        reported = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert expected == reported > 0
        metrics = http.get(engine_url + "/metrics").text
        assert "emulator_lag_seconds_total" in metrics and "vllm:prefix_cache_hits_total" in metrics
