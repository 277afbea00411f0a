"""Why did the node's index disagree with the engine? Each mismatch classified from the engine's
own KV-event stream.

Theory of operation
-------------------
With requests in flight together, the serving node predicts a request's cached tokens ``P``
when it accepts it (``x-radixmesh-cached-tokens``: its KV-event index match), and the engine
counts ``A`` when it schedules it (``usage.prompt_tokens_details.cached_tokens``); the cache
may change in between. The bench subscribes to every engine's publisher itself and keeps the
batches with their arrival time (:class:`TimedBatch`); per request it knows the prompt's token
ids and three client-side instants: sent, response headers (after the node accepted it), first
token. The rule is mechanical: events are replayed into a fresh :class:`EngineIndex` and read
with the very formula the node uses (:func:`radixmesh.engine.http_engine.exact_match`)::

    accepted window  = events that arrived in [sent - slack, headers + slack]
    index consistent = some replay point in that window gives exactly P
    own first store  = a BlockStored between acceptance and the first token whose first block
                       holds the prompt's tokens [A, A + engine block): what the request itself
                       stored first once scheduled (a store of those tokens before its
                       scheduling would have been a hit, unless evicted again, so each such
                       store is a candidate)
    R                = the replay up to (not including) a candidate store that gives A, else
                       the first candidate's; with no candidate (a full hit, or nothing left to
                       store) a replay point between acceptance and the first token whose
                       value is A stands in for it

    P != A and the index consistent and R == A  ->  timing: "evicted" (A < P: blocks the node
        counted were removed before the engine scheduled the request) or "inserted" (A > P:
        blocks stored by a request scheduled in between)
    P only at a replay point up to LAG_S either side of the window, or the own first store
        only up to LAG_S after the first token (none before), and R == A  ->  timing:
        "lagged" (the node's subscriber and the bench's saw a batch at moments further apart
        than ``slack``, or the bench saw the step's events after its tokens: either process
        starved on a loaded machine; a request's own store cannot come after its scheduling)
    anything else                               ->  "index_error" (with why)

``slack`` covers the few milliseconds between the bench's subscriber and the node's seeing the
same batch (two processes reading one PUB socket); the first-token bound gets a wider one
(``FIRST_SLACK_S``: vLLM publishes a step's events after the step, as its tokens go out).
Pure: no I/O, times are arguments.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from radixmesh.core.engine_index import EngineIndex
from radixmesh.core.kv_events import EngineBlockStored, KvBatch, KvEvent
from radixmesh.engine.http_engine import exact_match

DEFAULT_SLACK_S = 0.05
FIRST_SLACK_S = 0.5  # the step's events may reach the bench after its first token does
LAG_S = 1.0
CLASSES = ("match", "evicted", "inserted", "lagged", "index_error")


@dataclass(frozen=True, slots=True)
class TimedBatch:
    """One batch of one engine's publisher, as the bench's own subscriber received it."""

    t: float
    seq: int
    batch: KvBatch


@dataclass(frozen=True, slots=True)
class Seen:
    """One request as the client saw it (times on the bench's clock)."""

    id: str
    prompt: tuple[int, ...]
    predicted: int  # P: the serving node's index match at acceptance
    actual: int  # A: the engine's cached tokens
    t_sent: float
    t_headers: float
    t_first: float  # first token (the end of the stream if none came)


@dataclass(frozen=True, slots=True)
class Verdict:
    id: str
    kind: str  # one of CLASSES
    predicted: int
    actual: int
    replayed: int | None  # R; None: not computed (index inconsistent)
    why: str = ""

    def to_json(self) -> dict[str, object]:
        return {"id": self.id, "class": self.kind, "predicted": self.predicted,
                "actual": self.actual, "replayed": self.replayed, "why": self.why}


class EventStream:
    """One engine's events, flattened in arrival order, each with its batch's time."""

    def __init__(self, batches: Sequence[TimedBatch], block_size: int,
                 engine_block_size: int) -> None:
        ordered = sorted(batches, key=lambda b: (b.t, b.seq))
        self.events: list[KvEvent] = [e for b in ordered for e in b.batch.events]
        self.times: list[float] = [b.t for b in ordered for _ in b.batch.events]
        self.block_size = block_size
        self.engine_block_size = engine_block_size

    def position(self, t: float) -> int:
        """Events that had arrived by ``t``."""
        return bisect.bisect_right(self.times, t)

    def fresh_index(self) -> EngineIndex:
        return EngineIndex(self.block_size, 0, engine_block_size=self.engine_block_size)

    def own_stores(self, prompt: Sequence[int], cached: int, start: int, stop: int
                   ) -> list[int]:
        """Positions in ``[start, stop)`` of the BlockStored events whose first block holds
        ``prompt[cached : cached + engine block]`` (see the module docstring)."""
        eb = self.engine_block_size
        want = tuple(prompt[cached:cached + eb])
        if len(want) < eb:
            return []
        return [pos for pos in range(start, min(stop, len(self.events)))
                if isinstance(ev := self.events[pos], EngineBlockStored)
                and ev.token_ids[:eb] == want]

    def matches(self, prompt: Sequence[int], stop: int, start: int = 0) -> list[int]:
        """The replayed prediction after each of the first ``start .. stop`` events (index
        ``i`` of the result: after ``start + i`` events)."""
        index = self.fresh_index()
        for ev in self.events[:start]:
            index.apply_event(ev)
        out = [exact_match(index, prompt)]
        for ev in self.events[start:stop]:
            index.apply_event(ev)
            out.append(exact_match(index, prompt))
        return out


def classify(stream: EventStream, seen: Seen, slack_s: float = DEFAULT_SLACK_S) -> Verdict:
    """One request's verdict (the rule of the module docstring)."""
    p, a = seen.predicted, seen.actual
    lo = stream.position(seen.t_sent - slack_s)
    hi = stream.position(seen.t_headers + slack_s)
    first = max(stream.position(seen.t_first + FIRST_SLACK_S), hi)
    cuts = stream.own_stores(seen.prompt, a, lo, first)
    values = stream.matches(seen.prompt, first, lo)  # values[i]: after lo + i events
    lagged = False
    if p not in values[:hi - lo + 1]:
        early = stream.position(seen.t_sent - LAG_S)
        late = max(stream.position(seen.t_headers + LAG_S), lo)
        lagged = p in stream.matches(seen.prompt, late, early)
        if not lagged:
            return Verdict(seen.id, "index_error", p, a, None,
                           f"no replay point in the acceptance window gives {p} "
                           f"(window values {sorted(set(values[:hi - lo + 1]))})")
    if p == a:
        return Verdict(seen.id, "match", p, a, a)
    if not cuts:  # its own store may have reached the bench late: the bench's lag
        late = max(stream.position(seen.t_first + LAG_S), first)
        cuts = stream.own_stores(seen.prompt, a, first, late)
        if cuts:
            values = stream.matches(seen.prompt, late, lo)
            lagged = True
    if cuts:
        ok = any(values[c - lo] == a for c in cuts)
        replayed = a if ok else values[cuts[0] - lo]
        why = "" if ok else f"replay before its own first store gives {replayed}"
    else:
        ok = a in values
        replayed = a if ok else values[-1]
        why = "" if ok else f"no replay point up to its first token gives {a}"
    if not ok:
        return Verdict(seen.id, "index_error", p, a, replayed, why)
    kind = "lagged" if lagged else "evicted" if a < p else "inserted"
    return Verdict(seen.id, kind, p, a, replayed,
                   "own store found" if cuts else "no own store: window point")


@dataclass(slots=True)
class Tally:
    """Verdicts of one run."""

    verdicts: list[Verdict]

    def counts(self) -> dict[str, int]:
        c = Counter(v.kind for v in self.verdicts)
        return {k: c.get(k, 0) for k in CLASSES}

    def to_json(self, keep: int = 20) -> dict[str, object]:
        odd = [v.to_json() for v in self.verdicts if v.kind == "index_error"][:keep]
        timing = [v.to_json() for v in self.verdicts
                  if v.kind in ("evicted", "inserted", "lagged")]
        return {"counts": self.counts(), "index_errors": odd, "timing_examples": timing[:5]}


def classify_all(streams: Sequence[EventStream], seen: Sequence[tuple[int, Seen]],
                 slack_s: float = DEFAULT_SLACK_S) -> Tally:
    """Every request (``(engine, seen)``), against the stream of the engine that served it;
    an agreeing one is a match without a replay (the replays are what costs)."""
    return Tally([Verdict(s.id, "match", s.predicted, s.actual, s.actual)
                  if s.predicted == s.actual else classify(streams[i], s, slack_s)
                  for i, s in seen])


def stream_of(frames: Sequence[tuple[float, Sequence[bytes]]], block_size: int,
              engine_block_size: int) -> EventStream:
    """An engine's stream from its PUB messages ``(t, [topic, seq, payload])``; messages that
    fail to decode are left out (the caller counts them: ``len(frames) - len(batches)``)."""
    from radixmesh.core.codec import RemoteProtocolError
    from radixmesh.core.kv_events import decode_batch
    from radixmesh.core.kv_order import decode_live_frames

    batches: list[TimedBatch] = []
    for t, raw in frames:
        try:
            msg = decode_live_frames(raw)
            batches.append(TimedBatch(t, msg.seq, decode_batch(msg.payload)))
        except RemoteProtocolError:
            continue
    return EventStream(batches, block_size, engine_block_size)
