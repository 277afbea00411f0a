"""Results of fault-injection runs: one :class:`FaultResult` per fault, JSON and Markdown.

``requests`` counts client requests sent while the fault was active (or around it);
``failures`` the client-visible ones (transport error, timeout, non-200); ``lost`` the requests
whose answer was lost *or wrong* (no answer, or greedy text different from the reference);
``passed`` whether the fault's own criterion held (e.g. views converged in time). ``figures``
holds the measurements behind ``notes``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class FaultResult:
    fault: str
    requests: int = 0
    failures: int = 0
    lost: int = 0
    passed: bool = True
    notes: list[str] = field(default_factory=list)
    figures: dict[str, object] = field(default_factory=dict)
    checks: list[dict[str, object]] = field(default_factory=list)
    command: str = ""

    def note(self, text: str) -> None:
        self.notes.append(text)

    def check(self, condition: bool, text: str, timing: bool = False) -> bool:
        """Record a criterion; a false one fails the fault and is noted as such.

        ``timing`` marks criteria about elapsed time (noisy on a shared machine): the CLI
        reports them, the CI tests assert only the others (:attr:`functional_ok`).
        """
        self.checks.append({"what": text, "ok": bool(condition), "timing": timing})
        if not condition:
            self.passed = False
            self.notes.append("FAILED: " + text)
        return condition

    @property
    def functional_ok(self) -> bool:
        return all(bool(c["ok"]) for c in self.checks if not c["timing"])

    def failed_checks(self) -> list[str]:
        return [str(c["what"]) for c in self.checks if not c["ok"]]

    def to_json(self) -> dict[str, object]:
        return {
            "fault": self.fault,
            "requests": self.requests,
            "failures": self.failures,
            "lost": self.lost,
            "passed": self.passed,
            "notes": "; ".join(self.notes),
            "checks": self.checks,
            "figures": self.figures,
        }


def to_json(results: Sequence[FaultResult], extra: dict[str, object] | None = None) -> str:
    doc: dict[str, object] = {"faults": [r.to_json() for r in results]}
    if extra:
        doc.update(extra)
    return json.dumps(doc, indent=2, default=str)


def to_markdown(results: Sequence[FaultResult]) -> str:
    lines = [
        "| fault | requests | failures | lost | passed | notes |",
        "| --- | ---: | ---: | ---: | :---: | --- |",
    ]
    for r in results:
        notes = "; ".join(r.notes).replace("|", "\\|")
        mark = "yes" if r.passed else "NO"
        lines.append(
            f"| {r.fault} | {r.requests} | {r.failures} | {r.lost} | {mark} | {notes} |"
        )
    return "\n".join(lines)


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a process from /proc (Linux); None if unavailable."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
