"""The node's shadow of an external batching engine: the core scheduler on the node's clock.

Theory of operation
-------------------
A node fronting an engine it does not run (vLLM, SGLang, ``radixmesh emulate``) knows what
it sent there and what came back, and the engine's profile (``core/profile.py``; ``serve
--profile``). :class:`Shadow` runs the one engine scheduler (``core/scheduler.py``) over
those requests on the node's own clock, each step lasting what the profile predicts (times
``time_scale`` for a time-scaled emulated engine), so the node knows, at any moment, what
the engine is doing: which sequences wait, which prefill how far, which decode, how much
KV they hold. Its prefix cache is the scheduler's own (same block size and capacity as the
engine's), so what a queued request will reuse is the scheduler's answer too.

It is reconciled with what the engine reports, so it never drifts far:

* :meth:`Shadow.first_token` — the engine sent a request's first token: if the shadow has
  not computed that prompt yet it is behind (the engine is faster than its profile), and
  its steps are run at once until it has (bounded);
* :meth:`Shadow.finished` — the engine ended a request (done, stopped early, failed,
  aborted): the shadow drops it if still live. A shadow ahead of its engine finishes a
  request early, and keeps it at most until then;
* :meth:`Shadow.observe` — the engine's ``/metrics`` (running, waiting, KV usage;
  ``core/engine_report.py``, polled by ``runtime/engine_metrics.py``): what it runs beyond
  this node's open requests (another router's, a direct client's) is *foreign* load
  (``engine_report.reconcile``). Foreign waiting requests become ghost requests in the
  scheduler (prompt and output of the node's own recent mean, unique token ids that share
  no cache block), which queue, prefill and decode as any; foreign running ones the shadow
  does not carry as ghosts ride every step as ghost decodes (their count and KV, reported
  in the state as running, decoding and KV held). The next report trims or adds ghosts.

:meth:`Shadow.state` is the engine's batch as :class:`~radixmesh.core.shadow_state.BatchState`
(what the node's router uses for itself and gossips to its peers); :meth:`Shadow.add`
returns the TTFT it predicts for the request added, from the state just before (exact
for this node's own engine but for the profile's error); the first token's lateness
against the shadow's own prediction (the same without the overhead) is the overhead the
state reports (the median of the last ``OVERHEAD_WINDOW`` of the last ``OVERHEAD_AGE_S``:
what HTTP, the engine's lag and the node's own event loop add). Pure: ``now`` is passed in.

Cost: a step is the scheduler's (O(running)); :meth:`state` is O(live requests), cached
until the next change. :meth:`advance` runs at most ``MAX_STEPS`` steps per call (a node
asleep for long jumps its clock instead of replaying every step).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from statistics import median

from radixmesh.core.engine_report import NO_FOREIGN, EngineReport, Foreign, reconcile
from radixmesh.core.load_estimates import ArrivalRate
from radixmesh.core.profile import Profile
from radixmesh.core.scheduler import Scheduler, SeqId, Step
from radixmesh.core.shadow_state import BatchState, ttft_parts

MAX_STEPS = 4096  # steps one advance() may run; a longer gap jumps the clock
SYNC_STEPS = 256  # steps first_token() may run at once to catch up with the engine
RATE_WINDOW_S = 10.0  # the arrival rate's time constant, in profile seconds
RATE_MIN_SPAN = 0.01  # its floor on the time observed, in windows (load_estimates.ArrivalRate)
OVERHEAD_WINDOW = 31  # the last first tokens whose lateness the overhead is the median of,
OVERHEAD_AGE_S = 0.25  # ... those of this many profile seconds (~10 TTFTs of an idle H100)
MAX_GHOSTS = 256  # foreign requests carried as ghost requests at most
GHOST_TOKEN = 1 << 30  # ghost prompts' token ids (real ones lie below, namespaces' at 2**31)
MEAN_SHARE = 0.1  # one request's weight in the running means a ghost is sized by


def scaled(profile: Profile, time_scale: float) -> Profile:
    """``profile`` with every step-time coefficient ``time_scale`` times larger."""
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    return replace(profile, step_base_s=profile.step_base_s * time_scale,
                   prefill_token_s=profile.prefill_token_s * time_scale,
                   prefill_attn_s=profile.prefill_attn_s * time_scale,
                   decode_seq_s=profile.decode_seq_s * time_scale,
                   decode_kv_s=profile.decode_kv_s * time_scale,
                   admission_s=profile.admission_s * time_scale,
                   prefill_seq_s=profile.prefill_seq_s * time_scale,
                   lora_load_s=profile.lora_load_s * time_scale)


@dataclass(slots=True)
class _Track:
    """One live request as the shadow follows it."""

    emitted: int = 0  # tokens generated


class Shadow:
    """The shadow scheduler of one external engine (see the module docstring)."""

    def __init__(self, profile: Profile, time_scale: float = 1.0) -> None:
        self.profile = scaled(profile, time_scale)
        self._sched = Scheduler(profile.scheduler_config())
        self._tracks: dict[SeqId, _Track] = {}
        self._step: Step | None = None
        self._clock = 0.0  # when the step under way began, or the shadow last idled
        self._step_end = 0.0
        self._state: BatchState | None = None
        self._arrivals = ArrivalRate(RATE_WINDOW_S * time_scale, RATE_MIN_SPAN)
        self._predicted: dict[SeqId, tuple[float, float]] = {}  # seq -> (added at, TTFT)
        # the median lateness of the last first tokens, from the profile's admission time
        # (HTTP, tokenising: core/profile.py) while none is recent: a burst's lateness must
        # not outlive it (a node that looks slow gets no first tokens to correct it)
        self._overhead = self.profile.admission_s
        self._lateness: deque[tuple[float, float]] = deque(maxlen=OVERHEAD_WINDOW)
        self._overhead_age = OVERHEAD_AGE_S * time_scale
        self.synced_steps = 0  # steps run at once to catch up with the engine
        self.jumps = 0  # advances that jumped the clock
        self._open: set[SeqId] = set()  # own requests added and not finished by the node
        self._ghosts: dict[SeqId, None] = {}  # foreign requests in the scheduler, oldest first
        self._ghost_ids = 0
        self._ghost_decodes = (0, 0)  # foreign running not carried as ghosts: count, KV
        self._mean_prompt, self._mean_output = 512.0, 64.0  # own uncached prompt, max_tokens
        self.foreign: Foreign = NO_FOREIGN  # the engine's load beyond ours, as last reported
        self.reports = 0  # engine reports observed

    # ------------------------------------------------------------------------ requests
    def add(self, seq: SeqId, prompt: Sequence[int], max_tokens: int, now: float,
            cached: int | None = None) -> float:
        """The node sent the engine a request; returns the TTFT predicted for it, with
        ``cached`` prompt tokens reused (default: the shadow's cache now; the node's own
        estimate also counts what requests queued before it will have cached)."""
        self.advance(now)
        if cached is None:
            cached = self._sched.cached_prefix(prompt)
        state = self.state(now)
        wait, own = ttft_parts(state, len(prompt) - cached, cached)
        # the prediction its first token's lateness is measured against: the shadow's alone,
        # without the overhead (its wait clamped at 0 with a negative overhead added, a
        # first token on time read as early and held the overhead where it was)
        raw = sum(ttft_parts(replace(state, overhead_s=0.0), len(prompt) - cached, cached))
        try:
            self._sched.add(seq, prompt, max_tokens, now)
        except ValueError:
            return wait + own  # never fits this engine: the engine will refuse it too
        self._tracks[seq] = _Track()
        self._open.add(seq)
        self._mean_prompt += MEAN_SHARE * (max(len(prompt) - cached, 1) - self._mean_prompt)
        self._mean_output += MEAN_SHARE * (max_tokens - self._mean_output)
        self._arrivals.add(now)
        self._predicted[seq] = (now, raw)
        if self._step is None:
            self._clock = now
        self._state = None
        return wait + own

    def first_token(self, seq: SeqId, now: float) -> None:
        """The engine sent ``seq``'s first token: catch up if the shadow has not; how much
        later than predicted it came feeds the overhead the state reports."""
        self.advance(now)
        added = self._predicted.pop(seq, None)
        if added is not None:  # the median, not the mean: a few requests that a burst
            self._lateness.append((now, now - added[0] - added[1]))  # delayed must not
            self._remeasure()  # shift all
        track = self._tracks.get(seq)
        runs = 0
        while track is not None and track.emitted == 0 and runs < SYNC_STEPS:
            if not self._run_step(now, at_once=True):
                break
            runs += 1
            track = self._tracks.get(seq)
        self.synced_steps += runs

    def finished(self, seq: SeqId, now: float) -> None:
        """The engine ended ``seq`` (however): drop it if the shadow still runs it."""
        self.advance(now)
        self._predicted.pop(seq, None)
        self._open.discard(seq)
        if self._tracks.pop(seq, None) is not None:
            self._sched.abort(seq, now)
            self._state = None

    # ------------------------------------------------------------------------ stepping
    def advance(self, now: float) -> None:
        """Run the steps that end by ``now``."""
        for _ in range(MAX_STEPS):
            if self._step is None and not self._plan(max(self._clock, 0.0)):
                self._clock = max(self._clock, now)
                return
            if self._step_end > now:
                return
            self._run_step(now, at_once=False)
        self.jumps += 1  # a long sleep: start again from now
        self._clock = now
        if self._step is not None:
            self._step_end = now

    def _plan(self, at: float) -> bool:
        step = self._sched.schedule(at)
        if step.empty:
            return False
        self._step, self._clock = step, at
        n, kv = self._ghost_decodes
        p = self.profile
        self._step_end = at + p.step_s(step) + p.decode_seq_s * n + p.decode_kv_s * kv
        self._state = None
        return True

    def _run_step(self, now: float, at_once: bool) -> bool:
        """Complete the step under way (planning one if none); False: nothing to run."""
        if self._step is None and not self._plan(self._clock if not at_once else now):
            return False
        step = self._step
        assert step is not None
        end = now if at_once else self._step_end
        done = self._sched.complete(step, dict.fromkeys(step.emitting, 0), end)
        self._apply(step)
        for fin in done:
            self._tracks.pop(fin.seq, None)
            self._ghosts.pop(fin.seq, None)
        self._step, self._clock = None, end
        self._state = None
        return True

    def _apply(self, step: Step) -> None:
        for seq in step.emitting:
            track = self._tracks.get(seq)
            if track is not None:
                track.emitted += 1

    # ------------------------------------------------------------------------ reading
    def cached_prefix(self, prompt: Sequence[int]) -> int:
        """Prompt tokens the engine would reuse if ``prompt`` were added now."""
        return self._sched.cached_prefix(prompt)

    @property
    def live(self) -> int:
        return len(self._tracks)

    def state(self, now: float) -> BatchState:
        """The engine's batch now (the steps due run first; cached until the next change
        but for what moves with time alone: the step's residual, the arrival rate decayed
        to ``now``, as the simulator reports it; the overhead once its samples age out)."""
        self.advance(now)
        self._expire_lateness(now)
        if self._state is None:
            self._state = self._build()
        residual = max(0.0, self._step_end - now) if self._step is not None else 0.0
        return replace(self._state, residual_s=residual, rate=self._arrivals.at(now))

    def _expire_lateness(self, now: float) -> None:
        """Drop first tokens' lateness older than the overhead's age."""
        late, cutoff = self._lateness, now - self._overhead_age
        if not late or late[0][0] >= cutoff:
            return
        while late and late[0][0] < cutoff:
            late.popleft()
        self._remeasure()

    def _remeasure(self) -> None:
        """The overhead from the lateness kept: its median; none kept, the prior."""
        late = self._lateness
        self._overhead = median(x for _, x in late) if late else self.profile.admission_s
        self._state = None

    def _build(self) -> BatchState:
        b = batch_state(self._sched, self.profile, self._step, 0.0, 0.0, self._overhead)
        n, kv = self._ghost_decodes
        if n == 0:
            return b
        return replace(b, running=b.running + n, decoding=b.decoding + n,
                       decode_kv=b.decode_kv + kv, kv_used=min(b.kv_used + kv, b.kv_tokens))

    # ------------------------------------------------------------------------ the engine's view
    def observe(self, report: EngineReport, now: float) -> Foreign:
        """The engine's ``/metrics`` now: carry what it runs beyond this node's open requests
        (module docstring); returns that foreign load."""
        self.advance(now)
        running = {v.seq: v.computed for v in self._sched.sequences() if v.admitted}
        own_running = [kv for seq, kv in running.items() if seq in self._tracks]
        cfg = self._sched.config
        f = reconcile(report, len(self._open), len(self._tracks) - len(own_running),
                      sum(own_running), cfg.kv_blocks * cfg.block_size)
        ghost_run = [g for g in self._ghosts if g in running]
        ghost_wait = [g for g in self._ghosts if g not in running]
        for g in ghost_wait[f.waiting:] + ghost_run[f.running:]:  # the newest go first
            self._sched.abort(g, now)
            del self._ghosts[g]
        for _ in range(min(f.waiting - len(ghost_wait), MAX_GHOSTS - len(self._ghosts))):
            self._add_ghost(now)
        kept = ghost_run[:f.running]
        n = f.running - len(kept)
        self._ghost_decodes = (n, max(0, f.kv_tokens - sum(running[g] for g in kept)) if n
                               else 0)
        self.foreign = f
        self.reports += 1
        self._state = None
        if self._step is None:
            self._clock = max(self._clock, now)
        return f

    def forget_foreign(self, now: float) -> None:
        """Drop the foreign load (the engine's reports stopped: none is better than stale)."""
        self.advance(now)
        for g in list(self._ghosts):
            self._sched.abort(g, now)
        self._ghosts.clear()
        self._ghost_decodes, self.foreign, self._state = (0, 0), NO_FOREIGN, None

    def _add_ghost(self, now: float) -> None:
        """One foreign waiting request, sized as this node's own lately: its first token
        unique (its blocks hit no cache and nobody hits them)."""
        self._ghost_ids += 1
        seq = -self._ghost_ids
        length = max(1, round(self._mean_prompt))
        prompt = [GHOST_TOKEN + self._ghost_ids % GHOST_TOKEN] + [GHOST_TOKEN] * (length - 1)
        try:
            self._sched.add(seq, prompt, max(1, round(self._mean_output)), now)
        except ValueError:
            return  # never fits this engine
        self._ghosts[seq] = None


def batch_state(sched: Scheduler, p: Profile, under_way: Step | None, residual_s: float,
                rate: float, overhead_s: float, decoded: int = 0) -> BatchState:
    """The state of an engine running ``sched`` with step times ``p``: its sequences' work
    ahead and decodes (``Scheduler.sequences``), the prompt chunks of the step ``under_way``
    counted as done (``residual_s`` covers them), and ``decoded`` decode steps done that
    ``sched`` has not applied yet (the simulator's runs of decode steps, one event each).
    The shadow's and the simulator's alike."""
    done = {} if under_way is None else {c.seq: c.start + c.tokens for c in under_way.prefills}
    decoding = decode_kv = ahead = running = waiting = 0
    ahead_s, soonest = 0.0, None
    for v in sched.sequences():
        running += v.admitted
        waiting += not v.admitted
        computed = done.get(v.seq, v.computed)
        left = v.prompt - computed
        if left > 0:
            ahead += left
            ahead_s += _compute(p, left, computed)
            continue
        decoding += 1
        decode_kv += v.prompt + v.emitted + decoded
        remaining = v.max_tokens - v.emitted - decoded
        soonest = remaining if soonest is None else min(soonest, remaining)
    waiting += max(0, sched.waiting - waiting)  # beyond the window: counted, not priced
    fixed = p.step_base_s + p.decode_seq_s * decoding + p.decode_kv_s * decode_kv
    cfg = sched.config
    kv = cfg.kv_blocks * cfg.block_size
    return BatchState(
        p.step_base_s, p.prefill_token_s, p.prefill_attn_s, p.decode_seq_s, p.decode_kv_s,
        cfg.step_tokens, cfg.max_running, kv, running, waiting, decoding, decode_kv, ahead,
        int(sched.kv_usage * kv), ahead_s, residual_s,
        0.0 if soonest is None else soonest * fixed, rate, overhead_s)


def _compute(p: Profile, tokens: int, start: int) -> float:
    """A sequence's prompt work left (with the profile's per-prefill cost, once)."""
    if tokens <= 0:
        return 0.0
    per_token = p.prefill_token_s + p.prefill_attn_s * (start + tokens / 2.0)
    return p.prefill_seq_s + tokens * per_token
