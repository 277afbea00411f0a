"""A benchmark (or simulator) output folder loaded: its runs and their records, with lookups.

``summary.json`` gives the runs, ``requests.jsonl`` their records. Lookups find the run of a
policy at one point of the sweep; comparisons are *paired*: a run against the ``none`` run of
the same workload over the requests both completed — the ``none`` run that ran beside it in
time (same batch) when there is one. Every ratio comes with a bootstrap interval
(``results.run_summary.ratio_interval``). The report's tables and figures read it.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from radixmesh.results.records import Record
from radixmesh.results.run_summary import Row, load_summary, ratio_interval

OPEN_LOOP = ("poisson", "trace")
STALL_S = 30.0  # no request legitimately takes this long here; longer = the machine froze


@dataclass(frozen=True, slots=True)
class Ratio:
    """A paired ratio, its bootstrap interval, how many requests, and whether the two runs
    ran at the same time (same batch) rather than one after the other."""

    value: float
    lo: float | None
    hi: float | None
    n: int
    same_time: bool

    def text(self) -> str:
        ci = "" if self.lo is None or self.hi is None else f" [{self.lo:.3f}, {self.hi:.3f}]"
        return f"{self.value:.3f}{ci}" + ("" if self.same_time else " (not paired in time)")


def same_time(a: Row, b: Row) -> bool:
    """Whether two runs ran paired in time: the same batch (or, in folders written before
    batches were recorded, the same lockstep key)."""
    if a.get("batch") or b.get("batch"):
        return a.get("batch") == b.get("batch")
    return bool(a.get("lockstep")) and a.get("lockstep") == b.get("lockstep")


def _cache_points(runs: Sequence[Row]) -> tuple[int, int | None]:
    """The cache budgets of the default point and of memory pressure (None: no pressure run).
    The paper sweep names its pressure batch (group ``pressure``), which is then known even
    in a folder holding nothing else (``--only pressure``): its runs must not stand in for the
    abundant-cache ones (no default point then: -1 matches no run). Otherwise, with two or
    more budgets, the smallest is the pressure and the largest the default."""
    named = {r["cache_tokens"] for r in runs if r.get("group") == "pressure"}
    if named:
        rest = [r["cache_tokens"] for r in runs if r.get("group") != "pressure"]
        return (max(rest) if rest else -1), min(named)
    caches = sorted({r["cache_tokens"] for r in runs})
    return (caches[-1] if caches else 0), (caches[0] if len(caches) > 1 else None)


class Results:
    """The runs of one benchmark folder and their records, with lookup helpers."""

    def __init__(self, runs: Sequence[Row], records: dict[str, list[Record]]) -> None:
        self.runs = [r for r in runs if not r.get("skipped") and r.get("requests")]
        self.skipped = [r for r in runs if r.get("skipped")]
        self.records = records
        self.abundant, self.pressure = _cache_points(self.runs)
        polls = Counter(r["gossip_interval_ms"] for r in self.runs)
        self.poll_ms = polls.most_common(1)[0][0] if polls else 500.0

    @classmethod
    def load(cls, out: Path) -> Results:
        summary = load_summary(out / "summary.json")
        records: dict[str, list[Record]] = defaultdict(list)
        path = out / "requests.jsonl"
        if path.exists():
            with path.open(encoding="utf-8") as fh:
                for line in fh:
                    if line.strip():
                        rec = Record.from_json(json.loads(line))
                        if not rec.warmup:  # sent, but not part of the figures
                            records[rec.run].append(rec)
        return cls(summary["runs"], dict(records))

    def find(
        self,
        policy: str,
        skew: str = "uniform",
        delay_ms: float = 2.0,
        gossip_ms: float | None = None,
        cache: int | None = None,
        concurrency: int = 1,
    ) -> Row | None:
        """The run of ``policy`` at this point; defaults: the sweep's usual Δpoll (the most
        common one) and the largest cache budget."""
        cache = self.abundant if cache is None else cache
        gossip_ms = self.poll_ms if gossip_ms is None else gossip_ms
        for r in self.runs:
            if (
                r["policy"] == policy
                and r["skew"] == skew
                and abs(r["net_delay_ms"] - delay_ms) < 1e-6
                and abs(r["gossip_interval_ms"] - gossip_ms) < 1e-6
                and r["cache_tokens"] == cache
                and r.get("concurrency", 1) == concurrency
                and not r.get("arrival_rate")
                and r.get("schedule") not in OPEN_LOOP
            ):
                return r
        return None

    def beside(self, run: Row, policy: str) -> Row | None:
        """``policy``'s run that ran paired in time with ``run`` (same batch), else one with
        the same lockstep key."""
        for field in ("batch", "lockstep"):
            key = run.get(field)
            for r in self.runs:
                if key and r.get(field) == key and r["policy"] == policy:
                    return r
        return None

    def find_with(self, run: Row, policy: str) -> Row | None:
        """``policy``'s run interleaved with ``run``, else the one at the same point."""
        if (r := self.beside(run, policy)) is not None:
            return r
        return self.find(policy, run["skew"], run["net_delay_ms"], run["gossip_interval_ms"],
                         run["cache_tokens"], run.get("concurrency", 1))  # fmt: skip

    def ok(self, run: Row) -> list[Record]:
        return [r for r in self.records.get(run["name"], []) if r.ok]

    def baseline(self, run: Row) -> Row | None:
        """The ``none`` run interleaved with ``run`` if any, else one with the same workload
        shape (delay and Δpoll do not matter to ``none``)."""
        if (r := self.beside(run, "none")) is not None:
            return r
        for r in self.runs:
            if (
                r["policy"] == "none"
                and r["skew"] == run["skew"]
                and r["cache_tokens"] == run["cache_tokens"]
                and r["nodes"] == run["nodes"]
                and r.get("concurrency", 1) == run.get("concurrency", 1)
                and r.get("arrival_rate") == run.get("arrival_rate")
                and r.get("schedule") == run.get("schedule")
            ):
                return r
        return None

    def pairs(self, run: Row, base: Row, field: str = "latency_s") -> list[tuple[float, float]]:
        """(``field`` in ``run``, in ``base``) of the requests both completed with it (a
        record's ``latency_s`` or ``ttft_s``), in ``run``'s request order."""
        theirs = {r.id: getattr(r, field) for r in self.ok(base)}
        mine = sorted(self.ok(run), key=lambda r: r.seq)
        return [(getattr(r, field), theirs[r.id]) for r in mine
                if theirs.get(r.id) is not None and getattr(r, field) is not None]

    def ratio_ci(self, run: Row | None, base: Row | None = None) -> Ratio | None:
        """Paired mean-latency ratio ``run`` / ``base`` (default: its ``none`` baseline) with
        its 95 % bootstrap interval and the number of paired requests."""
        base = base or (None if run is None else self.baseline(run))
        if run is None or base is None:
            return None
        pairs = self.pairs(run, base)
        den = sum(b for _, b in pairs)
        if not pairs or den <= 0:
            return None
        ci = ratio_interval(pairs)
        lo, hi = ci if ci is not None else (None, None)
        return Ratio(sum(a for a, _ in pairs) / den, lo, hi, len(pairs), same_time(run, base))

    def paired(self, run: Row) -> tuple[float, float, int] | None:
        """(run mean, none mean, n) over the requests both runs completed."""
        base = self.baseline(run)
        if base is None:
            return None
        mine = {r.id: r.latency_s for r in self.ok(run)}
        theirs = {r.id: r.latency_s for r in self.ok(base)}
        common = sorted(mine.keys() & theirs.keys())
        if not common:
            return None
        a = sum(mine[i] for i in common) / len(common)
        b = sum(theirs[i] for i in common) / len(common)
        return a, b, len(common)

    def ratio_without_stalls(self, run: Row | None) -> tuple[float, int] | None:
        """Paired mean ratio over requests that took < STALL_S in both runs, and how many were
        left out: a frozen machine (minutes for one request) must not decide a comparison."""
        base = None if run is None else self.baseline(run)
        if run is None or base is None:
            return None
        mine = {r.id: r.latency_s for r in self.ok(run)}
        theirs = {r.id: r.latency_s for r in self.ok(base)}
        common = mine.keys() & theirs.keys()
        kept = [i for i in common if mine[i] < STALL_S and theirs[i] < STALL_S]
        den = sum(theirs[i] for i in kept)
        return (sum(mine[i] for i in kept) / den, len(common) - len(kept)) if den > 0 else None

    def ratio(self, run: Row | None) -> float | None:
        if run is None:
            return None
        p = self.paired(run)
        return None if p is None or p[1] <= 0 else p[0] / p[1]
