"""A bench run's nodes' decision logs joined to its records: what the entry node's router saw
of the node that served each request (``scripts/ttft-error.py``, ``scripts/ttft-learn.py``).

``radixmesh bench`` saves every node's log beside a run's records (``decisions/<run>.jsonl``);
a record names its entry node and that node's request number (``x-radixmesh-request``), and a
request re-ranked after a refusal has several rankings, of which the last one chose the node
that served it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

Rankings = dict[tuple[str, int], dict[str, Any]]


def last_rankings(folder: Path, run: str) -> Rankings:
    """(entry node, request number) -> the last ranking of that request in ``run``'s
    decision logs (none when the folder has no logs)."""
    path = folder / "decisions" / f"{run}.jsonl"
    last: Rankings = {}
    if not path.exists():
        return last
    for line in path.read_text().splitlines():
        d = json.loads(line) if line.strip() else {}
        if d.get("kind") == "route":
            last[(d["node"], d["request"])] = d  # in order: a re-ranking replaces the first
    return last


def served_view(rankings: Rankings, rec: Mapping[str, Any]) -> dict[str, Any] | None:
    """The node that served ``rec`` as its entry node's router saw it (the ranking's
    ``considered`` entry), or None (no ranking of it, or its server not among them)."""
    entry, request = rec.get("entry_node"), rec.get("request")
    d = None if entry is None or request is None else rankings.get((str(entry), int(request)))
    if d is None:
        return None
    return next((c for c in d["considered"] if c["node_id"] == rec.get("served_by")), None)
