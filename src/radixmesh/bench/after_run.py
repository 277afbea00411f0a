"""What the runner does once a run's requests are in: read its nodes, judge whether it counts.

Theory of operation
-------------------
Before the run's cluster stops, the runner reads off its nodes what only they know: the cost
router's placement tags summed from their ``/metrics`` (:func:`placement_counts`), every kept
routing decision and verdict on a forward (``GET /mesh/decisions``, :func:`save_decisions`,
what scripts/why.py reads), and for an emulated mesh how far its engines fell behind their
profiles (:func:`engine_lag`). A node or engine that does not answer is skipped. After the
run, :func:`run_failure` says why it does not count (nothing sent, or more than
``MAX_LOST_SHARE`` of its requests dropped or failed): the bench then exits 1 saying so.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import httpx

from radixmesh.bench.spec import RunSpec
from radixmesh.core.router import Tag
from radixmesh.results.records import Record
from radixmesh.runtime.metrics import parse_samples, sample_sum
from radixmesh.workload.build import Drops

MAX_LOST_SHARE = 0.05  # a run that dropped or failed more of its requests than this failed
LAG_WARN_SHARE = 0.05  # emulated engines lagging more than this share of their busy time


class FinishedRun(Protocol):
    """What :func:`run_failure` reads of a run (``bench.runner.RunResult``)."""

    spec: RunSpec
    records: list[Record]
    drops: Drops
    interrupted: bool
    skipped: str | None


def _metrics(url: str) -> dict[str, float] | None:
    """A node's or engine's ``/metrics`` samples; None when it does not answer 200."""
    try:
        resp = httpx.get(url.rstrip("/") + "/metrics", timeout=5.0, trust_env=False)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:  # an error page is no answer (its counts would read 0)
        return None
    return parse_samples(resp.text)


def placement_counts(urls: Sequence[str]) -> dict[str, float] | None:
    """The cost router's placement tags (core/router.Tag: hit, first, replica, second_copy,
    unplaced, local_copy), summed over the cluster's nodes from their ``/metrics`` (each
    request counted once, by the node that decided it; warm-up requests included); None if
    no node answered."""
    total = {tag.value: 0.0 for tag in Tag}
    answered = False
    for url in urls:
        samples = _metrics(url)
        if samples is None:
            continue
        answered = True
        for tag in total:
            name = f"radixmesh_core_placement_{tag}"
            total[tag] += sample_sum(samples, name + "_total") or sample_sum(samples, name)
    return total if answered else None


def save_decisions(urls: Sequence[str], path: Path) -> int:
    """Every node's kept routing decisions and verdicts on forwards (``GET /mesh/decisions``,
    core/decisions.py), one JSON line each with its ``node`` and ``kind`` (``route`` or
    ``admission``), written to ``path`` (not written if there are none); how many were
    written. A node that does not answer is skipped."""
    lines = []
    for url in urls:
        try:
            resp = httpx.get(url + "/mesh/decisions", params={"limit": 1 << 30}, timeout=10.0,
                             trust_env=False)
            body = resp.json()
        except (httpx.HTTPError, ValueError):
            continue
        if resp.status_code != 200 or not isinstance(body, dict):
            continue
        node = body.get("node_id")
        for kind, key in (("route", "decisions"), ("admission", "admissions")):
            for d in body.get(key, []):
                lines.append(json.dumps({"node": node, "kind": kind} | d, separators=(",", ":")))
    if lines:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
    return len(lines)


def run_failure(res: FinishedRun) -> str | None:
    """Why a finished run does not count (None: it does): it sent no request, or more than
    ``MAX_LOST_SHARE`` of its candidate requests were dropped before sending (e.g. too long
    for the engine's context) or failed. An interrupted or skipped run says so elsewhere."""
    if res.interrupted or res.skipped:
        return None
    name = res.spec.name
    if not res.records:
        return f"{name}: no request was sent ({res.drops.text()})"
    dropped, examined = res.drops.total, res.drops.examined
    failed, sent = sum(not r.ok for r in res.records), len(res.records)
    if examined and dropped / examined > MAX_LOST_SHARE:
        return (f"{name}: {dropped} of {examined} candidate requests dropped "
                f"({res.drops.text()}), more than {100 * MAX_LOST_SHARE:g} %")
    if failed / sent > MAX_LOST_SHARE:
        return f"{name}: {failed} of {sent} requests failed, more than {100 * MAX_LOST_SHARE:g} %"
    return None


def engine_lag(urls: Sequence[str], run: str, log: Callable[[str], None]) -> dict[str, Any]:
    """How far a run's emulated engines fell behind their profiles: their lag summed against
    their busy time (``emulator_lag_seconds_total`` / ``emulator_busy_seconds_total``, wall
    seconds), and how many could not be asked; says so through ``log`` past
    ``LAG_WARN_SHARE``."""
    lag = busy = 0.0
    missing = 0
    for url in urls:
        samples = _metrics(url)
        if samples is None:
            missing += 1
            continue
        lag += sample_sum(samples, "emulator_lag_seconds_total")
        busy += sample_sum(samples, "emulator_busy_seconds_total")
    share = lag / busy if busy > 0 else None
    if share is not None and share > LAG_WARN_SHARE:
        log(f"{run}: the emulated engines lagged {100 * share:.1f} % of their busy time "
            "behind their profiles: raise --time-scale")
    return {"lag_s": lag, "busy_s": busy, "share": share, "engines_unread": missing}
