"""The scheduler against a simple reference model, as a Hypothesis state machine.

The model keeps what the scheduler must honour, not how it plans: each request's max_tokens,
the waiting order (arrival at the back, preempted ones at the front, in the order vLLM's
repeated prepend leaves them), how many admissions passed each waiting request in its current
wait, and, with a pool too large to evict from, every token sequence inserted into the prefix
cache (a prompt once its prefill completes, prompt + output[:-1] when it finishes): a request's
reusable prefix is then the longest common prefix with any of them, cut to whole blocks and
never including its last token. Checked after every step: KV never over the pool, prefill
tokens within the step budget, running within max_running, no request passed more than K times,
strict FCFS admission without prefix awareness, cached counts as the model says; at teardown
the machine drains and every request finished exactly once, with exactly max_tokens outputs
unless stopped or aborted.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixmesh.core.scheduler import Finished, PrefillChunk, Scheduler, SchedulerConfig, Step

BASES = [tuple(range(1, 40)), tuple(range(100, 140)), tuple(range(200, 240))]


def _lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([2, 4]),
        kv_blocks=st.integers(10, 40),
        max_running=st.integers(1, 4),
        extra_tokens=st.integers(0, 20),
        max_overtake=st.integers(0, 3),
        prefix_aware=st.booleans(),
        big_pool=st.booleans(),
        vllm=st.booleans(),
    )
    def setup(self, **kw: int) -> None:
        kv_blocks = 100_000 if kw["big_pool"] else kw["kv_blocks"]
        self.cfg = SchedulerConfig(
            block_size=kw["block_size"],
            kv_blocks=kv_blocks,
            max_running=kw["max_running"],
            step_tokens=kw["max_running"] + kw["extra_tokens"],
            max_overtake=kw["max_overtake"],
            prefix_aware=bool(kw["prefix_aware"]),
            cache_rule="vllm" if kw["vllm"] else "radix",
        )
        self.big = bool(kw["big_pool"])
        self.sched = Scheduler(self.cfg)
        self.now = 0.0
        self.next_id = 0
        self.max_tokens: dict[int, int] = {}
        self.prompts: dict[int, tuple[int, ...]] = {}
        self.order: list[int] = []  # the model's waiting queue
        self.passed: dict[int, int] = {}
        self.done: dict[int, Finished] = {}
        self.stopped: set[int] = set()
        self.inserted: list[tuple[int, ...]] = []

    # ------------------------------------------------------------------ the reference model
    def reusable(self, prompt: tuple[int, ...]) -> int:
        hit = max((_lcp(prompt, p) for p in self.inserted), default=0)
        bs = self.cfg.block_size
        return min(hit, len(prompt) - 1) // bs * bs

    # ------------------------------------------------------------------ rules
    @rule(
        base=st.integers(0, 2),
        shared=st.integers(0, 30),
        suffix=st.lists(st.integers(500, 600), max_size=8),
        max_tokens=st.integers(1, 6),
    )
    def add(self, base: int, shared: int, suffix: list[int], max_tokens: int) -> None:
        prompt = BASES[base][:shared] + tuple(suffix)
        if not prompt:
            return
        if self.big:
            assert self.sched.cached_prefix(prompt) == self.reusable(prompt)
        need = -(-(len(prompt) + max_tokens - 1) // self.cfg.block_size)
        if need > self.cfg.kv_blocks:
            return
        seq = self.next_id
        self.next_id += 1
        self.sched.add(seq, prompt, max_tokens, self.now)
        self.max_tokens[seq], self.prompts[seq] = max_tokens, prompt
        self.order.append(seq)
        self.passed[seq] = 0

    @precondition(lambda self: self.max_tokens)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.max_tokens)))
        f = self.sched.abort(seq, self.now)
        if seq in self.done:
            assert f is None
            return
        assert f is not None and f.reason == "abort" and f.seq == seq
        self.done[seq] = f
        if seq in self.order:
            self.order.remove(seq)

    @rule(stop_mask=st.integers(0, 15))
    def step(self, stop_mask: int) -> None:
        step = self.sched.schedule(self.now)
        self.check_plan(step)
        stop = {s for s in step.emitting if (stop_mask >> (s % 4)) & 1}
        tokens = {s: 1000 + s for s in step.emitting}
        for chunk in step.prefills:
            if chunk.last and self.big:
                self.inserted.append(tuple(self.sched.seq_tokens(chunk.seq)))
        for f in self.sched.complete(step, tokens, self.now, stop):
            assert f.seq not in self.done, "finished twice"
            self.done[f.seq] = f
            if f.reason == "stop":
                self.stopped.add(f.seq)
                assert f.seq in stop
            if self.big:
                self.inserted.append(self.prompts[f.seq] + f.output[:-1])
        self.now += 1.0

    def check_plan(self, step: Step) -> None:
        assert step.prefill_tokens <= self.cfg.step_tokens
        assert all(c.tokens >= 1 for c in step.prefills)
        if step.preempted:
            self.order = list(reversed(step.preempted)) + self.order
            for s in step.preempted:
                self.passed[s] = 0
            return
        waiting = set(self.order)
        for chunk in step.prefills:
            if chunk.seq in waiting:
                self.check_admitted(chunk)
            if self.big and self.cfg.cache_rule == "vllm":  # cached when scheduled: a chunk
                # after it in this step hits it
                self.inserted.append(tuple(self.sched.seq_tokens(chunk.seq))[
                    : chunk.start + chunk.tokens])

    def check_admitted(self, chunk: PrefillChunk) -> None:
        pos = self.order.index(chunk.seq)
        if not self.cfg.prefix_aware:
            assert pos == 0, "FCFS admits the head of the queue first"
        for ahead in self.order[:pos]:
            self.passed[ahead] += 1
            assert self.passed[ahead] <= self.cfg.max_overtake
        self.order.pop(pos)
        if self.big:
            assert chunk.start == self.reusable(self.prompts[chunk.seq])

    # ------------------------------------------------------------------ invariants
    @invariant()
    def within_limits(self) -> None:
        assert self.sched.kv_used_blocks <= self.cfg.kv_blocks
        assert self.sched.running <= self.cfg.max_running
        assert self.sched.waiting == len(self.order)
        assert 0.0 <= self.sched.kv_usage <= 1.0
        if self.big:
            assert self.sched.preemptions == 0

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        budget = sum(
            len(p) + m for p, m in zip(self.prompts.values(), self.max_tokens.values(), strict=True)
        )
        for _ in range(4 * budget + 10):
            if self.sched.running == 0 and self.sched.waiting == 0:
                break
            self.step(0)
        assert self.sched.running == 0 and self.sched.waiting == 0, "no progress"
        assert sorted(self.done) == sorted(self.max_tokens)
        for seq, f in self.done.items():
            if f.reason == "length":
                assert len(f.output) == self.max_tokens[seq]
            else:
                assert len(f.output) <= self.max_tokens[seq]
            assert f.prompt_tokens == len(self.prompts[seq])


SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
test_scheduler_machine = SchedulerMachine.TestCase
