"""The capacities a benchmark folder measured, by rate key: ``capacity.json``.

A later batch of the same point (bench/runner.py) is timed at the first one's capacity; this
file keeps it as soon as it is measured, so that a sweep resumed after an interruption
(``--resume``) is timed at the rate its first attempt measured.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(slots=True)
class Capacities:
    """The capacities measured for an output folder, by rate key (a canonical JSON string of
    what makes runs meet one rate: bench/runner.py ``rate_id``), kept in ``path``."""

    path: Path
    known: dict[str, float] = field(default_factory=dict)
    # the file's entries when this run first wrote it (another attempt's points): written back
    # beside ours, never used to time this run (only ``--resume`` does: ``load``)
    kept: dict[str, float] | None = None

    @classmethod
    def load(cls, path: Path) -> Capacities:
        """What ``path`` holds (nothing if it does not exist); ValueError if it is not
        ours."""
        if not path.exists():
            return cls(path)
        try:
            entries = json.loads(path.read_text(encoding="utf-8"))["capacities"]
            known = {json.dumps(e["rate_key"], sort_keys=True): float(e["capacity_rps"])
                     for e in entries}  # fmt: skip
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a capacity file ({exc})") from exc
        return cls(path, known)

    def get(self, key: str) -> float | None:
        return self.known.get(key)

    def remember(self, key: str, capacity_rps: float) -> None:
        """The first capacity measured for ``key`` stays; the file is rewritten, keeping the
        keys it held that this run did not measure (another attempt's points)."""
        self.known.setdefault(key, capacity_rps)
        if self.kept is None:  # read once
            try:
                self.kept = Capacities.load(self.path).known
            except ValueError:
                self.kept = {}  # not ours: replaced
        both = {**self.kept, **self.known}
        entries = [{"rate_key": json.loads(k), "capacity_rps": v} for k, v in both.items()]
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"capacities": entries}, indent=2) + "\n", encoding="utf-8")
        tmp.replace(self.path)
