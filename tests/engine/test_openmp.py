"""``engine/openmp.release_thread_team``: the calling thread's OpenMP workers go away, and a
later parallel region on that thread still computes correctly (a new team)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from radixmesh.engine import openmp


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settled(expected: int, deadline_s: float = 5.0) -> int:
    """The process's thread count once it reaches ``expected`` (workers exit asynchronously),
    or whatever it is at the deadline."""
    end = time.monotonic() + deadline_s
    while _threads() != expected and time.monotonic() < end:
        time.sleep(0.01)
    return _threads()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_release_frees_the_callers_team_and_torch_still_works() -> None:
    if openmp._runtime() is None:
        pytest.skip("torch's OpenMP runtime is not loaded or lacks omp_pause_resource_all")
    before_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    a = torch.randn(512, 512)
    expected = a @ a
    seen: dict[str, object] = {}

    def body() -> None:  # a fresh thread: its team is its own, nobody else's
        base = _threads()
        torch.mm(a, a)  # a parallel region: this thread's team of 2 (one new worker)
        seen["with_team"] = _threads()
        seen["released"] = openmp.release_thread_team()
        seen["after"] = _settled(base)
        seen["base"] = base
        seen["again"] = torch.allclose(a @ a, expected)  # a new team, same result

    try:
        worker = threading.Thread(target=body)
        worker.start()
        worker.join(30)
    finally:
        torch.set_num_threads(before_threads)
    assert seen["released"] is True
    assert seen["with_team"] == seen["base"] + 1  # type: ignore[operator]
    assert seen["after"] == seen["base"]
    assert seen["again"] is True


def test_release_without_a_runtime_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(openmp, "_runtime", lambda: None)
    assert openmp.release_thread_team() is False
