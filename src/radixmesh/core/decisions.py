"""The node's recent routing decisions, kept so that a surprising one can be explained.

A request's latency on a real cluster says *where* it ran; only the entry node knew *why*:
what it believed, at that moment, about every candidate's cache, queue and speed. Without
that record, a decision that went wrong (a cold copy of a prefix another node held, a
forward into a busy holder) can be seen but not diagnosed. Each ranking the node makes for a
request of its own (its first, and each re-ranking after a refusal or a failed forward) is
kept here as a :class:`Decision`: the inputs the router saw and what it chose; and each
verdict on a peer's forward (the other side of such a choice) as an :class:`Admission`: what
serving it here would cost, against what the sender said it must beat. The log is a ring
of ``capacity`` decisions and one of as many admissions (the oldest go first; 0 keeps none),
so it costs a bounded amount of memory however long the node runs.

The runtime serves it at ``GET /mesh/decisions`` and `radixmesh bench` saves every node's
log beside each run's records (``decisions/<run>.jsonl``), where ``scripts/why.py`` joins
the two by the entry node's request number (``x-radixmesh-request``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from radixmesh.core.cost_model import Candidate, NodeInfo, Placement

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Considered:
    """One node as the deciding node saw it, and the router's verdict on it."""

    node_id: str
    is_self: bool
    cached_tokens: int  # estimated cached prefix of the request (exact for self)
    queue_depth: float  # expected queue on arrival (exact for self)
    utilization: float
    rtt_s: float
    wait_error_s: float
    prefill_overhead_s: float  # its speed as reported (before the robust-speed rule)
    prefill_s_per_token: float
    decode_s_per_token: float
    mean_service_s: float
    queue_service_s: float | None  # what one place in its queue costs (self only)
    suspect: bool
    pushed_back: bool
    # None where the router did not rank it (unavailable: suspect or pushed back)
    rank: int | None
    predicted_latency_s: float | None
    cost_s: float | None  # the cost policy's mesh cost (``router.mesh_cost``)
    placement: str | None  # the placement tag a choice of it would have had
    predicted_ttft_s: float | None = None  # its predicted time to first token (rtt included)
    kv_usage: float = 0.0  # its KV cache's fill as last reported
    lateness_s: float = 0.0  # how late it lately met our forwards: mean (ranks), median
    lateness_median_s: float = 0.0  # (forecasts); 0 for self
    # a batching engine's batch as the router saw it (``BatchState``'s counts and times:
    # exact for self, a peer's report aged); None: not a batching engine
    batch: dict[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


BATCH_FIELDS = ("running", "waiting", "decoding", "ahead_tokens", "kv_used", "kv_tokens",
                "ahead_s", "residual_s", "free_s", "rate", "overhead_s", "step_base_s")


@dataclass(frozen=True, slots=True)
class Decision:
    """One ranking of one request at its entry node."""

    seq: int  # this node's decision number (0, 1, ...): a gap in a read means evicted ones
    at: float  # the node's clock
    request: int  # the entry node's request number (``x-radixmesh-request``)
    again: bool  # a re-ranking after a refused or failed forward (False: the first)
    prompt_tokens: int
    max_tokens: int
    owners: tuple[str, ...]  # the prefix's owner set (cost policy with placement; else ())
    held_tokens: int | None  # a node holds the prefix with this much of it cached
    rent_s: float | None
    chosen: str  # the head of the ranking (the node tried first)
    placement: str | None  # its placement tag
    considered: tuple[Considered, ...]  # every node the router was given, ranked ones first

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: getattr(self, name) for name in self.__slots__}
        out["owners"] = list(self.owners)
        out["considered"] = [c.to_json() for c in self.considered]
        return out


@dataclass(frozen=True, slots=True)
class Admission:
    """A peer's forward, admitted or refused here: the other side of a forward decision."""

    seq: int  # this node's admission number
    at: float  # the node's clock
    prompt_tokens: int
    cached_tokens: int  # this node's exact match of the prompt
    max_tokens: int
    beat_s: float | None  # what the sender said serving it here must beat
    # what serving it here costs (``router.mesh_cost`` from this node's exact state; None:
    # not computed, refused by state or no ``beat_s``), and its queue wait in that
    cost_s: float | None
    wait_s: float | None
    queue_depth: int  # requests queued or running here when it arrived
    verdict: str  # accepted | slower | busy (leaving, full, push-back)

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


class DecisionLog:
    """A ring of the node's last ``capacity`` decisions. Recording one keeps references to
    the router's inputs and output (frozen, so they cannot change after): a few
    microseconds on the request path; the :class:`Decision` records are built when read."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._ring: deque[_Kept] = deque(maxlen=capacity or None)
        self.recorded = 0  # decisions made since start (kept or not)
        self._admissions: deque[Admission] = deque(maxlen=capacity or None)
        self.admissions_recorded = 0

    def __len__(self) -> int:
        return len(self._ring)

    def record(
        self,
        at: float,
        request: int,
        again: bool,
        prompt_tokens: int,
        max_tokens: int,
        nodes: Sequence[NodeInfo],
        placement: Placement | None,
        ranked: Sequence[Candidate],
    ) -> None:
        """Keep one decision: ``nodes`` the router was given, ``ranked`` what it returned."""
        seq = self.recorded
        self.recorded += 1
        if self.capacity and ranked:
            tag = ranked[0].placement
            self._ring.append(_Kept(seq, at, request, again, prompt_tokens, max_tokens,
                                    tuple(nodes), placement, tuple(ranked),
                                    None if tag is None else tag.value))

    def admitted(self, at: float, prompt_tokens: int, cached_tokens: int, max_tokens: int,
                 beat_s: float | None, cost_s: float | None, wait_s: float | None,
                 queue_depth: int, verdict: str) -> None:
        """Keep one verdict on a peer's forward (``NodeCore``'s admission of it)."""
        seq = self.admissions_recorded
        self.admissions_recorded += 1
        if self.capacity:
            self._admissions.append(Admission(seq, at, prompt_tokens, cached_tokens, max_tokens,
                                              beat_s, cost_s, wait_s, queue_depth, verdict))

    def recent_admissions(self, limit: int | None = None) -> list[Admission]:
        """The kept verdicts on peers' forwards, oldest first; the last ``limit``."""
        return _last(list(self._admissions), limit)

    def considered(self, request: int, node_id: str) -> Considered | None:
        """``node_id`` as the last kept ranking of ``request`` saw it (None: no such ranking
        kept, or ``node_id`` not among its candidates)."""
        kept = next((k for k in reversed(self._ring) if k.request == request), None)
        if kept is None:
            return None
        return next((c for c in kept.decision().considered if c.node_id == node_id), None)

    def recent(
        self, limit: int | None = None, placement: str | None = None,
        request: int | None = None,
    ) -> list[Decision]:
        """The kept decisions, oldest first: those of ``request`` only, or whose choice had
        the ``placement`` tag; the last ``limit`` of them."""
        out = [k for k in self._ring
               if (request is None or k.request == request)
               and (placement is None or k.tag == placement)]
        return [k.decision() for k in _last(out, limit)]


def _last(items: list[_T], limit: int | None) -> list[_T]:
    """The last ``limit`` of ``items`` (all of them when ``limit`` is None)."""
    return items if limit is None else items[max(len(items) - limit, 0):]


@dataclass(frozen=True, slots=True)
class _Kept:
    """One decision as recorded: the router's own inputs and output."""

    seq: int
    at: float
    request: int
    again: bool
    prompt_tokens: int
    max_tokens: int
    nodes: tuple[NodeInfo, ...]
    placement: Placement | None
    ranked: tuple[Candidate, ...]
    tag: str | None  # the head's placement tag

    def decision(self) -> Decision:
        verdict = {c.node_id: (i, c) for i, c in enumerate(self.ranked)}
        seen = [_considered(n, *verdict.get(n.node_id, (None, None))) for n in self.nodes]
        seen.sort(key=lambda c: (c.rank is None, c.rank or 0))
        pl = self.placement
        return Decision(
            seq=self.seq, at=self.at, request=self.request, again=self.again,
            prompt_tokens=self.prompt_tokens, max_tokens=self.max_tokens,
            owners=() if pl is None else pl.owners,
            held_tokens=None if pl is None else pl.held_tokens,
            rent_s=None if pl is None else pl.rent_s,
            chosen=self.ranked[0].node_id, placement=self.tag, considered=tuple(seen),
        )


def _considered(n: NodeInfo, rank: int | None, cand: Candidate | None) -> Considered:
    """``n`` as the router was given it, with its verdict (None: not ranked)."""
    sp = n.speed
    return Considered(
        node_id=n.node_id, is_self=n.is_self, cached_tokens=n.cached_tokens,
        queue_depth=n.queue_depth, utilization=n.utilization, rtt_s=n.rtt_s,
        wait_error_s=n.wait_error_s, prefill_overhead_s=sp.prefill_overhead_s,
        prefill_s_per_token=sp.prefill_s_per_token,
        decode_s_per_token=sp.decode_s_per_token, mean_service_s=sp.mean_service_s,
        queue_service_s=n.queue_service_s,
        suspect=n.suspect, pushed_back=n.pushed_back, rank=rank,
        predicted_latency_s=None if cand is None else cand.predicted_latency_s,
        cost_s=None if cand is None else cand.cost_s,
        placement=None if cand is None or cand.placement is None else cand.placement.value,
        predicted_ttft_s=None if cand is None else cand.ttft_s,
        kv_usage=n.kv_usage, lateness_s=n.lateness_s, lateness_median_s=n.lateness_median_s,
        batch=None if n.batch is None
        else {f: float(getattr(n.batch, f)) for f in BATCH_FIELDS},
    )


def describe(decision: Decision, node: str | None = None) -> list[str]:
    """``decision`` as text: a header line, then one line per node considered, best first
    (``*`` the deciding node; ``-`` a node the router did not rank)."""
    d = decision
    owners = ",".join(d.owners) or "-"
    held = "-" if d.held_tokens is None else str(d.held_tokens)
    who = node if node is not None else next((c.node_id for c in d.considered if c.is_self), "?")
    again = " (re-ranked)" if d.again else ""
    lines = [f"--- {who} request {d.request}{again} at {d.at:.3f}: {d.prompt_tokens} prompt "
             f"tokens, owners {owners}, held at {held} tokens -> {d.chosen} ({d.placement})"]
    for c in d.considered:
        mark = "*" if c.is_self else " "
        cost = "-" if c.cost_s is None else f"{c.cost_s:7.3f} s"
        lat = "-" if c.predicted_latency_s is None else f"{c.predicted_latency_s:7.3f} s"
        rank = "-" if c.rank is None else str(c.rank)
        flags = "".join((" suspect" if c.suspect else "", " pushed-back" if c.pushed_back else ""))
        lines.append(
            f"  {rank:>2} {c.node_id}{mark} cached {c.cached_tokens:6d}  queue "
            f"{c.queue_depth:5.2f}  util {c.utilization:4.2f}  cost {cost}  latency {lat}  "
            f"wait error {c.wait_error_s:.3f} s  speed {c.prefill_overhead_s * 1e3:.1f} ms + "
            f"{c.prefill_s_per_token * 1e6:.0f} us/unit  {c.placement or ''}{flags}"
        )
    return lines


def from_json(obj: dict[str, Any]) -> Decision:
    """A :class:`Decision` from ``Decision.to_json``'s output (extra keys are ignored)."""
    fields = {k: obj[k] for k in Decision.__slots__ if k != "considered"}
    fields["owners"] = tuple(fields["owners"])
    considered = tuple(Considered(**{k: c[k] for k in Considered.__slots__})
                       for c in obj["considered"])
    return Decision(**fields, considered=considered)
