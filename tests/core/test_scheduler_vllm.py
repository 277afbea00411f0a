"""``cache_rule="vllm"``: the scheduler follows vLLM 0.32's prefix-caching rules (what an emulated
vLLM must do to hit what the real one hits). Worked examples with exact counts, and a Hypothesis
property against a simple model of vLLM's block pool as its source reads:

* vllm/v1/core/kv_cache_manager.py ``get_computed_blocks``: whole cached blocks of
  ``prompt[:-1]``; ``allocate_slots``: a scheduled chunk's whole blocks are cached at once
  (``cache_blocks``), and ``full_sequence_must_fit`` (``scheduler_reserve_full_isl``, default on)
  admits a request only if its whole prompt fits;
* vllm/v1/core/block_pool.py: a free queue of blocks; ``get_new_blocks`` takes from its front
  (evicting what the block cached), ``touch`` takes a hit block out of it, ``free_blocks``
  appends cached blocks to its back and puts uncached ones at its front; one block is held back
  as the null block;
* vllm/v1/core/single_type_kv_cache_manager.py ``free``: a request's blocks in reverse order.
"""

from __future__ import annotations

from collections import OrderedDict

import hypothesis.strategies as st
from hypothesis import given, settings

from radixmesh.core.scheduler import Finished, Scheduler, SchedulerConfig

BS = 4  # block size of the property's engines


def _config(kv_blocks: int, rule: str = "vllm", block_size: int = BS, **kw: object
            ) -> SchedulerConfig:
    return SchedulerConfig(block_size=block_size, kv_blocks=kv_blocks, max_running=8,
                           step_tokens=256, cache_rule=rule,
                           prefix_aware=bool(kw.get("prefix_aware", rule != "vllm")))


def _step_all(sched: Scheduler, t: float) -> tuple[list[Finished], float]:
    done: list[Finished] = []
    while True:
        step = sched.schedule(t)
        if step.empty:
            return done, t
        done += sched.complete(step, dict.fromkeys(step.emitting, 7), t)
        t += 1.0


# --------------------------------------------------------------------- two requests, together
def test_a_request_admitted_in_the_pioneers_step_hits_its_blocks_at_once() -> None:
    # Two 40-token prompts sharing 32 tokens (2 blocks of 16) arrive together. vLLM caches the
    # first one's blocks when it is scheduled, so the second, admitted in the same step, hits
    # them: prefix computed once, both first tokens in step 0.
    shared = list(range(32))
    sched = Scheduler(_config(64, block_size=16))
    sched.add(0, [*shared, *range(100, 108)], 2, 0.0)
    sched.add(1, [*shared, *range(200, 208)], 2, 0.0)
    first = sched.schedule(0.0)
    assert [(c.seq, c.start, c.tokens) for c in first.prefills] == [(0, 0, 40), (1, 32, 8)]
    done = sched.complete(first, dict.fromkeys(first.emitting, 7), 0.0)
    done += _step_all(sched, 1.0)[0]
    assert {f.seq: f.cached_tokens for f in done} == {0: 0, 1: 32}
    assert sched.prefill_tokens_computed == 48


def test_the_radix_rule_defers_or_recomputes_instead() -> None:
    # The same pair under cache_rule="radix": "pioneers first" defers the second to the next
    # step (then it hits); plain FCFS computes the shared prefix twice.
    shared = list(range(32))
    for prefix_aware, hit, computed in ((True, 32, 48), (False, 0, 80)):
        sched = Scheduler(_config(64, "radix", 16, prefix_aware=prefix_aware))
        sched.add(0, [*shared, *range(100, 108)], 2, 0.0)
        sched.add(1, [*shared, *range(200, 208)], 2, 0.0)
        done, _ = _step_all(sched, 0.0)
        assert {f.seq: f.cached_tokens for f in done} == {0: 0, 1: hit}
        assert sched.prefill_tokens_computed == computed


# ------------------------------------------------------------------------- eviction, capacity
def test_eviction_takes_the_lru_requests_tail_blocks_first() -> None:
    # 9 usable blocks of 4. A: 16-token prompt (4 blocks), B: another 16. Then C needs 3 new
    # blocks: 1 is free, so 2 go, both from the tail of A (the least recently used): A's
    # first 2 blocks stay and a resend of A hits 8 tokens (the radix rule drops all of A).
    a, b, c = list(range(16)), list(range(100, 116)), list(range(200, 212))
    for rule, hit in (("vllm", 8), ("radix", 0)):
        sched, t = Scheduler(_config(9, rule)), 0.0
        for i, prompt in enumerate((a, b, c, [*a, 99])):
            sched.add(i, prompt, 1, t)
            done, t = _step_all(sched, t)
        assert done[0].cached_tokens == hit, rule


def test_prompts_parting_inside_a_block_hold_a_block_each() -> None:
    # Two 8-token prompts sharing their first 2 tokens: 2 + 2 whole blocks under vLLM (block 0
    # differs); the radix rule's token count (2 + 6 + 6 = 14 tokens) says 4 blocks too, but a
    # third prompt parting at token 2 shows the difference: 6 blocks, not ceil(20 / 4) = 5.
    sched, t = Scheduler(_config(16)), 0.0
    for i in range(3):
        sched.add(i, [1, 2, *range(10 * i + 10, 10 * i + 16), 0], 1, t)
        _, t = _step_all(sched, t)
    assert sched.kv_used_blocks == 6
    radix, t = Scheduler(_config(16, "radix")), 0.0
    for i in range(3):
        radix.add(i, [1, 2, *range(10 * i + 10, 10 * i + 16), 0], 1, t)
        _, t = _step_all(radix, t)
    assert radix.kv_used_blocks == 5


# --------------------------------------------------------------------- against a model of vLLM
class VllmBlocks:
    """vLLM 0.32's block pool for one-at-a-time requests (the module docstring's rules)."""

    def __init__(self, kv_blocks: int) -> None:
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(kv_blocks))
        self.key: dict[int, tuple[int, ...]] = {}  # block -> the prefix it caches
        self.block: dict[tuple[int, ...], int] = {}
        self.ref = [0] * kv_blocks

    def hit(self, tokens: list[int]) -> list[int]:
        out: list[int] = []
        for end in range(BS, len(tokens), BS):  # whole blocks of tokens[:-1]
            b = self.block.get(tuple(tokens[:end]))
            if b is None:
                break
            out.append(b)
        return out

    def take(self, n: int) -> list[int]:
        got = [self.free.popitem(last=False)[0] for _ in range(n)]
        for b in got:
            key = self.key.pop(b, None)
            if key is not None:
                del self.block[key]
            self.ref[b] = 1
        return got

    def cache(self, blocks: list[int], tokens: list[int]) -> None:
        for i in range(len(tokens) // BS):
            key, b = tuple(tokens[: (i + 1) * BS]), blocks[i]
            if key not in self.block and b not in self.key:
                self.key[b], self.block[key] = key, b

    def serve(self, prompt: list[int], max_tokens: int) -> int:
        """One request alone, outputs all 7; the tokens it hit."""
        tokens = list(prompt)
        hits = self.hit(tokens)
        for b in hits:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
        blocks = hits + self.take(-(-len(tokens) // BS) - len(hits))
        self.cache(blocks, tokens)
        for _ in range(max_tokens - 1):  # the last output is never fed back
            tokens.append(7)
            blocks += self.take(-(-len(tokens) // BS) - len(blocks))
            self.cache(blocks, tokens)
        cached, uncached = [], []
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (cached if b in self.key else uncached).append(b)
        for b in reversed(uncached):
            self.free[b] = None
            self.free.move_to_end(b, last=False)
        for b in cached:
            self.free[b] = None
        return len(hits) * BS


@st.composite
def traces(draw: st.DrawFn) -> list[tuple[list[int], int]]:
    """Requests drawn from 3 topics (a shared head of 0-13 tokens, then per-topic tokens),
    each with a tail of its own."""
    topics = [draw(st.lists(st.integers(1, 3), min_size=0, max_size=13)) for _ in range(3)]
    out: list[tuple[list[int], int]] = []
    for i in range(draw(st.integers(1, 25))):
        topic = draw(st.integers(0, 2))
        tail = [100 + i] * draw(st.integers(1, 6))
        out.append(([*topics[topic], 50 + topic, *tail], draw(st.integers(1, 4))))
    return out


@settings(max_examples=150, deadline=None)
@given(traces(), st.integers(7, 12))
def test_one_at_a_time_it_hits_what_vllms_block_pool_hits(
    trace: list[tuple[list[int], int]], kv_blocks: int
) -> None:
    # Every tail is the request's own, so no request computes a block that is cached already.
    # When one does (a resend whose hit stops a block short, or decodes the same output), vLLM
    # neither caches its copy nor moves the cached original in its LRU order, and may evict
    # the original under the copy; the scheduler holds the copy's block too (capacity alike)
    # but locks the original and refreshes its place: a known difference, not modelled.
    model = VllmBlocks(kv_blocks)
    sched, t = Scheduler(_config(kv_blocks)), 0.0
    for i, (prompt, max_tokens) in enumerate(trace):
        sched.add(i, prompt, max_tokens, t)
        done, t = _step_all(sched, t)
        assert [f.cached_tokens for f in done] == [model.serve(prompt, max_tokens)], i
        assert sched.kv_used_blocks == kv_blocks - sum(
            1 for b in model.free if b not in model.key)
