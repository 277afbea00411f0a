"""What a batching engine's state says about a new request's time to first token (TTFT).

Theory of operation
-------------------
A continuous-batching engine (``core/scheduler.py``: vLLM's scheduler) does not serve its
queue one request at a time: every step computes the decode token of every running sequence
and, within the step's token budget, the next prompt chunks of the admitted ones, waiting
requests first come first served. So a new request's first token comes at the end of the
step that computes its last prompt chunk, and until then it waits for

* what is left of the step under way (``residual_s``);
* the prompt tokens ahead of it (``ahead_tokens``, whose compute time without the steps'
  fixed part is ``ahead_s``, attention over their context included);
* the fixed part of every step it takes to get through those and its own tokens: the
  profile's step base plus the decodes riding along (``decode_seq_s`` per decoding sequence,
  ``decode_kv_s`` per KV token they attend to), ``ceil((ahead + own) / (step_tokens -
  decoding))`` steps;
* when the engine is full (``max_running`` sequences, or KV for fewer tokens than it needs)
  the soonest finish of a running sequence (``free_s``);
* what the node measured its engine's first tokens to take beyond its shadow's predictions
  (``overhead_s``: HTTP, the engine's lag behind its profile, the node's own event loop).

:class:`BatchState` carries exactly what that needs — the engine's profile coefficients (so
no configuration says which node is faster: an A10G's report says it), its capacities, and
its current batch — in a fixed 76-byte record a node gossips with its load
(``messages.Load.batch``). A node builds its own from its shadow of the engine
(``core/shadow.py``); a peer's is aged by :func:`aged` (the work ahead drains at the engine's
speed while the report travels; our forwards since are added).

:func:`ttft_parts` splits the prediction into the wait (what is ahead) and the request's own
prefill, which the cost model (``core/cost_model.py``) uses in place of its FIFO queue for
nodes that report a batch. Pure functions of their arguments.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, replace

# coefficients (5 floats), capacities and batch (9 unsigned ints), timings (4 floats),
# the measured overhead (1 float)
_PACK = struct.Struct("<5f9I5f")
_U32 = (1 << 32) - 1
BATCH_REFRESH_ROUNDS = 8  # gossip intervals a peer's unchanged copy is left to age at most


@dataclass(frozen=True, slots=True)
class BatchState:
    """A batching engine's step-time coefficients, capacities and current batch (seconds in
    the node's clock: a time-scaled emulated engine reports its coefficients scaled)."""

    step_base_s: float
    prefill_token_s: float
    prefill_attn_s: float
    decode_seq_s: float
    decode_kv_s: float
    step_tokens: int  # prompt + decode tokens per step
    max_running: int  # sequences admitted at once
    kv_tokens: int  # KV capacity in tokens
    running: int  # sequences admitted (prefilling or decoding)
    waiting: int  # sequences not admitted yet
    decoding: int  # sequences past their prefill
    decode_kv: int  # KV tokens the decoding sequences attend to
    ahead_tokens: int  # prompt tokens still to prefill (waiting and prefilling sequences)
    kv_used: int  # KV tokens held by running sequences
    ahead_s: float  # the compute of those prompt tokens, without the steps' fixed part
    residual_s: float  # what is left of the step under way (0: idle)
    free_s: float  # until the soonest running sequence finishes (0: none running)
    rate: float  # requests added per second lately
    # how much longer than its shadow predicted the engine's first tokens lately came (HTTP,
    # the engine's own lag, the node's event loop): measured, signed (``Shadow.first_token``)
    overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("step_base_s", "prefill_token_s", "prefill_attn_s", "decode_seq_s",
                     "decode_kv_s", "ahead_s", "residual_s", "free_s", "rate"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"batch.{name} must be a finite number >= 0, got {value}")
        if not math.isfinite(self.overhead_s):
            raise ValueError("batch.overhead_s must be finite")
        for name in ("step_tokens", "max_running", "kv_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"batch.{name} must be >= 1")
        for name in ("running", "waiting", "decoding", "decode_kv", "ahead_tokens", "kv_used"):
            if not 0 <= getattr(self, name) <= _U32:
                raise ValueError(f"batch.{name} must be in [0, 2**32)")

    def step_fixed_s(self, decoding: int, decode_kv: int) -> float:
        """The part of a step that does not depend on its prompt tokens."""
        return self.step_base_s + self.decode_seq_s * decoding + self.decode_kv_s * decode_kv

    def prefill_compute_s(self, tokens: int, start: int) -> float:
        """Compute of ``tokens`` prompt tokens after ``start`` already in KV (no fixed part)."""
        if tokens <= 0:
            return 0.0
        return tokens * (self.prefill_token_s + self.prefill_attn_s * (start + tokens / 2.0))

    def marginal_prefill_s(self, uncached: int, cached: int) -> float:
        """What a prompt of ``uncached`` tokens after ``cached`` adds to the prefill of a
        request queued behind it: its compute, and a step's fixed part in the proportion of a
        step's token budget it takes (the one behind spills into one more step that often)."""
        budget = max(1, self.step_tokens - self.decoding)
        fixed = self.step_fixed_s(self.decoding, self.decode_kv)
        return self.prefill_compute_s(uncached, cached) + fixed * min(uncached, budget) / budget

    def pack(self) -> bytes:
        return _PACK.pack(
            self.step_base_s, self.prefill_token_s, self.prefill_attn_s, self.decode_seq_s,
            self.decode_kv_s, self.step_tokens, self.max_running, self.kv_tokens,
            min(self.running, _U32), min(self.waiting, _U32), min(self.decoding, _U32),
            min(self.decode_kv, _U32), min(self.ahead_tokens, _U32), min(self.kv_used, _U32),
            self.ahead_s, self.residual_s, self.free_s, self.rate, self.overhead_s)

    @classmethod
    def unpack(cls, raw: bytes) -> BatchState:
        """The inverse of :meth:`pack`; ValueError for a malformed record."""
        if len(raw) != _PACK.size:
            raise ValueError(f"batch: expected {_PACK.size} bytes, got {len(raw)}")
        return cls(*_PACK.unpack(raw))


PACKED_SIZE = _PACK.size


def ttft_parts(b: BatchState, uncached: int, cached: int) -> tuple[float, float]:
    """(wait, own prefill) of a request computing ``uncached`` prompt tokens after ``cached``
    reused ones, added to the engine now (module docstring). The wait holds the step under
    way, the prompt work ahead and, when the engine is full, the soonest finish; the own part
    its compute and the fixed part of the steps it adds."""
    uncached = max(uncached, 1)  # an engine always computes one token: there must be logits
    budget = max(1, b.step_tokens - b.decoding)
    fixed = b.step_fixed_s(b.decoding, b.decode_kv)
    steps_ahead = b.ahead_tokens // budget  # whole steps of others' prompts before ours
    steps_all = -(-(b.ahead_tokens + uncached) // budget)
    wait = max(0.0, b.residual_s + b.ahead_s + steps_ahead * fixed + b.overhead_s)
    if b.running + b.waiting >= b.max_running or b.kv_used + uncached + cached > b.kv_tokens:
        wait += b.free_s
    own = b.prefill_compute_s(uncached, cached) + (steps_all - steps_ahead) * fixed
    return wait, own


def decode_s(b: BatchState, max_tokens: int, context: int) -> float:
    """The decode steps after the first token of a request whose ``context`` is its prompt:
    ``max_tokens - 1`` steps of the current batch with it added."""
    steps = max(0, max_tokens - 1)
    if steps == 0:
        return 0.0
    return steps * b.step_fixed_s(b.decoding + 1, b.decode_kv + context + steps // 2)


def aged(b: BatchState, age_s: float, added_tokens: int = 0, added: int = 0) -> BatchState:
    """A peer's report ``age_s`` old, with ``added`` requests of ``added_tokens`` prompt
    tokens sent there since (ours, which the report cannot count): the work ahead drained at
    the engine's speed meanwhile (it computes the prompts ahead back to back), the step
    under way ended. Others' requests sent meanwhile are unknown (the report's rate says
    how many to expect: they are not invented here)."""
    age = max(age_s, 0.0)
    left = max(0.0, b.residual_s + b.ahead_s - age)
    ahead_s = min(b.ahead_s, left)
    share = ahead_s / b.ahead_s if b.ahead_s > 0 else 0.0
    tokens = int(b.ahead_tokens * share)
    if added_tokens > 0:
        ahead_s += b.prefill_compute_s(added_tokens, 0)
        tokens += added_tokens
    residual = max(0.0, b.residual_s - age)
    if residual == 0.0 and (tokens > 0 or b.decoding > 0):
        residual = b.step_fixed_s(b.decoding, b.decode_kv) / 2.0  # some step is under way
    return replace(b, ahead_s=ahead_s, ahead_tokens=tokens, residual_s=residual,
                   waiting=b.waiting + added, free_s=max(0.0, b.free_s - age))


def changed(sent: BatchState, now: BatchState, tolerance: float = 0.2) -> bool:
    """Whether ``now`` differs materially from the report last sent (``sent``, aged to now
    as its receivers age it): the TTFT it predicts for a 512-token prompt off by more than
    ``tolerance`` of it and two steps' fixed part, its arrival rate by more than
    ``tolerance`` (and 0.1 per second). Unchanged reports are not
    gossiped again (:func:`worth_sending`): a receiver's own aging is as good."""
    moved, material = _moved(sent, now, tolerance)
    if abs(moved) > material:
        return True
    return abs(now.rate - sent.rate) > max(tolerance * now.rate, 0.1)


def grew(sent: BatchState, now: BatchState, tolerance: float = 0.2) -> bool:
    """Whether ``now`` predicts a TTFT materially longer than ``sent`` (aged to now) does:
    the change (:func:`changed`'s measure) that sends a peer's forwards into a queue."""
    moved, material = _moved(sent, now, tolerance)
    return moved > material


def _moved(sent: BatchState, now: BatchState, tolerance: float) -> tuple[float, float]:
    """How much longer ``now`` predicts a 512-token prompt's TTFT than ``sent``, and the
    change worth telling: ``tolerance`` of that TTFT and two steps' fixed part."""
    ref_now = sum(ttft_parts(now, 512, 0))
    return ref_now - sum(ttft_parts(sent, 512, 0)), max(tolerance * ref_now, 2.0 * now.step_base_s)


def worth_sending(last: tuple[BatchState, float] | None, batch: BatchState, now: float,
                  interval_s: float, horizon_s: float | None = None) -> bool:
    """Whether a message to a peer carries ``batch`` (this node's, as of ``now``), given
    ``last``: the one last sent to that peer, and when (``PeerEstimate.batch_sent``). Yes
    when it has none, or it is ``BATCH_REFRESH_ROUNDS`` gossip intervals old, or it
    :func:`changed` materially, compared half a ``horizon_s`` on (when the receiver uses it
    on average: until our next round, ``interval_s`` unless announcements bring it forward):
    a prompt computed by then is news to nobody, a queue, a decode batch or a rate that
    lasts is. Compared half a round (0.25 s) on while announcements came every 50 ms, a
    cold prompt queued at an H100 (tens of ms) was never sent: 24 simulated 16-H100 RAG
    runs at 80 %, forwards' TTFT forecast 26.1 -> 24.5 % median error, refused forwards
    0.010 -> 0.006 a request, TTFT 0.974x, p99 0.946x. Sent with every load report, the
    76-byte record was most of a busy batching node's gossip (``microbench --only
    gossip``: ``delta_bytes_per_s_batch``). Per peer: a round reaches ``fanout`` of them
    (3), so a node-wide "last sent" left the others with a batch up to
    ``BATCH_REFRESH_ROUNDS`` old (16 emulated H100s: peers' predicted
    TTFT p90 off by 132 % instead of ~36 %)."""
    if last is None or now - last[1] >= BATCH_REFRESH_ROUNDS * interval_s:
        return True
    half = (interval_s if horizon_s is None else horizon_s) / 2.0
    return changed(aged(last[0], now - last[1] + half), aged(batch, half))
