"""``serve --launch "CMD ..."``: the external engine as a child process of the node.

Theory of operation
-------------------
:meth:`EngineProcess.start_and_wait` runs before the node is built (the node asks the engine
for its model name, so the engine must answer first): the command line is split with
``shlex`` (no shell), started in a new session (its own process group, so stopping it reaches
the engine's own children too, e.g. vLLM's EngineCore) with ``PR_SET_PDEATHSIG`` = SIGTERM (a
node killed with SIGKILL still takes the engine down with it), its output appended to a log
file (by default, the node's own output); then ``GET <engine-url>/v1/models`` is polled until
it answers 200. The engine exiting first, or the ready timeout, is a start-up error that
carries the log's tail.

Attached to the service (``service.attachments``), it is stopped with the node: SIGTERM to the
process group, SIGKILL after ``stop_timeout_s``. ``/mesh`` shows ``engine_launch`` (pid,
running, return code, command); ``/metrics`` has ``engine_launch_running``. No orphans: the
engine goes when the node stops normally (the attachment), when the node process dies (the
death signal), and when start-up fails (stopped before the error is raised).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from radixmesh.child_process import die_with_parent

READY_POLL_S = 0.25


class EngineProcess:
    """The engine child of one node (see the module docstring)."""

    name = "engine_launch"

    def __init__(self, command: str, ready_url: str, *, log_path: str | Path | None = None,
                 ready_timeout_s: float = 600.0, stop_timeout_s: float = 15.0) -> None:
        self.argv = shlex.split(command)
        if not self.argv:
            raise ValueError("--launch needs a command line")
        self.command = command
        self.ready_url = ready_url.rstrip("/") + "/v1/models"
        self.log_path = Path(log_path) if log_path else None
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    # ------------------------------------------------------------------------- lifecycle
    def start_and_wait(self) -> None:
        """Start the engine and return once it answers; raises ``ValueError`` (engine exited,
        or not ready in time: it is stopped then) or ``OSError`` (command not startable)."""
        # no log file: the engine writes where the node does (its log), so a failed start
        # says why
        out = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=die_with_parent)
        finally:
            if out is not None:
                out.close()
        try:
            self._wait_ready()
        except BaseException:
            self.terminate()
            raise

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise ValueError(f"launched engine exited with {rc} before answering "
                                 f"{self.ready_url}{self._tail()}")
            with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(
                    self.ready_url, timeout=2) as resp:
                if resp.status == 200:
                    return
            if time.monotonic() > deadline:
                raise ValueError(f"launched engine not answering {self.ready_url} after "
                                 f"{self.ready_timeout_s:.0f} s{self._tail()}")
            time.sleep(READY_POLL_S)

    def _tail(self, lines: int = 15) -> str:
        if self.log_path is None:
            return ""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return "; its log ends:\n" + "\n".join(text) if text else ""

    def terminate(self) -> int | None:
        """SIGTERM the engine's process group, SIGKILL it after the timeout; its exit code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                proc.wait(5.0)
        self._signal(signal.SIGKILL)  # whatever of its group outlived it
        return proc.returncode

    def _signal(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    # ------------------------------------------------------------------- attachment
    async def start(self) -> None:
        """Already started (before the node was built)."""

    async def stop(self) -> None:
        await asyncio.to_thread(self.terminate)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def mesh_state(self) -> dict[str, object]:
        return {"pid": None if self.proc is None else self.proc.pid, "running": self.running,
                "returncode": None if self.proc is None else self.proc.returncode,
                "command": self.command}

    def metrics(self) -> dict[str, float]:
        return {"engine_launch_running": float(self.running)}
