"""``serve --launch``: the node starts the engine (``radixmesh emulate``) as its child and takes
it down with it, whether it stops normally (SIGTERM) or is killed (SIGKILL); a bad command is a
start-up error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from radixmesh.runtime.cluster import free_ports
from radixmesh.runtime.launch import EngineProcess

if TYPE_CHECKING:
    from conftest import Poll

START_S = 90.0
GONE_S = 20.0


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie has exited (its parent may not reap it here)


def _fake_cmd(port: int, kv: int, replay: int, tokenizer: Path) -> str:
    # the one fake vLLM, as a process; it knows the node's tokenizer, as a real vLLM does
    return (f"{sys.executable} -m radixmesh.cli emulate --profile h100-llama3-8b "
            f"--time-scale 0 --served-model-name fake-model --port {port} "
            f"--kv-events tcp://127.0.0.1:{kv} --kv-replay tcp://127.0.0.1:{replay} "
            f"--tokenizer {tokenizer}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_the_launched_engine_serves_and_goes_with_the_node(
    tokenizer_dir: Path, sig: int, poll: Poll
) -> None:
    node_port, port, kv, replay = free_ports(4)
    argv = [sys.executable, "-m", "radixmesh.cli", "serve", "--port", str(node_port),
            "--engine", "vllm", "--engine-url", f"http://127.0.0.1:{port}",
            "--kv-events", f"tcp://*:{kv}", "--kv-replay", f"tcp://*:{replay}",
            "--tokenizer", str(tokenizer_dir), "--drain-grace", "1", "--drain-linger", "0",
            "--launch", _fake_cmd(port, kv, replay, tokenizer_dir)]
    node = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{node_port}"
    pid = None
    try:
        with httpx.Client(timeout=10.0, trust_env=False) as http:
            def up() -> bool:
                assert node.poll() is None, f"the node exited with {node.returncode}"
                try:
                    return http.get(url + "/health").status_code == 200
                except httpx.HTTPError:
                    return False

            poll.until(up, "the node with its launched engine", START_S)
            launch = http.get(url + "/mesh").json()["engine_launch"]
            pid = launch["pid"]
            assert launch["running"] and _alive(pid)
            resp = http.post(url + "/v1/completions", json={
                "model": "fake-model", "prompt": "hello launched engine", "max_tokens": 4})
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == 4
            # a level, rendered as radixmesh_engine_launch_running (a counter, with _total,
            # until runtime/metrics.py lists it among its gauges)
            metrics = http.get(url + "/metrics").text.splitlines()
            assert any(line.split(" ")[0].startswith("radixmesh_engine_launch_running")
                       and line.endswith(" 1.0") for line in metrics)
        node.send_signal(sig)
        node.wait(GONE_S)
        poll.until(lambda: not _alive(pid), "the engine to go with the node", GONE_S)
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait(5)
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_an_engine_that_exits_at_once_is_a_start_up_error_with_its_log(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    proc = EngineProcess(f"{sys.executable} -c \"print('no such model'); raise SystemExit(3)\"",
                         f"http://127.0.0.1:{port}", log_path=tmp_path / "engine.log",
                         ready_timeout_s=30)
    with pytest.raises(ValueError, match=r"(?s)exited with 3.*no such model"):
        proc.start_and_wait()
    assert not proc.running and proc.mesh_state()["returncode"] == 3


def test_an_engine_that_never_answers_is_stopped_at_the_timeout() -> None:
    (port,) = free_ports(1)  # the engine under test: it sleeps instead of answering
    proc = EngineProcess(f"{sys.executable} -c \"import time; time.sleep(60)\"",
                         f"http://127.0.0.1:{port}", ready_timeout_s=1.0, stop_timeout_s=2.0)
    with pytest.raises(ValueError, match="not answering"):
        proc.start_and_wait()
    assert proc.proc is not None and not _alive(proc.proc.pid)


def test_launch_needs_an_external_engine() -> None:
    from radixmesh.runtime.config import ServeConfig

    with pytest.raises(ValueError, match="--launch"):
        ServeConfig(launch="vllm serve m")
    with pytest.raises(ValueError, match="command"):
        EngineProcess("   ", "http://127.0.0.1:1")
