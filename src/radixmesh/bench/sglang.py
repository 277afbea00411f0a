"""The centralized baseline: sglang-router 0.3.2 (``cache_aware``) in front of ``none`` nodes.

Optional extra (``pip install 'radixmesh[sglang]'``). The gateway is started as a subprocess
on 127.0.0.1 with the run's node URLs as workers; the client sends every request to it. Known
behaviour (GUIDE §4): it matches raw characters, routes to the best match only above 30%
shared, and with one sequential client sends every unmatched prompt to the first worker; the
runner therefore also offers it with concurrency. The router→worker hop gets no emulated delay
(that favours the baseline slightly at larger Δcomm).
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import httpx

INSTALL_HINT = "sglang-router is not installed: pip install 'sglang-router==0.3.2'"


def available() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SglangRouter:
    """A running ``sglang_router.launch_router`` process; ``close()`` stops it."""

    def __init__(self, worker_urls: Sequence[str], startup_timeout_s: float = 60.0) -> None:
        if not available():
            raise RuntimeError(INSTALL_HINT)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "sglang_router.launch_router",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--policy", "cache_aware", "--worker-urls", *worker_urls,
        ]  # fmt: skip
        self._proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        try:
            self._wait_ready(startup_timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                raise RuntimeError(
                    f"sglang-router exited with {self._proc.returncode}: {err[-800:]}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"sglang-router did not become healthy within {timeout_s:.0f}s")

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=5)
        if self._proc.stderr:
            self._proc.stderr.close()
