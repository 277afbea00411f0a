"""Markdown cells and tables for the benchmark report (``bench/report.py``, ``bench/targets.py``):
numbers as text (``—`` where nothing was measured), a paired ratio with its interval, a
verdict, and a table that leaves out columns with nothing in them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from radixmesh.bench.folder import Ratio, Row


def f3(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}"


EMPTY_CELLS = frozenset({"", "—", "—; —"})


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table; a column with nothing in any row (a policy that did not run) is left
    out."""
    rows = [list(r) for r in rows]
    keep = [i for i in range(len(header))
            if not rows or any(r[i] not in EMPTY_CELLS for r in rows)]
    header = [header[i] for i in keep]
    rows = [[r[i] for i in keep] for r in rows]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def get(run: Row | None, key: str) -> Any:
    return None if run is None else run.get(key)


def verdict(ok: bool | None) -> str:
    return "n/a (not run)" if ok is None else ("**met**" if ok else "**missed**")


def stall_text(x: tuple[float, int] | None) -> str:
    return "—" if x is None else f"{x[0]:.3f} ({x[1]})"


def rtext(r: Ratio | None) -> str:
    """A paired ratio with its 95 % bootstrap interval."""
    return "—" if r is None else r.text()


def served_text(run: Row) -> str:
    served = run.get("served_per_node") or run.get("served_by") or {}
    text = " / ".join(f"{n} {c}" for n, c in served.items()) or "—"
    return text + (" **stranded: " + ", ".join(run["stranded_nodes"]) + "**"
                   if run.get("stranded") else "")  # fmt: skip
