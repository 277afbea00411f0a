"""core/free_queue.py against a reference model of vLLM's block pool (block ids, reference
counts, one free queue: allocation pops the head, a prefix hit takes a block out, a finished
request's blocks go back deepest first, cached ones to the tail, the others to the head)."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings, target
from hypothesis import strategies as st

from radixmesh.core.free_queue import EngineQueue, FreeOrder, Held, surviving_blocks

Key = tuple[int, ...]


class RefPool:
    """vLLM v1's BlockPool as the docstring of core/free_queue.py describes it."""

    def __init__(self, num_gpu_blocks: int) -> None:
        self.queue = list(range(1, num_gpu_blocks))  # block 0: the null block
        self.ref = [0] * num_gpu_blocks
        self.key: dict[int, Key] = {}
        self.block_of: dict[Key, int] = {}
        self.held: dict[int, list[int]] = {}

    def schedule(self, rid: int, req: Held) -> int | None:
        """The request's hit (blocks), or None when the pool cannot hold it."""
        hit = 0
        while hit < len(req.chain) and req.chain[hit] in self.block_of:
            hit += 1
        need = req.blocks - hit
        touched = [self.block_of[k] for k in req.chain[:hit]]
        if need > len(self.queue) - sum(self.ref[b] == 0 for b in touched):
            return None
        for b in touched:
            if self.ref[b] == 0:
                self.queue.remove(b)
            self.ref[b] += 1
        new, self.queue = self.queue[:need], self.queue[need:]
        for b in new:
            if b in self.key:
                del self.block_of[self.key.pop(b)]
            self.ref[b] = 1
        for k, b in zip(req.chain[hit:], new, strict=False):
            if k not in self.block_of:  # else a second copy: vLLM's duplicate, left uncached
                self.key[b], self.block_of[k] = k, b
        self.held[rid] = touched + new
        return hit

    def finish(self, rid: int) -> None:
        first, last = [], []
        for b in reversed(self.held.pop(rid)):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (last if b in self.key else first).append(b)
        self.queue = first[::-1] + self.queue + last


def request(group: int, variant: int, tokens: int, block: int = 4) -> Held:
    """A prompt of ``tokens`` in ``group`` (its first 2 blocks shared by the group's variants)."""
    keys = [(group, j) if j < 2 else (group, variant, j) for j in range(tokens // block)]
    return Held.of_prompt(keys, tokens, block)


prompts = st.tuples(st.integers(0, 3), st.integers(0, 2),
                    st.integers(1, 22).filter(lambda n: n % 4 != 0))
requests = st.builds(request, st.integers(0, 3), st.integers(0, 2),
                     st.integers(1, 14).filter(lambda n: n % 4 != 0))


@settings(max_examples=300, deadline=None)
@given(st.integers(8, 16),
       st.lists(st.tuples(prompts, st.lists(st.integers(0, 3), max_size=3)), min_size=4,
                max_size=25),
       st.lists(requests, min_size=1, max_size=3), st.integers(0, 24), st.integers(0, 2),
       st.sampled_from([5, 9, 13]))
def test_the_estimate_is_the_engines_hit_when_nothing_finishes_in_between(
        num_gpu_blocks: int, history: list[tuple[tuple[int, int, int], list[int]]],
        waiting: list[Held], like: int, variant: int, tokens: int) -> None:
    """The node sees the cached blocks, the requests it sent, which started and the order they
    finished; the requests ``waiting`` (sent, not scheduled) are scheduled before a new one (in
    the group of an earlier request, ``like``): the estimate is the engine's hit (searched
    towards chains cut by evictions the node's present match would miss)."""
    pool, node = RefPool(num_gpu_blocks), EngineQueue(num_gpu_blocks - 1)
    running: set[int] = set()
    for rid, (prompt, finishes) in enumerate(history):
        for pick in finishes:  # running requests finish in any order
            if not running:
                break
            done = sorted(running)[pick % len(running)]
            running.discard(done)
            pool.finish(done)
            node.finished(done)
        if pool.schedule(rid, request(*prompt)) is not None:
            running.add(rid)
            node.sent(rid, request(*prompt))
            node.started(rid)
    new = request(history[like % len(history)][0][0], variant, tokens)
    for i, req in enumerate(waiting):
        node.sent(1000 + i, req)
    cached = set(pool.block_of)
    estimate = node.surviving(new.chain, cached)
    for i, req in enumerate(waiting):
        assume(pool.schedule(1000 + i, req) is not None)
    actual = pool.schedule(2000, new)
    assume(actual is not None)
    target(float(sum(k in cached for k in new.chain) - estimate))
    assert estimate == actual


def test_the_deepest_blocks_of_the_least_recently_finished_request_go_first() -> None:
    order = FreeOrder()
    order.release(["a0", "a1", "a2"])
    order.release(["b0", "b1"])
    cached = ["b0", "b1", "a0", "a1", "a2", "x"]
    assert order.free_blocks(cached, held={"b1"}) == ["x", "a2", "a1", "a0", "b0"]
    # two blocks to allocate, one uncached free: only a2 goes, the a chain keeps 2 blocks
    free = order.free_blocks(cached, held=set())
    assert surviving_blocks(["a0", "a1", "a2"], free=free, cached=cached, uncached=1,
                            waiting=[Held(("x",), 3)]) == 2


def test_a_waiting_request_that_hits_a_block_protects_it() -> None:
    free, cached = ["a1", "a0", "b0"], ["a0", "a1", "b0"]
    assert surviving_blocks(["a0", "a1"], free=free, cached=cached, uncached=0,
                            waiting=[Held(("a0",), 3)]) == 1  # a0 touched; a1, b0 evicted


def test_bad_arguments_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="blocks"):
        Held(("a", "b"), 1)
    with pytest.raises(ValueError, match="uncached"):
        surviving_blocks([], free=[], cached=[], uncached=-1, waiting=[])
    with pytest.raises(ValueError, match="block_size"):
        Held.of_prompt([], 3, 0)
    with pytest.raises(ValueError, match="capacity"):
        EngineQueue(0)
