"""The progress bar of one benchmark run (``bench``, ``demo``): requests done, mean latency,
errors — a tqdm bar on stderr, off when stderr is not a terminal (see :mod:`radixmesh.progress`).
"""

from __future__ import annotations

from typing import TextIO

from radixmesh.progress import bar


class Progress:
    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.done = 0
        self.errors = 0
        self.lat_sum = 0.0
        self._bar = bar(total, label, unit="req", stream=stream)
        self._drawn = not self._bar.disable

    @property
    def tty(self) -> bool:
        """Whether the bar is drawn (stderr is a terminal)."""
        return self._drawn

    @tty.setter
    def tty(self, value: bool) -> None:
        """Kept for callers that turned the hand-written bar into plain lines when several
        runs advance together: tqdm gives each open bar its own line, so nothing to change —
        only ``False`` on a non-terminal is meaningful, and that is already the case."""

    def update(self, latency_s: float, ok: bool) -> None:
        self.done += 1
        self.errors += 0 if ok else 1
        self.lat_sum += latency_s
        if self._drawn:
            mean_ms = 1000 * self.lat_sum / self.done
            self._bar.set_postfix_str(f"mean {mean_ms:.0f} ms, errors {self.errors}",
                                      refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
