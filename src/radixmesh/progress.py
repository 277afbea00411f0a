"""Progress bars of the long-running commands (``bench``, ``demo``, ``sim``, ``chaos``): tqdm.

A bar is drawn on stderr only when stderr is a terminal (tqdm's ``disable=None``): piped into a
log or run under CI, a command prints its results and nothing else. Several bars open at once
(``bench`` runs of one batch advance together) get a line each — tqdm places them.

A top-level module (not under ``bench``) so that ``sim`` can use it too (tests/test_layering.py).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from tqdm import tqdm  # type: ignore[import-untyped]


def bar(total: float | None, desc: str, unit: str = "it", stream: TextIO | None = None,
        **kw: Any) -> tqdm[Any]:
    """A tqdm bar on ``stream`` (stderr), off unless that is a terminal."""
    return tqdm(total=total, desc=desc, unit=unit, file=stream or sys.stderr, disable=None,
                dynamic_ncols=True, **kw)


def counter(desc: str, unit: str = "req") -> Callable[[int, int], None]:
    """A ``(done, total)`` callback (the simulator's progress hook) that drives one bar; the
    bar closes when ``done`` reaches ``total``."""
    state: dict[str, tqdm[Any]] = {}

    def update(done: int, total: int) -> None:
        b = state.get("bar")
        if b is None:
            b = state["bar"] = bar(total, desc, unit)
        b.update(done - b.n)
        if done >= total:
            b.close()
            state.pop("bar")

    return update


@contextlib.contextmanager
def timed(seconds: float, desc: str, stream: TextIO | None = None,
          tick_s: float = 1.0) -> Iterator[tqdm[Any]]:
    """A bar over wall-clock time for work planned to last ``seconds`` (a soak): advanced by a
    background thread while the body runs, closed when it ends (early or late)."""
    b = bar(round(seconds), desc, unit="s", stream=stream,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f}s{postfix}")
    stop = threading.Event()
    t0 = time.monotonic()

    def tick() -> None:
        while not stop.wait(tick_s):
            b.update(min(time.monotonic() - t0, b.total) - b.n)

    thread = threading.Thread(target=tick, name="radixmesh-progress", daemon=True)
    if not b.disable:
        thread.start()
    try:
        yield b
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()
        b.close()
