"""Both cache rules under concurrent requests, aborts before and inside a step, and eviction
pressure: the tree's lock counts always equal a recount of its nodes, and once everything has
drained no private block, copy or lock is left (a leak the state machine's invariants miss)."""

from __future__ import annotations

import contextlib

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

from radixmesh.core.scheduler import Scheduler, SchedulerConfig


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data(), st.integers(6, 20), st.integers(2, 5), st.sampled_from([2, 4]),
       st.integers(3, 40), st.sampled_from(["vllm", "radix"]))
def test_locks_are_counted_right_and_nothing_leaks(
    data: st.DataObject, kv_blocks: int, max_running: int, bs: int, step_tokens: int, rule: str,
) -> None:
    cfg = SchedulerConfig(block_size=bs, kv_blocks=kv_blocks, max_running=max_running,
                          step_tokens=max(step_tokens, max_running + 1), cache_rule=rule,
                          prefix_aware=False)
    s = Scheduler(cfg)
    heads = [data.draw(st.lists(st.integers(1, 3), max_size=10)) for _ in range(2)]
    n = data.draw(st.integers(1, 12))
    t = 0.0
    added = 0
    for _ in range(200):
        if added < n and data.draw(st.booleans()):
            own = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=8))
            p = [*heads[data.draw(st.integers(0, 1))], *own]
            mt = data.draw(st.integers(1, 4))
            with contextlib.suppress(ValueError):
                s.add(added, p, mt, t)
            added += 1
        if data.draw(st.integers(0, 9)) == 0 and added:
            s.abort(data.draw(st.integers(0, added - 1)), t)
        step = s.schedule(t)
        pool = s._pool
        assert pool.used_blocks <= kv_blocks
        assert pool.private_blocks >= 0
        tree = pool.cache.tree
        stack, lb, lt = [tree.root], 0, 0
        while stack:
            nd = stack.pop()
            if nd is not tree.root and nd.lock_ref > 0:
                lb += len(nd.hashes)
                lt += len(nd.key)
            stack.extend(nd.children.values())
        assert lb == tree.locked_blocks and lt == tree.locked_tokens
        if added and data.draw(st.integers(0, 9)) == 0:
            s.abort(data.draw(st.integers(0, added - 1)), t)
        s.complete(step, dict.fromkeys(step.emitting, 1), t)
        t += 1
        if added >= n and s.running == 0 and s.waiting == 0:
            break
    for _ in range(500):
        if s.running == 0 and s.waiting == 0:
            break
        step = s.schedule(t)
        s.complete(step, dict.fromkeys(step.emitting, 1), t)
        t += 1
    assert s.running == 0 and s.waiting == 0
    pool = s._pool
    assert pool.private_blocks == 0, pool.private_blocks
    assert s._copies == {}
    assert pool.cache.tree.locked_tokens == 0
    assert pool.cache.tree.locked_blocks == 0
    assert pool.used_blocks <= kv_blocks
