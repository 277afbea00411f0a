"""The simulated engine: the project's scheduler on virtual time, no tensors.

Theory of operation
-------------------
Scheduling and cache management are ``core.scheduler.Scheduler`` — continuous batching, chunked
prefill, one KV pool shared with ``core.prefix_cache.PrefixCache`` (LRU eviction, locks on
running sequences' prefixes, block-hash journal), recompute preemption — the very code the
emulated engine runs, so batching, queueing, cache hits, evictions and the block hashes gossiped
are those of a real node fed the same requests. Only the model is replaced: a step-time model
says how long each step lasts.

Step-time model: a ``core/profile.Profile`` when the run's cost model came from one
(``sim/costs.from_profile`` keeps it), with its scheduler limits (``max_running``,
``step_tokens``); otherwise :class:`CostSteps` over the legacy ``CostModel``, which times one
request at a time (``max_running`` 1, a whole prompt per step): a prefill chunk costs
``prefill_s(tokens, start)``, a request's overhead comes with its last chunk, each decode
``decode_s_per_token``. The KV pool is the node's ``cache_tokens`` (in whole blocks): prefix
cache and running sequences' KV together.

Admission: a profile's ``admission_s`` (``admission_s`` here; 0 for a legacy model, whose
request overhead is a step's) is the time from a request's arrival at the engine to its joining
the scheduler — what the emulated engine awaits before ``submit`` (``emulate/loop.py``). The
shell (``sim/shell.py``) calls :meth:`SimEngine.add` that long after the arrival, passing
the arrival time: the delay is the request's own (the steps of the others go on meanwhile) and
counts in its ``queue_s``, so in its TTFT.

Planning (``plan``) gives one step, or — when the next steps are the same pure-decode batch
(``Scheduler.decode_run``) — a run of ``k`` of them as one event: step ``j`` of a run lasts
``s0 + j * (s1 - s0)`` (a step-time model linear in the KV tokens attended, which both models
are), so the run lasts ``k * s0 + (s1 - s0) * k * (k - 1) / 2``. ``steps_by(elapsed)`` says how
many steps of a run have begun after ``elapsed`` seconds: a request arriving mid-run cuts it
there (the shell applies only those steps), so it is admitted at the next step boundary as on
a real engine. ``noise`` > 0 multiplies each planned duration by a mean-1 log-normal factor.

Output token ids are the caller's (the simulator does not sample): ``add`` takes them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from radixmesh.core.scheduler import Finished, Scheduler, SchedulerConfig, SeqId, Step
from radixmesh.sim.costs import CostModel

RUN_LIMIT = 4096  # most decode steps one event may stand for


class StepTimer(Protocol):
    def step_s(self, step: Step) -> float: ...


@dataclass(frozen=True, slots=True)
class CostSteps:
    """A legacy per-request ``CostModel`` as a step-time model (see the module docstring)."""

    cost: CostModel

    def step_s(self, step: Step) -> float:
        c = self.cost
        total = c.decode_s_per_token * len(step.decodes)
        for chunk in step.prefills:
            total += c.prefill_s(chunk.tokens, chunk.start)
            if chunk.last:
                total += c.request_overhead_s
        return total


@dataclass(frozen=True, slots=True)
class Planned:
    """What the engine runs next: one ``step``, or (``step`` None) ``k`` decode steps."""

    step: Step | None
    k: int
    first_s: float  # duration of its first step
    delta_s: float  # each further step of a decode run lasts this much longer
    duration_s: float  # the whole of it


@dataclass(frozen=True, slots=True)
class SimRun:
    """What a finished request's run measured on the virtual clock."""

    cached_tokens: int
    prefill_s: float  # admission to first token
    decode_s: float  # first token to the last
    service_s: float  # admission to the last token
    queue_s: float  # arrival at the engine to (last) admission: admission_s and the queue
    decode_tokens: int  # tokens generated (``len(output)``), as the runtime reports


class SimEngine:
    def __init__(
        self,
        cost: CostModel,
        cache_tokens: int,
        block_size: int,
        seed: int,
        noise: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        if cache_tokens < block_size:
            raise ValueError("cache_tokens must hold at least one block")
        if noise < 0:
            raise ValueError("noise must be >= 0")
        self.noise = noise  # sigma of a mean-1 log-normal factor on each step's time
        self._rng = rng or random.Random(0)
        kv_blocks = cache_tokens // block_size
        profile = cost.profile
        # arrival to joining the scheduler (module docstring); the shell applies it
        self.admission_s = 0.0 if profile is None else profile.admission_s
        if profile is not None:
            self.timer: StepTimer = profile
            config = profile.scheduler_config(
                block_size=block_size, kv_blocks=kv_blocks, hash_seed=seed
            )
        else:
            self.timer = CostSteps(cost)
            config = SchedulerConfig(block_size, kv_blocks, 1, 1 << 22, hash_seed=seed)
        self.sched = Scheduler(config)
        self.cache = self.sched.cache
        self._outputs: dict[SeqId, Sequence[int]] = {}
        self._emitted: dict[SeqId, int] = {}
        self._arrived: dict[SeqId, float] = {}

    # ----------------------------------------------------------------------------- queries
    def match(self, tokens: Sequence[int]) -> int:
        """Cached prefix length (read-only; what the node asks before routing)."""
        return self.cache.match(tokens)

    @property
    def total_tokens(self) -> int:
        return self.cache.total_tokens

    @property
    def evicted_tokens(self) -> int:
        return self.cache.evicted_tokens

    def drain_delta(self) -> tuple[list[int], list[int]]:
        return self.sched.drain_cache_delta()

    # ----------------------------------------------------------------------------- serving
    def add(self, seq: SeqId, tokens: Sequence[int], output: Sequence[int], now: float,
            arrived: float | None = None) -> None:
        """Queue a request whose generated ids will be ``output``, which arrived at the engine
        at ``arrived`` (default ``now``: no admission delay); ValueError if it can never fit
        the KV pool."""
        self.sched.add(seq, tokens, len(output), now)
        self._outputs[seq] = output
        self._emitted[seq] = 0
        self._arrived[seq] = now if arrived is None else arrived

    def plan(self, now: float, coalesce: bool) -> Planned | None:
        """The next step (or decode run, if ``coalesce``); None when idle."""
        k = self.sched.decode_run(RUN_LIMIT) if coalesce else 0
        factor = self._factor()
        if k >= 2:
            s0 = self.timer.step_s(self.sched.decode_step(0)) * factor
            d = self.timer.step_s(self.sched.decode_step(1)) * factor - s0
            return Planned(None, k, s0, d, k * s0 + d * k * (k - 1) / 2)
        step = self.sched.schedule(now)
        if step.empty:
            return None
        s = self.timer.step_s(step) * factor
        return Planned(step, 1, s, 0.0, s)

    @staticmethod
    def steps_by(planned: Planned, elapsed: float) -> int:
        """Steps of a decode run begun ``elapsed`` seconds after it started (at least 1)."""
        if planned.step is not None or elapsed <= 0:
            return 1
        a, b = planned.delta_s / 2, planned.first_s - planned.delta_s / 2
        if a > 1e-15:  # ends(j) = a j^2 + b j: the first j with ends(j) >= elapsed
            j = math.ceil((-b + math.sqrt(b * b + 4 * a * elapsed)) / (2 * a) - 1e-9)
        else:
            j = math.ceil(elapsed / b - 1e-9) if b > 0 else planned.k
        return max(1, min(planned.k, j))

    @staticmethod
    def cut(planned: Planned, k: int) -> Planned:
        """The first ``k`` steps of a decode run."""
        d, s0 = planned.delta_s, planned.first_s
        return Planned(None, k, s0, d, k * s0 + d * k * (k - 1) / 2)

    def apply(self, planned: Planned, now: float) -> list[tuple[Finished, SimRun]]:
        """Complete what ``plan`` planned (at its end, ``now``)."""
        if planned.step is None:
            seqs = [slot.seq for slot in self.sched.decode_step(0).decodes]
            runs = {seq: self._take(seq, planned.k) for seq in seqs}
            finished = self.sched.apply_decodes(planned.k, runs, now)
        else:
            tokens = {seq: self._take(seq, 1)[0] for seq in planned.step.emitting}
            finished = self.sched.complete(planned.step, tokens, now)
        return [(f, self._measured(f, now)) for f in finished]

    def _take(self, seq: SeqId, n: int) -> Sequence[int]:
        """The next ``n`` output ids of ``seq`` (kept across a preemption: outputs are)."""
        i = self._emitted[seq]
        self._emitted[seq] = i + n
        return self._outputs[seq][i : i + n]

    def _measured(self, f: Finished, now: float) -> SimRun:
        del self._outputs[f.seq], self._emitted[f.seq]
        arrived = self._arrived.pop(f.seq)
        first = now if f.first_token_at is None else f.first_token_at
        return SimRun(
            f.cached_tokens, first - f.admitted_at, now - first, now - f.admitted_at,
            f.admitted_at - arrived, len(f.output),
        )

    def _factor(self) -> float:
        """Run-time noise of a real machine (other processes, caches): a log-normal factor
        with mean 1, so the step-time model stays the mean."""
        if self.noise <= 0:
            return 1.0
        s = self.noise
        return self._rng.lognormvariate(-s * s / 2, s)
