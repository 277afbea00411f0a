"""What a run's nodes and processes did besides answering: load over time and CPU used.

Theory of operation
-------------------
Per-node load over time (:func:`load_over_time`), from the run's own records, so it costs the
nodes nothing and is exact for what the clients saw: the run (unscaled time, warm-up included:
the nodes served it) is cut into ``WINDOWS`` equal windows; for each window and node

``in_flight``  the mean number of requests the node was serving (the time each request's
               ``[t_send, t_done]`` overlaps the window, summed, / the window): client-side,
               so a request counts from when it was sent, network and queue included;
``served``     requests the node finished in that window.

The table goes to ``load/<run>.csv`` in the run folder (``t_s,node,in_flight,served``, one line
per window and node); the summary keeps the window and each node's peak ``in_flight``.

CPU (:class:`CpuMeter`): the processes the bench started — every node, its descendants (an
emulated mesh's engines, which each node launches), a gateway and its delaying relay — read from
``/proc/<pid>/stat`` (user + system time, clock ticks) when the measured requests start and when
they end. Each group is reported as CPU seconds and as cores (CPU seconds / wall seconds) over
that span, in real (not time-scaled) time: an emulated mesh at ``--time-scale S`` spreads the
same work over S times the wall time, so its cores are S times lower than at full speed.
Where ``/proc`` is missing (not Linux) the figures are absent.
"""

from __future__ import annotations

import csv
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from radixmesh.results.records import Record

WINDOWS = 60  # windows of a run's load-over-time table
PROC = Path("/proc")


# ----------------------------------------------------------------------------- load over time
def load_over_time(
    records: Sequence[Record], node_ids: Sequence[str], windows: int = WINDOWS
) -> tuple[float, list[tuple[float, str, float, int]]]:
    """(window seconds, rows ``(window start, node, mean in flight, served)``) of the records
    that a node served, ``windows`` windows over the run; (0, []) without any."""
    served = [r for r in records if r.served_by is not None and r.t_done > r.t_send]
    if not served:
        return 0.0, []
    start = min(r.t_send for r in served)
    span = max(r.t_done for r in served) - start
    width = span / windows if span > 0 else 1.0
    busy = {(w, n): 0.0 for w in range(windows) for n in node_ids}
    done = dict.fromkeys(busy, 0)
    for r in served:
        node = r.served_by or ""
        a, b = r.t_send - start, r.t_done - start
        last = min(windows - 1, int(b / width))
        done[(last, node)] = done.get((last, node), 0) + 1
        for w in range(min(last, int(a / width)), last + 1):
            overlap = min(b, (w + 1) * width) - max(a, w * width)
            busy[(w, node)] = busy.get((w, node), 0.0) + max(0.0, overlap)
    rows = [(start + w * width, n, busy[(w, n)] / width, done.get((w, n), 0))
            for (w, n) in sorted(busy)]  # fmt: skip
    return width, rows


def write_load(path: Path, records: Sequence[Record], node_ids: Sequence[str]
               ) -> dict[str, Any] | None:
    """Write ``path`` (CSV, see the module doc); the summary's part: the file, the window and
    each node's peak mean in flight. None when no node served anything."""
    width, rows = load_over_time(records, node_ids)
    if not rows:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as fh:
        out = csv.writer(fh)
        out.writerow(["t_s", "node", "in_flight", "served"])
        out.writerows((f"{t:.3f}", n, f"{x:.3f}", k) for t, n, x, k in rows)
    peak: dict[str, float] = {}
    for _, node, x, _ in rows:
        peak[node] = max(peak.get(node, 0.0), x)
    return {"file": str(path), "window_s": width,
            "peak_in_flight": {n: round(x, 3) for n, x in sorted(peak.items())}}  # fmt: skip


# ----------------------------------------------------------------------------- CPU
def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far; None if it is gone or no /proc."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # after "pid (comm) ": state is fields[0]
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """Every living descendant of ``pid`` (from /proc's parent links)."""
    parent: dict[int, int] = {}
    for entry in PROC.glob("[0-9]*"):
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue
        parent[int(entry.name)] = int(text[text.rfind(")") + 2:].split()[1])
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += kids
        todo += kids
    return found


class CpuMeter:
    """CPU seconds of groups of processes between :meth:`start` and :meth:`stop`.

    ``groups`` maps a label (``n0``, ``gateway``) to the pid the bench started; each label's
    descendants (read at :meth:`start`) are reported as ``<label>/children``."""

    def __init__(self, groups: Mapping[str, int | None]) -> None:
        self.groups = {k: v for k, v in groups.items() if v is not None}
        self._pids: dict[str, list[int]] = {}
        self._before: dict[int, float] = {}
        self._t0 = 0.0
        self.result: dict[str, Any] | None = None

    def start(self) -> None:
        if not PROC.is_dir():
            return
        for label, pid in self.groups.items():
            self._pids[label] = [pid]
            if kids := descendants(pid):
                self._pids[f"{label}/children"] = kids
        self._before = {p: s for ps in self._pids.values() for p in ps
                        if (s := cpu_seconds(p)) is not None}  # fmt: skip
        self._t0 = time.monotonic()

    def stop(self) -> dict[str, Any] | None:
        """The figures (also kept as ``result``); None if never started or no /proc."""
        if not self._pids:
            return None
        wall = time.monotonic() - self._t0
        used: dict[str, float] = {}
        for label, pids in self._pids.items():
            total = 0.0
            for p in pids:
                now, then = cpu_seconds(p), self._before.get(p)
                if now is not None and then is not None:
                    total += now - then
            used[label] = total
        self.result = cpu_figures(used, wall)
        return self.result


def cpu_figures(used: Mapping[str, float], wall_s: float) -> dict[str, Any]:
    """Per label and per kind (nodes, their children = emulated engines, gateway, relay):
    CPU seconds and cores (CPU seconds / wall seconds)."""
    kinds: dict[str, float] = {}
    for label, s in used.items():
        kind = ("children" if label.endswith("/children")
                else label if label in ("gateway", "relay") else "nodes")  # fmt: skip
        kinds[kind] = kinds.get(kind, 0.0) + s
    cores = (lambda s: round(s / wall_s, 4) if wall_s > 0 else None)  # noqa: E731
    return {"wall_s": round(wall_s, 3),
            "cpu_s": {k: round(v, 3) for k, v in sorted(used.items())},
            "by_kind": {k: {"cpu_s": round(v, 3), "cores": cores(v)}
                        for k, v in sorted(kinds.items())}}  # fmt: skip
