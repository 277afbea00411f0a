"""Progress bars (tqdm): drawn on a terminal, silent otherwise."""

from __future__ import annotations

import io
import sys
from typing import TYPE_CHECKING

import pytest

from radixmesh import progress
from radixmesh.bench.progress import Progress

if TYPE_CHECKING:
    from conftest import Poll


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_nothing_is_written_when_not_a_terminal() -> None:
    out = io.StringIO()
    p = Progress("run-a", 3, stream=out)
    for ok in (True, False, True):
        p.update(0.25, ok)
    p.close()
    assert out.getvalue() == "" and not p.tty
    assert (p.done, p.errors) == (3, 1)


def test_a_bar_on_a_terminal_shows_counts_latency_and_errors() -> None:
    out = Terminal()
    p = Progress("run-a", 2, stream=out)
    p.update(0.1, True)
    p.update(0.3, False)
    p.close()
    text = out.getvalue()
    assert p.tty and "run-a" in text and "2/2" in text
    assert "mean 200 ms, errors 1" in text


def test_the_simulator_callback_and_the_timed_bar(
    monkeypatch: pytest.MonkeyPatch, poll: Poll
) -> None:
    out = Terminal()
    monkeypatch.setattr(sys, "stderr", out)
    cb = progress.counter("[sim] x")
    for done in (1000, 2000, 2500):
        cb(done, 2500)
    assert "2500/2500" in out.getvalue()
    with progress.timed(2.0, "soak", stream=out, tick_s=0.01) as b:
        poll.until(lambda: b.n > 0, "the timed bar to tick", 5)
    assert "soak" in out.getvalue()
