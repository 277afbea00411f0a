"""The emulated engine's loop: the core scheduler stepped on the wall clock.

Theory of operation
-------------------
::

    admission() ──▶ submit(prompt, max_tokens, stop_ids, sink) ──▶ Scheduler.add ──▶ (wakes)
    loop: aborts ─▶ schedule(now) ─▶ sleep until start + profile.step_s(step) × time_scale
          ─▶ next token of every emitting sequence ─▶ complete(step, tokens, stop)
          ─▶ tokens and Finished records into each request's sink ─▶ cache journal → events

One :class:`~radixmesh.core.scheduler.Scheduler` (continuous batching, chunked prefill, a real
prefix cache of token ids under the profile's KV block budget) decides every step; the profile
says how long the step would take on the emulated hardware, and the loop sleeps until the
step's planned end on a monotonic clock. Whatever the loop itself spends beyond that (its own
scheduling, the event loop being late) is *lag*: ``lag_s`` sums, over steps, how much later
than planned each ended; ``busy_s`` sums the planned durations. Lag much below busy means the
emulation keeps to the profile's speed. A step that follows another at once is planned from the
previous step's planned end, not from when the loop got round to it: a late wake-up (the event
loop streaming tokens, a loaded machine) shortens the next step by as much, up to that step's
whole length, instead of every later token drifting by it, as a real engine's next step starts
when its last one ended; but never before the last request submitted (one that arrived during
the lateness joins a step that cannot have begun before it).

A request reaches the scheduler ``profile.admission_s`` × the time scale after it arrived
(:meth:`EngineLoop.admission`, awaited by the HTTP side before ``submit``): what a real engine
spends before a request can join a step (HTTP, tokenising, the hop to its engine core). It
delays that request only; the steps of the others go on meanwhile.

Output tokens are deterministic (:func:`next_token` of the sequence so far), so a test can
predict every token and the byte tokenizer round-trips them as printable text. Aborts (a
client that went away) are applied between steps, as vLLM does. After every change of the
scheduler's cache the journal (``drain_cache_delta``) goes to the KV-event publisher with the
token sequences that can spell the added blocks: this step's sequences first, then all live.

Not thread-safe: everything runs on one asyncio loop. ``clock`` and ``sleep`` are arguments so
that tests step a virtual clock (no wall-clock assertions).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixmesh.core.blocks import namespace_block
from radixmesh.core.profile import Profile
from radixmesh.core.scheduler import Finished, Scheduler, Step
from radixmesh.emulate.events import Faults, KvEventPublisher

log = logging.getLogger("radixmesh.emulate")
ENGINE_SEED = 0x5EED_E061_E000_0001  # the emulated engine's own block-hash seed
BARRIER_WAIT_S = 5.0
IDLE_POLL_S = 0.01  # an empty step with requests waiting: look again this much later
TokenSink = asyncio.Queue[tuple[int, "int | Finished"]]  # (choice index, token or the end)


def next_token(seq: Sequence[int]) -> int:
    """The emulated model: deterministic, printable ASCII (32..126)."""
    return 32 + sum(seq[-4:]) % 95


@dataclass(slots=True)
class Tracked:
    """One sequence the HTTP side waits on."""

    tokens: list[int]  # prompt + output so far
    prompt_len: int
    stop_ids: frozenset[int]
    sink: TokenSink
    index: int  # its choice index in the HTTP answer
    head: tuple[int, ...] = ()  # its cache_salt's virtual block (core/blocks.namespace_block)
    lora: str | None = None  # the LoRA adapter it runs with


def _spelled(tracked: Tracked) -> Sequence[int]:
    """What the scheduler's cache holds for ``tracked``: its salt's virtual block, then its
    tokens."""
    return [*tracked.head, *tracked.tokens] if tracked.head else tracked.tokens


@dataclass(slots=True)
class LoopCounters:
    steps: int = 0
    busy_s: float = 0.0  # planned step durations, summed
    lag_s: float = 0.0  # how much later than planned steps ended, summed
    requests: int = 0  # sequences submitted
    finished: int = 0
    aborted: int = 0
    prompt_tokens: int = 0  # prompts of finished sequences
    generation_tokens: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache (vLLM's queries)
    prefix_hits: int = 0  # of which found cached
    peak_in_flight: int = 0
    lora_loads: int = 0  # cold adapters loaded (profile lora_slots / lora_load_s)
    last_planned_s: list[float] = field(default_factory=list)  # the last few steps' plans


class EngineLoop:
    """See the module docstring. ``run()`` is the loop's task; ``submit`` / ``abort`` feed it."""

    def __init__(self, profile: Profile, *, faults: Faults, time_scale: float = 1.0,
                 events: KvEventPublisher | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep) -> None:
        if not time_scale >= 0:
            raise ValueError(f"time_scale must be >= 0, got {time_scale}")
        self.profile = profile
        self.time_scale = time_scale
        self.faults = faults
        self.events = events
        self._clock, self._sleep = clock, sleep
        self.scheduler = self._new_scheduler()
        self.counters = LoopCounters()
        self._live: dict[int, Tracked] = {}
        self._aborts: set[int] = set()
        self._ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._timeline: float | None = None  # the last step's planned end, when busy since
        self._submitted_at = float("-inf")  # the last submit(): no step planned to start before
        # LoRA adapters loaded, least recent first: the first slots' worth at start
        self._resident = dict.fromkeys(profile.adapters[:profile.lora_slots])

    def _new_scheduler(self) -> Scheduler:
        return Scheduler(self.profile.scheduler_config(hash_seed=ENGINE_SEED))

    @property
    def in_flight(self) -> int:
        return len(self._live)

    # ------------------------------------------------------------------------- requests
    async def admission(self) -> None:
        """Wait what the engine spends between a request's arrival and its ``submit``
        (``profile.admission_s`` × the time scale); the loop steps on meanwhile."""
        delay = self.profile.admission_s * self.time_scale
        if delay > 0:
            await self._sleep(delay)

    def submit(self, prompt: Sequence[int], max_tokens: int, stop_ids: frozenset[int],
               sink: TokenSink, index: int = 0, cache_salt: str | None = None,
               lora: str | None = None) -> int:
        """A new sequence; its id. ValueError (naming the field) when it can never run.
        ``cache_salt`` (vLLM's): it reuses only prefixes computed with the same salt."""
        limit = self.profile.context_length
        if len(prompt) + max_tokens > limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, "
                f"{max_tokens} for the completion) (field max_tokens)")
        seq = next(self._ids)
        # as vLLM: a salt and an adapter each key the KV (the adapter every block)
        namespace = cache_salt if lora is None else f"lora:{lora}\x00{cache_salt or ''}"
        self._submitted_at = self._clock()
        self.scheduler.add(seq, list(prompt), max_tokens, self._submitted_at, namespace=namespace)
        head = ()
        if namespace is not None:
            head = namespace_block(namespace, self.profile.block_size)
            if self.events is not None:
                self.events.note_salt(cache_salt, head, lora)
        self._live[seq] = Tracked(list(prompt), len(prompt), stop_ids, sink, index, head, lora)
        self.counters.requests += 1
        self.counters.peak_in_flight = max(self.counters.peak_in_flight, len(self._live))
        self._wake.set()
        return seq

    def abort(self, seq: int) -> None:
        """The client went away: the sequence is aborted before the next step."""
        if seq in self._live:
            self._aborts.add(seq)
            self._wake.set()

    # ------------------------------------------------------------------------- the loop
    async def run(self) -> None:
        """Step until cancelled. A step that raises (a bug) is logged, every sequence in
        flight ends as aborted (its client gets an answer, not a hang) and the engine starts
        over with an empty cache: the server never dies with it."""
        while True:
            try:
                await self._run_once()
            except Exception:
                log.exception("emulated engine step failed; aborting %d sequences",
                              len(self._live))
                self._fail_all()

    async def _run_once(self) -> None:
        self._apply_aborts()
        if not (self.scheduler.running or self.scheduler.waiting):
            self._timeline = None
            self._wake.clear()
            await self._wake.wait()
            return
        if self.faults.barrier or self.faults.stalled:
            self._timeline = None  # held by a fault knob: no step was under way
        await self._hold_at_barrier()
        while self.faults.stalled:  # fault knob: a stopped process (SIGSTOP)
            await asyncio.sleep(0.01)
        await self.step_once()

    def _fail_all(self) -> None:
        now = self._clock()
        for seq, tracked in self._live.items():
            output = tuple(tracked.tokens[tracked.prompt_len:])
            tracked.sink.put_nowait((tracked.index, Finished(
                seq, tracked.prompt_len, 0, output, "abort", 0, now, None)))
        self._live.clear()
        self._aborts.clear()
        self.scheduler = self._new_scheduler()
        self._timeline = None
        if self.events is not None:
            self.events.publish_cleared()

    async def step_once(self) -> Step:
        """Plan one step, last its planned duration, apply it; the step."""
        now = self._clock()
        sched = self.scheduler
        step = sched.schedule(now)
        self._publish(step, [])
        if step.empty:
            self._timeline = None
            await self._sleep(IDLE_POLL_S)
            return step
        planned = self.planned_s(step) + self._load_loras(step)
        # straight after another step: from its planned end (the module docstring)
        start = (now if self._timeline is None
                 else max(self._timeline, now - planned, self._submitted_at))
        self._timeline = start + planned
        await self._sleep(max(start + planned - self._clock(), 0.0))
        if sched is not self.scheduler:
            return step  # restarted while the step ran: it never happened
        tokens = {seq: next_token(self._live[seq].tokens) for seq in step.emitting}
        stop = [seq for seq, tok in tokens.items() if tok in self._live[seq].stop_ids]
        for seq, tok in tokens.items():
            tracked = self._live[seq]
            tracked.tokens.append(tok)
            tracked.sink.put_nowait((tracked.index, tok))
        finished = self.scheduler.complete(step, tokens, self._clock(), stop)
        self._publish(step, finished)
        for fin in finished:
            self._finish(fin)
        self._account(planned, start)
        return step

    def planned_s(self, step: Step) -> float:
        """How long ``step`` lasts: the profile's step time × the time scale (+ a fault's
        extra delay)."""
        return self.profile.step_s(step) * self.time_scale + self.faults.token_delay_s

    def _load_loras(self, step: Step) -> float:
        """The step first loads the cold adapters its sequences need (as vLLM's LRU of
        ``--max-loras`` GPU slots): ``lora_load_s`` × the time scale each."""
        slots, cost = self.profile.lora_slots, 0.0
        if not slots:
            return 0.0
        seqs = [c.seq for c in step.prefills] + [d.seq for d in step.decodes]
        for lora in dict.fromkeys(t.lora for s in seqs if (t := self._live.get(s)) and t.lora):
            assert lora is not None
            if lora not in self._resident:
                cost += self.profile.lora_load_s * self.time_scale
                self.counters.lora_loads += 1
            self._resident.pop(lora, None)
            self._resident[lora] = None
            while len(self._resident) > slots:
                del self._resident[next(iter(self._resident))]
        return cost

    def _account(self, planned: float, start: float) -> None:
        c = self.counters
        c.steps += 1
        c.busy_s += planned
        c.lag_s += max(self._clock() - (start + planned), 0.0)
        c.last_planned_s = [*c.last_planned_s[-15:], planned]

    def _apply_aborts(self) -> None:
        if not self._aborts:
            return
        now = self._clock()
        for seq in sorted(self._aborts):
            fin = self.scheduler.abort(seq, now)
            if fin is not None:
                self._publish(None, [fin])
                self._finish(fin)
            else:
                self._live.pop(seq, None)
            self.counters.aborted += 1
        self._aborts.clear()

    async def _hold_at_barrier(self) -> None:
        """Fault knob: hold every step until ``barrier`` requests are in flight (then the
        barrier is spent), at most BARRIER_WAIT_S."""
        deadline = self._clock() + BARRIER_WAIT_S
        while self.faults.barrier and len(self._live) < self.faults.barrier:
            if self._clock() >= deadline:
                break
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), max(deadline - self._clock(), 0.0))
            except TimeoutError:
                break
        self.faults.barrier = 0

    def _finish(self, fin: Finished) -> None:
        tracked = self._live.pop(fin.seq, None)
        self._aborts.discard(fin.seq)
        c = self.counters
        c.finished += 1
        c.prompt_tokens += fin.prompt_tokens
        c.generation_tokens += len(fin.output)
        c.prefix_queries += fin.prompt_tokens
        c.prefix_hits += fin.cached_tokens
        if tracked is not None:
            tracked.sink.put_nowait((tracked.index, fin))

    # ------------------------------------------------------------------------- cache events
    def _publish(self, step: Step | None, finished: Sequence[Finished]) -> None:
        added, removed = self.scheduler.drain_cache_delta()
        if self.events is None or not (added or removed):
            return
        self.events.publish_delta(added, removed, self._spellers(step, finished))

    def _spellers(self, step: Step | None, finished: Sequence[Finished]
                  ) -> Iterator[Sequence[int]]:
        """Token sequences that may hold newly cached blocks: the step's, then all live."""
        if step is not None:
            for chunk in step.prefills:
                if chunk.seq in self._live:
                    yield _spelled(self._live[chunk.seq])
        for fin in finished:
            if fin.seq in self._live:
                yield _spelled(self._live[fin.seq])
        for tracked in list(self._live.values()):
            yield _spelled(tracked)

    # ------------------------------------------------------------------------- faults
    def restart(self) -> None:
        """A new engine incarnation: every sequence aborted (its sink told), empty cache."""
        now = self._clock()
        for seq, tracked in list(self._live.items()):
            fin = self.scheduler.abort(seq, now)
            if fin is not None:
                tracked.sink.put_nowait((tracked.index, fin))
        self._live.clear()
        self._aborts.clear()
        self.scheduler = self._new_scheduler()
        self._timeline = None
        if self.events is not None:
            self.events.reset()
        self._wake.set()

    def clear_cache(self) -> bool:
        """Drop the prefix cache and say so (AllBlocksCleared); like vLLM's
        ``reset_prefix_cache`` it does nothing (False) while sequences hold blocks."""
        if self.scheduler.running or self.scheduler.waiting or self._live:
            return False
        self.scheduler = self._new_scheduler()
        if self.events is not None:
            self.events.publish_cleared()
        return True
