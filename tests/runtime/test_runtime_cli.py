"""``radixmesh cluster`` as a user runs it: URLs printed when ready, ``none`` never forwards,
SIGTERM stops every node, and killing the launcher with -9 leaves no orphans."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from conftest import Poll

pytestmark = pytest.mark.slow

HOP = {"x-radixmesh-hop": "1"}
PREFIX = "The following are multiple choice questions (with answers) about botany.\n\n" * 8


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers kill(0): check its state
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def _read_until_ready(proc: subprocess.Popen[str], poll: Poll, timeout: float = 180.0
                      ) -> list[str]:
    lines: list[str] = []
    stdout = proc.stdout
    assert stdout is not None

    def ready() -> bool:  # one line of the launcher's output per check
        line = stdout.readline()
        if not line:
            raise AssertionError("launcher exited early:\n" + "".join(lines))
        lines.append(line)
        return "healthy and gossiping" in line

    poll.until(ready, "the cluster's banner", timeout, interval=0.0)
    return lines


def test_cluster_command_none_policy_never_forwards_and_stops_cleanly(poll: Poll) -> None:
    cmd = [sys.executable, "-m", "radixmesh.cli", "cluster", "--nodes", "2", "--base-port", "0",
           "--policy", "none", "--gossip-interval", "0.1", "--preset", "tiny"]  # byte tokens
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids: list[int] = []
    try:
        lines = _read_until_ready(proc, poll)
        nodes = re.findall(r"^(n\d)\s+(http://127\.0\.0\.1:\d+).*pid (\d+)\)", "".join(lines),
                           re.M)
        assert [n for n, _, _ in nodes] == ["n0", "n1"]
        urls = [u for _, u, _ in nodes]
        pids = [int(p) for _, _, p in nodes]
        body = {"model": "tiny", "prompt": PREFIX + "seed", "max_tokens": 2}
        httpx.post(urls[1] + "/v1/completions", json=body, headers=HOP, timeout=60)

        def learnt() -> bool:  # n0 learns that n1 holds the prefix ...
            peers = httpx.get(urls[0] + "/mesh").json()["peers"]
            return bool(peers) and peers[0]["view_blocks"] >= len(PREFIX) // 16

        poll.until(learnt, "n0 to learn n1's cache", 20)
        for k in range(4):  # ... and still never forwards under `none`
            body["prompt"] = PREFIX + f"question {k}"
            resp = httpx.post(urls[0] + "/v1/completions", json=body, timeout=60)
            assert resp.status_code == 200
            assert resp.headers["x-radixmesh-route"] == "local"
            assert resp.headers["x-radixmesh-served-by"] == "n0"
            assert resp.headers["x-radixmesh-expected-cached-tokens"] == "0"
        metrics = httpx.get(urls[0] + "/metrics").text
        assert "radixmesh_forward_attempts_total 0" in metrics
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        poll.until(lambda: all(_gone(p) for p in pids), "the nodes to exit after SIGTERM", 20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_killing_the_launcher_leaves_no_orphans(tmp_path: Path, poll: Poll) -> None:
    # Stand-in node processes (no model) keep this test fast; the launcher is the real one.
    # Their sleep, and the launcher's, only keep them alive until the test kills them.
    fake_python = tmp_path / "fake-python"
    fake_python.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(600)\n")
    fake_python.chmod(0o755)
    script = textwrap.dedent(f"""
        import sys, time
        from radixmesh.runtime.cluster import LocalCluster
        c = LocalCluster(3, python={str(fake_python)!r}, log_dir={str(tmp_path)!r})
        c.start(wait=False)
        print(" ".join(str(n.pid) for n in c.nodes), flush=True)
        time.sleep(600)
    """)
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                text=True)
    assert launcher.stdout is not None
    pids = [int(p) for p in launcher.stdout.readline().split()]
    assert len(pids) == 3 and not any(_gone(p) for p in pids)
    try:
        launcher.kill()  # kill -9: no chance to clean up
        launcher.wait()
        poll.until(lambda: all(_gone(p) for p in pids),
                   "the children of a SIGKILLed launcher to exit", 20)
    finally:
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
