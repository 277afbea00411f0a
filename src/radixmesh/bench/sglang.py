"""Centralized baselines: a gateway process in front of ``none`` nodes, and sglang-router 0.3.2.

:class:`Gateway` runs one gateway as a subprocess on 127.0.0.1 with the run's node URLs as
workers, waits until it reports every worker healthy, and stops it on ``close()``; its output
goes to a log file (never an unread pipe, which would stall a chatty gateway). The client sends
every request to ``url``. Two gateways use it: sglang-router 0.3.2 (:class:`SglangRouter`,
policy ``sglang``, optional extra ``radixmesh[sglang]``) and SMG 1.13
(:class:`radixmesh.bench.smg.Smg`, policy ``smg``), both with their ``cache_aware`` policy.

Known behaviour of sglang-router (GUIDE §4): it matches raw characters, routes to the best
match only above 30% shared, and with one sequential client sends every unmatched prompt to
the first worker; the runner therefore also offers it with concurrency.

The gateway→worker hop crosses the same emulated link as a mesh node's forward: with
``link_delay_s`` > 0 the workers are reached through :mod:`radixmesh.bench.linkproxy`, which
delays every chunk by the one-way delay each way (a gateway is one network hop from its
workers, as a peer is from the entry node); with regions (``links``) each worker by its own.
The relay is held (undelayed) while the gateway registers its workers and armed once it is
ready, before the run's first request.
"""

from __future__ import annotations

import importlib.util
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, ClassVar
from urllib.parse import urlsplit

import httpx

from radixmesh.runtime.cluster import free_ports

INSTALL_HINT = "sglang-router is not installed: pip install 'sglang-router==0.3.2'"
PORT_ATTEMPTS = 3  # starts with fresh ports when one was taken meanwhile


class PortTaken(RuntimeError):
    """The gateway exited because a port picked for it was taken before it bound it."""


class Gateway:
    """A running gateway process; subclasses give its name, Python package, launcher and
    readiness check. Both gateways take the same ``cache_aware`` command line."""

    name: ClassVar[str] = "gateway"
    install_hint: ClassVar[str] = ""
    package: ClassVar[str] = ""  # the importable package that must be installed
    launcher: ClassVar[tuple[str, ...]] = ()  # after ``python -m``
    extra_args: ClassVar[tuple[str, ...]] = ()
    # whether ``GET /v1/models`` names the workers' model (SMG does; sglang-router 0.3.2
    # answers ``"unknown"``): the bench then waits for it there (``client.wait_for_model``)
    lists_models: ClassVar[bool] = False
    # the gateway's own time constants, (flag, default in whole seconds): passed stretched by
    # the run's time scale, as the nodes' gossip intervals and timeouts are, so that the
    # gateway polls, times out and evicts as often, in the run's unscaled time, as it would
    # by default in real time (unstretched, a poll every 10 s at time scale 1,200 would read
    # its workers' queues every 8 ms of the run: fresher than any deployment of it)
    clocks: ClassVar[tuple[tuple[str, int], ...]] = ()

    def __init__(
        self,
        worker_urls: Sequence[str],
        startup_timeout_s: float = 60.0,
        log_path: str | Path | None = None,
        link_delay_s: float = 0.0,
        links: Sequence[tuple[float, float]] | None = None,
        time_scale: float = 1.0,
    ) -> None:
        if not self.available():
            raise RuntimeError(self.install_hint)
        self.workers = list(worker_urls)  # as the nodes know them (what the records name)
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.time_scale = time_scale
        # (both gateways default their metrics to 0.0.0.0:29000, which clashes: a port each)
        self.port, self.metrics_port = free_ports(2)
        if log_path is None:
            self._log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
        else:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
            self._log = Path(log_path).open("w+b")  # noqa: SIM115 (closed in close())
        self._relay: subprocess.Popen[bytes] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        try:
            routed = (self._start_relay(link_delay_s, startup_timeout_s, links)
                      if link_delay_s > 0 or links else self.workers)  # fmt: skip
            self._launch(routed, startup_timeout_s)
            self._arm_links()
        except BaseException:
            self.close()
            raise

    def _launch(self, routed: Sequence[str], timeout_s: float) -> None:
        """Start the gateway in front of ``routed`` and wait until it is ready."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self._proc = subprocess.Popen(
                self.command(self.port, routed), stdout=self._log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
            try:
                self._wait_ready(timeout_s)
                return
            except PortTaken:
                # the ports were free when picked, and something took one before the
                # gateway bound it (other clusters start at the same time): new ports
                if attempt == PORT_ATTEMPTS:
                    raise
                self.port, self.metrics_port = free_ports(2)

    def _start_relay(self, delay_s: float, timeout_s: float,
                     links: Sequence[tuple[float, float]] | None = None) -> list[str]:
        """Start the delaying relay in front of the workers (``links``: each worker's own
        (out, back) delays); the URLs the gateway uses."""
        targets = [urlsplit(u) for u in self.workers]
        if any(t.hostname is None or t.port is None for t in targets):
            raise ValueError(f"worker URLs need a host and a port: {self.workers}")
        if links is not None and len(links) != len(targets):
            raise ValueError("one (out, back) link per worker")
        cmd = [sys.executable, "-m", "radixmesh.bench.linkproxy", "--delay", repr(delay_s),
               "--hold"]
        for i, t in enumerate(targets):
            own = "" if links is None else f"={links[i][0]!r}/{links[i][1]!r}"
            cmd += ["--to", f"{t.hostname}:{t.port}{own}"]
        relay = self._relay = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        assert relay.stdout is not None
        ready = select.select([relay.stdout], [], [], timeout_s)[0]
        line = relay.stdout.readline().decode() if ready else ""
        words = line.split()
        if len(words) != len(targets) + 1 or words[0] != "READY":
            self._stop(relay)
            raise RuntimeError(f"the link relay did not start (said {line.strip()!r})")
        return [f"http://127.0.0.1:{port}" for port in words[1:]]

    def _arm_links(self) -> None:
        """The gateway has registered its workers over undelayed links (SMG's registration
        steps time out after 10 s, shorter than one round trip between regions at time scale
        300): from now on the relay emulates the link for every byte."""
        if self._relay is not None and self._relay.stdin is not None:
            self._relay.stdin.write(b"GO\n")
            self._relay.stdin.flush()

    @staticmethod
    def _stop(proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()

    @property
    def pids(self) -> dict[str, int | None]:
        """The gateway's process id and its relay's (bench/usage.py measures their CPU)."""
        return {"gateway": None if self._proc is None else self._proc.pid,
                "relay": None if self._relay is None else self._relay.pid}  # fmt: skip

    @property
    def url(self) -> str:
        """Where the client sends every request."""
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def available(cls) -> bool:
        return bool(cls.package) and importlib.util.find_spec(cls.package) is not None

    def command(self, port: int, workers: Sequence[str]) -> list[str]:
        return [
            sys.executable, "-m", *self.launcher,
            "--host", "127.0.0.1", "--port", str(port),
            "--policy", "cache_aware", "--worker-urls", *workers,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
            *self.extra_args, *self.clock_args(self.time_scale),
        ]  # fmt: skip

    @classmethod
    def clock_args(cls, time_scale: float) -> list[str]:
        """The gateway's time constants at their defaults, stretched by ``time_scale`` (whole
        seconds, as its flags take them)."""
        return [a for flag, default_s in cls.clocks
                for a in (flag, str(max(1, round(default_s * time_scale))))]  # fmt: skip

    def ready(self) -> bool:
        """Whether the gateway can route to every worker: ``GET /readiness`` is 200 and counts
        them all healthy (both gateways answer it). ``GET /health`` is not enough: it is 200
        while the workers are still being registered, when requests get 503."""
        resp = httpx.get(self.url + "/readiness", timeout=1.0)
        if resp.status_code != 200:
            return False
        healthy = resp.json().get("healthy_workers")
        return isinstance(healthy, int) and healthy >= len(self.workers)

    def log_tail(self, lines: int = 3) -> str:
        """The last ``lines`` non-empty lines of the gateway's output (the error, usually)."""
        self._log.flush()
        self._log.seek(0)
        text = self._log.read().decode(errors="replace")
        return " | ".join([ln.strip() for ln in text.splitlines() if ln.strip()][-lines:])[-400:]

    def _wait_ready(self, timeout_s: float) -> None:
        proc = self._proc
        assert proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = self.log_tail()
                error = PortTaken if "Address already in use" in tail else RuntimeError
                raise error(f"{self.name} exited with {proc.returncode}: {tail}")
            try:
                if self.ready():
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} did not become ready within {timeout_s:.0f}s")

    def close(self) -> None:
        if self._proc is not None:
            self._stop(self._proc)
        if self._relay is not None:
            self._stop(self._relay)
        self._log.close()


class SglangRouter(Gateway):
    """``python -m sglang_router.launch_router --policy cache_aware`` (sglang-router 0.3.2)."""

    name = "sglang-router"
    install_hint = INSTALL_HINT
    package = "sglang_router"
    launcher = ("sglang_router.launch_router",)
