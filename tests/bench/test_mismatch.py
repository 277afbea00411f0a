"""The mismatch classifier (bench/mismatch.py): timing vs index errors, on hand-made streams, a
property against an exact index, and the event batches captured from real vLLM at 4 in flight."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixmesh.bench.mismatch import EventStream, Seen, TimedBatch, classify, stream_of
from radixmesh.core.kv_events import EngineBlockRemoved, EngineBlockStored, KvBatch

B = 4  # engine block = mesh block in the hand-made streams
PROMPT = tuple(range(100, 113))  # 13 tokens: 3 whole blocks and one token
FIXTURE = Path(__file__).parent.parent / "fixtures" / "vllm_0_32_concurrency"


def store(k: int, n: int = 1) -> EngineBlockStored:
    """Blocks k .. k+n-1 of PROMPT, chained (engine hash of block j: j + 1)."""
    return EngineBlockStored(tuple(range(k + 1, k + n + 1)), k if k else None,
                             PROMPT[k * B:(k + n) * B], B)


def remove(k: int) -> EngineBlockRemoved:
    return EngineBlockRemoved((k + 1,))


def stream(*timed: tuple[float, object]) -> EventStream:
    return EventStream([TimedBatch(t, i, KvBatch(t, (ev,)))  # type: ignore[arg-type]
                        for i, (t, ev) in enumerate(timed)], B, B)


def seen(predicted: int, actual: int, first: float = 5.0) -> Seen:
    return Seen("r", PROMPT, predicted, actual, 1.0, 1.1, first)


def test_blocks_evicted_between_acceptance_and_scheduling_are_timing() -> None:
    s = stream((0.0, store(0, 2)), (2.0, remove(1)), (3.0, store(1, 2)))
    v = classify(s, seen(8, 4))
    assert (v.kind, v.replayed) == ("evicted", 4)


def test_blocks_inserted_by_a_request_scheduled_in_between_are_timing() -> None:
    s = stream((0.0, store(0)), (2.0, store(1)), (3.0, store(2)))
    v = classify(s, seen(4, 8))
    assert (v.kind, v.replayed) == ("inserted", 8)


def test_a_full_hit_without_its_own_store_is_judged_on_the_window() -> None:
    s = stream((0.0, store(0, 2)), (1.5, store(2)))  # the only store after acceptance: others'
    assert classify(s, seen(8, 12)).kind == "inserted"
    assert classify(s, seen(8, 12, first=0.9)).kind == "index_error"  # first token came first


def test_a_prediction_no_replay_point_gives_is_an_index_error() -> None:
    s = stream((0.0, store(0)), (3.0, store(1, 2)))
    v = classify(s, seen(8, 4))
    assert v.kind == "index_error" and "acceptance window" in v.why


def test_an_actual_count_the_stream_cannot_explain_is_an_index_error() -> None:
    s = stream((0.0, store(0)), (3.0, store(2)))  # own store at block 2, yet block 1 missing
    v = classify(s, seen(4, 8))
    assert v.kind == "index_error" and v.replayed == 4


def test_an_own_store_seen_after_the_first_token_is_the_bench_lagging() -> None:
    """The request's own first store (and the store it hit, just before it) reached the
    bench 0.8 s after its first token (a starved subscriber: run E's one unexplained ``none``
    mismatch had that signature): replayed up to that store, the stream explains it; past
    ``LAG_S`` it stays an index error."""
    late = stream((0.0, store(0)), (5.8, store(1)), (5.8, store(2)))
    v = classify(late, seen(4, 8))
    assert (v.kind, v.replayed, v.why) == ("lagged", 8, "own store found")
    too_late = stream((0.0, store(0)), (6.5, store(1)), (6.5, store(2)))
    assert classify(too_late, seen(4, 8)).kind == "index_error"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 2)), min_size=1, max_size=12),
       st.integers(0, 12), st.integers(0, 12))
def test_an_exact_index_never_makes_an_index_error(ops: list[tuple[bool, int]], at: int,
                                                  sched: int) -> None:
    """P read off the stream at acceptance, A off the stream when scheduled (just before the
    request's own store, appended there): whatever happened in between is timing."""
    events: list[object] = []
    for is_store, k in ops:
        events.append(store(k) if is_store else remove(k))
    at, sched = min(at, len(events)), min(max(sched, at), len(events))
    probe = EventStream([TimedBatch(float(i), i, KvBatch(0.0, (e,)))  # type: ignore[arg-type]
                         for i, e in enumerate(events)], B, B)
    p = probe.matches(PROMPT, at)[-1]
    a = probe.matches(PROMPT, sched)[-1]
    own = [store(a // B)] if a // B < 3 else []
    timed = [(float(i), e) for i, e in enumerate([*events[:sched], *own, *events[sched:]])]
    s = stream(*timed)
    v = classify(s, Seen("r", PROMPT, p, a, at - 0.5, at - 0.4, sched - 0.4), slack_s=0.0)
    assert v.kind == ("match" if p == a else "evicted" if a < p else "inserted")


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURE.glob("run-*.msgpack")))
def test_captured_vllm_batches_classify_as_the_real_run_did(name: str) -> None:
    """Batches of one real vLLM 0.32 engine at 4 or 16 in flight with the requests it served
    (``make vllm-concurrency``: ``--capture-run DIR``): the verdicts are the run's, timing
    mismatches among them."""
    doc = msgpack.unpackb((FIXTURE / name).read_bytes(), raw=False)
    assert any(r["class"] in ("evicted", "inserted", "lagged") for r in doc["requests"])
    s = stream_of([(t, f) for t, f in doc["frames"]], doc["block_size"],
                  doc["engine_block_size"])
    for r in doc["requests"]:
        v = classify(s, Seen(r["id"], tuple(r["prompt"]), r["predicted"], r["actual"],
                             r["t_sent"], r["t_headers"], r["t_first"]))
        assert v.kind == r["class"], r["id"]


def test_an_eviction_aware_estimate_fixes_the_captured_eviction_and_spoils_nothing() -> None:
    """``bench/evict_check.py`` on the real 4-in-flight capture: its one ``evicted`` mismatch
    becomes a match with the node's queue estimate (core/free_queue.py), no prediction goes
    below the engine's count; raising P to the estimate also fixes both ``inserted``."""
    from radixmesh.bench.evict_check import check

    cut = check(FIXTURE / "run-none-c4.msgpack", 48)
    assert cut["before"]["evicted"] == 1 and cut["after"]["evicted"] == 0
    assert cut["after"]["over"] == 0 and cut["after"]["match"] == cut["before"]["match"] + 1
    full = check(FIXTURE / "run-none-c4.msgpack", 48, discount_only=False)
    assert full["after"]["match"] == len(msgpack.unpackb(
        (FIXTURE / "run-none-c4.msgpack").read_bytes(), raw=False)["requests"])


def test_a_whole_run_capture_reads_back_as_the_fixture_does(tmp_path: Path) -> None:
    """``--capture-whole`` (every engine's batches, every request with its engine) feeds
    ``bench/evict_check.py`` as the bounded fixture does."""
    from radixmesh.bench.evict_check import check
    from radixmesh.bench.vllm_capture import save_whole_run
    from radixmesh.bench.vllm_replay import Agreement

    doc = msgpack.unpackb((FIXTURE / "run-none-c4.msgpack").read_bytes(), raw=False)
    agreement = Agreement(seen=[(0, Seen(r["id"], tuple(r["prompt"]), r["predicted"],
                                         r["actual"], r["t_sent"], r["t_headers"],
                                         r["t_first"])) for r in doc["requests"]],
                          verdicts=[r["class"] for r in doc["requests"]])
    frames = [[(t, f) for t, f in doc["frames"]], []]
    n = save_whole_run(tmp_path / "whole.msgpack", frames, agreement, doc["block_size"],
                       doc["engine_block_size"])
    assert n == len(doc["requests"])
    whole = check(tmp_path / "whole.msgpack", 48)
    assert whole | {"file": ""} == check(FIXTURE / "run-none-c4.msgpack", 48) | {"file": ""}
