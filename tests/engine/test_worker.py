"""EngineWorker: FIFO on one thread, observable depth, errors and cancellation (counted)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pytest

from radixmesh.engine.base import GenerateRequest, GenerateResult, TokenCallback
from radixmesh.engine.factory import build_engine
from radixmesh.engine.worker import EngineWorker
from radixmesh.testing import VirtualClock

if TYPE_CHECKING:
    from conftest import Poll


class GatedEngine:
    """Blocks in generate until released, recording the order requests ran in."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.gate = threading.Event()
        self.started = threading.Event()

    def generate(
        self, req: GenerateRequest, on_token: TokenCallback | None = None
    ) -> GenerateResult:
        self.started.set()
        self.gate.wait(10)
        if req.request_id == "bad":
            raise ValueError("bad request")
        self.order.append(req.request_id)
        if on_token is not None:
            on_token(1)
        return GenerateResult(req.request_id, [1], "length", len(req.prompt_ids), 0, 0.0, 0.0, 0.0)

    def match(self, prompt_ids: Sequence[int]) -> int:
        return 0


def _req(rid: str) -> GenerateRequest:
    return GenerateRequest(rid, (1, 2, 3))


def test_fifo_order_depth_and_queue_time() -> None:
    engine = GatedEngine()
    clock = VirtualClock()
    worker = EngineWorker(engine, clock=clock)  # type: ignore[arg-type]
    try:
        futures = [worker.submit(_req(str(i))) for i in range(4)]  # all at t = 0
        assert engine.started.wait(5)  # "0" started at t = 0
        assert worker.queue_depth == 4 and worker.inflight == 1
        clock.now = 2.5  # then 2.5 s pass before the gate opens: 1..3 cannot start earlier
        engine.gate.set()
        results = [f.result(5) for f in futures]
        assert engine.order == ["0", "1", "2", "3"]
        assert [r.request_id for r in results] == engine.order
        # queue_s is submit to start: none for the first, the gate's 2.5 s for the others
        assert [r.queue_s for r in results] == [0.0, 2.5, 2.5, 2.5]
        assert worker.queue_depth == 0 and worker.inflight == 0
    finally:
        worker.close()


def test_errors_reach_the_future_and_the_worker_goes_on() -> None:
    engine = GatedEngine()
    engine.gate.set()
    worker = EngineWorker(engine)  # type: ignore[arg-type]
    try:
        bad, good = worker.submit(_req("bad")), worker.submit(_req("ok"))
        with pytest.raises(ValueError, match="bad request"):
            bad.result(5)
        assert good.result(5).request_id == "ok"
        assert worker.failed == 1 and worker.completed == 1
    finally:
        worker.close()


def test_cancelled_before_start_is_skipped_and_close_cancels_waiting(poll: Poll) -> None:
    engine = GatedEngine()
    worker = EngineWorker(engine)  # type: ignore[arg-type]
    running = worker.submit(_req("a"))
    assert engine.started.wait(5)
    skipped, waiting = worker.submit(_req("b")), worker.submit(_req("c"))
    assert skipped.cancel()
    assert (worker.waiting, worker.cancelled, worker.queue_depth) == (1, 1, 2)  # at once
    closer = threading.Thread(target=worker.close)
    closer.start()
    poll.until(lambda: worker.queue_depth == 1, "close() to cancel the waiting request", 5)
    engine.gate.set()
    closer.join(5)
    assert running.result(5).request_id == "a"
    assert waiting.cancelled()
    assert engine.order == ["a"]
    assert (worker.cancelled, worker.completed, worker.queue_depth) == (2, 1, 0)
    with pytest.raises(RuntimeError):
        worker.submit(_req("d"))


def test_streams_tokens_from_the_real_engine() -> None:
    worker = EngineWorker(build_engine("micro", cache_tokens=512))
    try:
        seen: list[int] = []
        prompt = tuple(range(40))
        first = worker.submit(GenerateRequest("x", prompt), on_token=seen.append).result(30)
        second = worker.submit(GenerateRequest("y", prompt)).result(30)
        assert seen == first.output_ids == second.output_ids
        assert (first.cached_tokens, second.cached_tokens) == (0, 32)  # whole 16-token blocks
    finally:
        worker.close()


def test_match_and_gossip_reads_are_safe_while_requests_run() -> None:
    engine = build_engine("micro", cache_tokens=300)
    worker = EngineWorker(engine)
    try:
        prompts = [tuple((i * 7 + j) % 256 for j in range(60 + i)) for i in range(12)]
        futures = [worker.submit(GenerateRequest(str(i), p)) for i, p in enumerate(prompts)]
        seen_hashes: set[int] = set()
        while not all(f.done() for f in futures):  # the node's event loop does exactly this
            for p in prompts:
                assert 0 <= engine.match(p) < len(p)
            assert engine.usage().tokens <= 300
            seen_hashes.update(engine.drain_cache_delta().added)
            engine.cache_hashes()
        assert all(f.result(30).output_ids for f in futures)
        seen_hashes.update(engine.drain_cache_delta().added)
        assert engine.cache_hashes() <= seen_hashes
    finally:
        worker.close()
