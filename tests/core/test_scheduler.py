"""The continuous-batching scheduler: worked examples with exact counts, and a Hypothesis state
machine against a simple reference model (tests/core/test_scheduler_machine.py)."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from radixmesh.core.scheduler import Finished, Scheduler, SchedulerConfig, Step

PREFIX = list(range(2000))


def _suffix(i: int, n: int = 32) -> list[int]:
    return [10_000 + 100 * i + j for j in range(n)]


def _run(sched: Scheduler, limit: int = 1000) -> tuple[list[Finished], list[Step]]:
    """Step to idle; time is the step index. Every emitting sequence gets token 7."""
    done: list[Finished] = []
    steps: list[Step] = []
    for t in range(limit):
        step = sched.schedule(float(t))
        if step.empty:
            break
        steps.append(step)
        done += sched.complete(step, dict.fromkeys(step.emitting, 7), float(t))
    assert sched.running == 0 and sched.waiting == 0
    return done, steps


def _shared_prefix_burst(prefix_aware: bool, step_tokens: int) -> tuple[Scheduler, list[Finished]]:
    sched = Scheduler(SchedulerConfig(step_tokens=step_tokens, prefix_aware=prefix_aware))
    for i in range(8):
        sched.add(i, PREFIX + _suffix(i), 4, 0.0)
    done, _ = _run(sched)
    return sched, done


def test_pioneer_first_computes_the_shared_prefix_once() -> None:
    # One pioneer computes 2,000 + 32 tokens in step 0; the 7 followers wait for it and then
    # reuse all 2,000 prefix tokens (125 whole blocks of 16): 7 x 32 more.
    for step_tokens in (8192, 32768):
        sched, done = _shared_prefix_burst(True, step_tokens)
        assert sched.prefill_tokens_computed == 2032 + 7 * 32
        assert sched.cached_tokens_hit == 7 * 2000
        first = {f.seq: f.first_token_at for f in done}
        assert first == {0: 0.0, **{i: 1.0 for i in range(1, 8)}}
        assert all(len(f.output) == 4 and f.reason == "length" for f in done)


def test_fcfs_computes_the_prefix_for_every_request_admitted_before_it_is_cached() -> None:
    # All 8 fit one step of 32,768 tokens: 8 x 2,032, no hit.
    sched, done = _shared_prefix_burst(False, 32768)
    assert sched.prefill_tokens_computed == 8 * 2032
    assert sched.cached_tokens_hit == 0
    assert {f.first_token_at for f in done} == {0.0}
    # 8,192 a step: step 0 runs 4 x 2,032 and the first 64 tokens of request 4; step 1 the rest
    # of request 4 (1,968) and requests 5-7 hitting the 2,000 cached by step 0: 3 x 32.
    sched, done = _shared_prefix_burst(False, 8192)
    assert sched.prefill_tokens_computed == 5 * 2032 + 3 * 32
    assert sched.cached_tokens_hit == 3 * 2000


def test_max_overtake_bounds_how_often_a_deferred_request_is_passed() -> None:
    # A (32 tokens) is prefilling in step 0; B shares A's first 16 tokens, so it is deferred;
    # C and D (unrelated) may pass it, but with K = 1 only one of them may.
    a = list(range(32))
    b = [*a[:16], 900, 901, 902, 903]
    c, d = [500, 501, 502, 503], [600, 601, 602, 603]
    order = {}
    for k in (1, 8):
        sched = Scheduler(
            SchedulerConfig(block_size=4, max_running=4, step_tokens=64, max_overtake=k)
        )
        for i, p in enumerate((a, b, c, d)):
            sched.add(i, p, 2, 0.0)
        step = sched.schedule(0.0)
        order[k] = [chunk.seq for chunk in step.prefills]
        sched.complete(step, dict.fromkeys(step.emitting, 7), 0.0)
        done, _ = _run(sched)
        order[k] += [f.seq for f in done if f.cached_tokens == 16]
    assert order[1] == [0, 2, 1, 3]  # B admitted after one pass, computing the prefix itself
    assert order[8] == [0, 2, 3, 1]  # B waits a step and then reuses A's 16 tokens


def test_preemption_recomputes_the_most_recent_admission_from_the_front_of_waiting() -> None:
    # 6 blocks of 4 tokens. A and B (4-token prompts, 12 outputs) each need up to 4 blocks:
    # both start; when the pool runs out B (admitted last) is preempted, goes back to the front
    # of waiting ahead of C, and later recomputes prompt + its outputs.
    cfg = SchedulerConfig(block_size=4, kv_blocks=6, max_running=4, step_tokens=16)
    sched = Scheduler(cfg)
    sched.add(0, [1, 2, 3, 4], 12, 0.0)
    sched.add(1, [5, 6, 7, 8], 12, 0.0)
    sched.add(2, [9, 10, 11, 12], 1, 0.0)
    sched.schedule(0.0)  # not completed: complete() must come first
    with pytest.raises(RuntimeError):
        sched.schedule(0.0)
    sched = Scheduler(cfg)
    for i, p in enumerate(([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])):
        sched.add(i, p, 12 if i < 2 else 1, 0.0)
    done, steps = _run(sched)
    # Steps 1-8 decode A and B (2 private blocks each from step 5; prompts cached: 2 blocks,
    # C's unlocked prompt evicted); in step 9 A needs a third block: B is preempted.
    assert [(t, step.preempted) for t, step in enumerate(steps) if step.preempted] == [(9, (1,))]
    # Step 12 (A done): B recomputes its 9 outputs on top of its still cached 4-token prompt.
    assert [(c.seq, c.start, c.tokens, c.last) for c in steps[12].prefills] == [(1, 4, 9, True)]
    by_seq = {f.seq: f for f in done}
    assert [len(by_seq[i].output) for i in range(3)] == [12, 12, 1]
    assert (by_seq[1].preemptions, by_seq[1].cached_tokens) == (1, 4)
    assert (by_seq[1].admitted_at, by_seq[1].first_token_at) == (12.0, 0.0)
    assert sched.preemptions == 1 and len(steps) == 15


def test_followers_hit_while_the_pioneer_still_decodes() -> None:
    sched = Scheduler(SchedulerConfig(block_size=4, max_running=4, step_tokens=64))
    sched.add(0, list(range(40)), 50, 0.0)
    step = sched.schedule(0.0)
    sched.complete(step, {0: 1}, 0.0)
    assert sched.cached_prefix([*list(range(40)), 99]) == 40
    assert sched.cached_prefix(list(range(40))) == 36  # the last token is always computed
    sched.add(1, [*list(range(40)), 99], 1, 1.0)
    step = sched.schedule(1.0)
    assert [(c.seq, c.start, c.tokens, c.last) for c in step.prefills] == [(1, 40, 1, True)]
    assert [(d.seq, d.context) for d in step.decodes] == [(0, 41)]
    assert 0 < sched.kv_usage <= 1
    added, removed = sched.drain_cache_delta()
    assert len(added) == 10 and removed == []


def test_abort_stop_and_bad_input() -> None:
    sched = Scheduler(SchedulerConfig(block_size=4, kv_blocks=4, max_running=4, step_tokens=64))
    with pytest.raises(ValueError, match="prompt"):
        sched.add(0, [], 1, 0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        sched.add(0, [1], 0, 0.0)
    with pytest.raises(ValueError, match="never fit"):
        sched.add(0, [1] * 10, 8, 0.0)
    sched.add(0, [1, 2, 3], 5, 0.0)
    with pytest.raises(ValueError, match="duplicate"):
        sched.add(0, [1], 1, 0.0)
    sched.add(1, [4, 5], 5, 0.0)
    step = sched.schedule(0.0)
    with pytest.raises(ValueError, match="tokens"):
        sched.complete(step, {0: 1}, 0.0)
    done = sched.complete(step, {0: 1, 1: 2}, 0.0, stop={1})
    assert [(f.seq, f.reason, f.output) for f in done] == [(1, "stop", (2,))]
    aborted = sched.abort(0, 1.0)
    assert aborted is not None and aborted.reason == "abort" and aborted.output == (1,)
    assert sched.abort(0, 1.0) is None and sched.running == 0
    assert sched.schedule(2.0).empty


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("block_size", 0),
        ("kv_blocks", -1),
        ("max_running", 0),
        ("step_tokens", 0),
        ("max_overtake", -1),
        ("prefix_aware", 1),
        ("max_running", True),
    ],
)
def test_config_errors_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="step_tokens"):
        SchedulerConfig(max_running=8, step_tokens=4)


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 20), st.integers(1, 12)),
        min_size=1,
        max_size=8,
    ),
    kv_blocks=st.integers(12, 60),
    limit=st.integers(1, 9),
)
def test_decode_runs_equal_step_by_step(
    prompts: list[tuple[int, int, int]], kv_blocks: int, limit: int
) -> None:
    """Coalesced decode runs give what one ``schedule`` + ``complete`` per step gives."""
    cfg = SchedulerConfig(block_size=4, kv_blocks=kv_blocks, max_running=3, step_tokens=16)
    outcomes = []
    for coalesce in (False, True):
        sched = Scheduler(cfg)
        for i, (base, n, max_tokens) in enumerate(prompts):
            sched.add(i, [100 * base + j for j in range(n)], max_tokens, 0.0)
        done: list[Finished] = []
        times: list[float] = []
        t = 0
        while sched.running or sched.waiting:
            k = sched.decode_run(limit) if coalesce else 0
            if k:
                steps = [sched.decode_step(j) for j in range(k)]
                toks = {d.seq: [d.context + j for j in range(k)] for d in steps[0].decodes}
                done += sched.apply_decodes(k, toks, float(t + k - 1))
            else:
                step = sched.schedule(float(t))
                steps = [step]
                done += sched.complete(step, {s: c for s, c in _contexts(step).items()}, float(t))
            times += [float(len(s.decodes)) for s in steps]
            t += len(steps)
            assert t < 10_000
        outcomes.append(
            (
                sorted(done, key=lambda f: f.seq),
                sched.steps,
                times,
                sched.kv_used_blocks,
                sorted(sched.cache.block_hashes()),
            )
        )
    assert outcomes[0] == outcomes[1]


def _contexts(step: Step) -> dict[int, int]:
    """Each emitting sequence's token: the KV tokens it attends to (the same in both runs)."""
    out = {d.seq: d.context for d in step.decodes}
    out.update({c.seq: c.start + c.tokens for c in step.prefills if c.last})
    return out
