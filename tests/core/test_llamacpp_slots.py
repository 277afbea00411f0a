"""LlamaCppSlots against a literal transcription of llama.cpp's server rules (Hypothesis)."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixmesh.core.llamacpp_slots import LlamaCppSlots, lcp


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


class Reference:
    """get_available_slot / server_prompt_cache::alloc, load, update / release, line by line
    (exact fractions where llama.cpp divides; a token budget for the cache's byte limit)."""

    def __init__(self, n: int, sim: float, budget: int | None, clear_idle: bool) -> None:
        self.slots = [{"tokens": [], "t": -1, "busy": False} for _ in range(n)]
        self.states: list[list[int]] = []
        self.sim, self.budget, self.clear_idle, self.time = sim, budget, clear_idle, 0
        self.cache_on = budget != 0

    def save(self, tokens: list[int]) -> None:
        if not tokens:
            return
        for s in self.states:
            if common_prefix(s, tokens) == len(tokens):
                return
        if self.budget is not None and len(tokens) > self.budget:
            return
        self.states = [s for s in self.states if common_prefix(s, tokens) != len(s)]
        self.states.append(list(tokens))
        while self.budget is not None and sum(map(len, self.states)) > self.budget:
            self.states.pop(0)

    def load(self, slot: dict, task: list[int]) -> None:
        lcp_best = common_prefix(slot["tokens"], task)
        f_keep_best = Fraction(lcp_best, len(slot["tokens"])) if slot["tokens"] else -1
        f_sim_best = Fraction(lcp_best, len(task))
        best = None
        for i, s in enumerate(self.states):
            cur = common_prefix(s, task)
            f_keep, f_sim = Fraction(cur, len(s)), Fraction(cur, len(task))
            if f_keep < Fraction(1, 4):
                continue
            if f_keep_best < f_keep and f_sim_best < f_sim:
                f_keep_best, f_sim_best, best = f_keep, f_sim, i
        if best is not None:
            slot["tokens"] = self.states.pop(best)

    def get_available_slot(self, task: list[int]) -> dict:
        ret, update = None, False
        f_sim_best = 0.0
        for slot in self.slots:
            if slot["busy"] or not slot["tokens"]:
                continue
            f_sim = common_prefix(slot["tokens"], task) / len(task)
            if f_sim > f_sim_best and f_sim > self.sim:
                f_sim_best, ret = f_sim, slot
        if ret is not None:
            f_keep = Fraction(common_prefix(ret["tokens"], task), len(ret["tokens"]))
            update = f_keep < Fraction(1, 2)
        if ret is None:
            t_last = -1
            for slot in self.slots:
                if slot["busy"]:
                    continue
                if ret is None or slot["t"] <= t_last:
                    t_last, ret = slot["t"], slot
            update = True
        assert ret is not None
        if update and self.cache_on:
            self.save(ret["tokens"])
            self.load(ret, task)
        return ret

    def launch(self, task: list[int]) -> tuple[int, dict]:
        slot = self.get_available_slot(task)
        n_past = min(common_prefix(slot["tokens"], task), len(task) - 1)
        slot["busy"] = True
        if self.cache_on:
            for other in self.slots:
                if not other["busy"]:
                    self.save(other["tokens"])
                    if self.clear_idle:
                        other["tokens"] = []
        return n_past, slot

    def release(self, slot: dict, kept: list[int]) -> None:
        self.time += 1
        slot.update(tokens=list(kept), t=self.time, busy=False)


prompts = st.lists(st.integers(0, 2), min_size=1, max_size=14)
ops = st.lists(st.tuples(st.booleans(), prompts, st.integers(0, 5)), max_size=30)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(1, 3), st.sampled_from([0.0, 0.1, 0.5]),
       st.sampled_from([None, 0, 12, 40]), st.booleans())
def test_model_follows_the_reference(steps: list[tuple[bool, list[int], int]], n: int,
                                     sim: float, budget: int | None, clear_idle: bool) -> None:
    model = LlamaCppSlots(n, sim, budget, clear_idle)
    ref = Reference(n, sim, budget, clear_idle)
    running: list[tuple[int, dict, list[int]]] = []
    for key, (send, prompt, pick) in enumerate(steps):
        if send and len(running) < n:  # a slot is idle: the request starts now
            got = model.start(key, prompt)
            want, slot = ref.launch(prompt)
            assert got == want
            running.append((key, slot, prompt))
        elif running:
            k, slot, p = running.pop(pick % len(running))
            kept = p + [7] * pick  # outputs: tokens no prompt has
            model.finish(k, kept)
            ref.release(slot, kept)
        assert [list(s.tokens) for s in model.slots] == [s["tokens"] for s in ref.slots]
        assert [list(t) for t in model.saved] == ref.states


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(1, 2), prompts)
def test_predict_changes_nothing_and_start_agrees(steps: list[tuple[bool, list[int], int]],
                                                  n: int, probe: list[int]) -> None:
    model = LlamaCppSlots(n, cache_tokens=40)
    keys: list[int] = []
    for key, (send, prompt, pick) in enumerate(steps):
        if send:
            model.start(key, prompt)  # may wait: every slot busy
            keys.append(key)
        elif keys:
            k = keys.pop(pick % len(keys))
            model.finish(k, prompt)
    before = (list(model.slots), list(model.saved), list(model.waiting))
    predicted = model.predict(probe)
    assert (list(model.slots), list(model.saved), list(model.waiting)) == before
    assert model.start("probe", probe) == predicted


def test_one_slot_reuses_only_what_it_last_held_or_restores() -> None:
    a, b = tuple(range(100)), tuple(range(1000, 1100))
    m = LlamaCppSlots(1)
    assert m.start("a", a) == 0
    m.finish("a", a)
    assert m.start("b", b) == 0  # by LRU: a saved, nothing to restore for b
    m.finish("b", b)
    assert m.predict((*a, 5)) == 100  # b saved, a restored from the prompt cache
    off = LlamaCppSlots(1, cache_tokens=0)  # --cache-ram 0: only the slot counts
    for key, p in (("a", a), ("b", b)):
        off.start(key, p)
        off.finish(key, p)
    assert off.predict((*a, 5)) == 0


def test_a_waiting_request_starts_at_the_next_release() -> None:
    m = LlamaCppSlots(1)
    m.start("a", (1, 2, 3, 4))
    assert m.start("b", (1, 2, 3, 9)) == 3  # as if "a" ended with its prompt
    assert m.slots[0].running == "a" and [k for k, _ in m.waiting] == ["b"]
    m.finish("a", (1, 2, 3, 4, 8))
    assert m.slots[0].running == "b" and not m.waiting


def test_an_aborted_request_leaves_its_slot_as_it_was() -> None:
    m = LlamaCppSlots(1)
    m.start("a", (1, 2, 3, 4))
    m.finish("a", (1, 2, 3, 4))
    m.start("b", (9, 9, 9))
    m.start("c", (1, 2, 3, 5))  # waits for "b"
    m.abort("b")  # "b" never reached the server: "c" runs on the slot "a" left
    assert m.slots[0].running == "c" and m.slots[0].tokens == (1, 2, 3, 4)
    assert m.predict((1, 2, 3, 5)) == 3  # as if "c" ended with its prompt


def test_lcp_and_bad_arguments() -> None:
    assert lcp((1, 2, 3), (1, 2, 4)) == 2 and lcp((), (1,)) == 0 and lcp((5,), (6,)) == 0
    for kwargs in ({"n_slots": 0}, {"similarity": 1.0}, {"cache_tokens": -1}):
        with pytest.raises(ValueError):
            LlamaCppSlots(**kwargs)  # type: ignore[arg-type]
