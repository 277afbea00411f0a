"""A one-line progress bar on stderr (no dependency); plain lines when not a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self.errors = 0
        self.lat_sum = 0.0
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._start = time.monotonic()
        self._last_pct = -1

    def update(self, latency_s: float, ok: bool) -> None:
        self.done += 1
        self.errors += 0 if ok else 1
        self.lat_sum += latency_s
        pct = 100 * self.done // self.total
        if self.tty:
            self._draw()
        elif pct // 10 != self._last_pct // 10 or self.done == self.total:
            self._last_pct = pct
            self.stream.write(self._line() + "\n")
            self.stream.flush()

    def _line(self) -> str:
        mean = self.lat_sum / self.done if self.done else 0.0
        el = time.monotonic() - self._start
        return (
            f"{self.label}: {self.done}/{self.total} ({100 * self.done // self.total}%) "
            f"mean {mean * 1000:.0f} ms, errors {self.errors}, {el:.0f}s"
        )

    def _draw(self) -> None:
        width = 24
        filled = width * self.done // self.total
        bar = "#" * filled + "-" * (width - filled)
        self.stream.write(f"\r[{bar}] {self._line()}\x1b[K")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
