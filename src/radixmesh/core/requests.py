"""The events of a request that entered this node, and what the rest of the node learns.

Theory of operation
-------------------
:class:`~radixmesh.core.lifecycle.Lifecycle` decides a request's tries (which peer next, when
to stop trying peers, the route label, continuing locally after a peer died mid-stream);
:class:`RequestFlow` feeds it and tells the node's other parts what each event shows::

    RequestArrived    admission (full? serve while leaving?) + routing -> Lifecycle.start
    ForwardAccepted   the try streams (placement counted)
    ForwardRefused    back off from the peer for its retry-after; its queue wait is a fresh
                      report (PeerLoads); ranked again from the current view -> next try
    ForwardFailed     suspect the peer (gossip's failure detector); ranked again -> next try
                      (or, once accepted, continue here after the tokens already sent)
    RequestDone       an RTT sample, the peer now holds the prefix (optimistic view insert),
                      the wait met against the wait predicted (WaitError), rent paid
    RequestCancelled  abort the current try

A server must keep running through a bug in the core, and never lose a request it holds:
``NodeCore.serve`` (the runtime's entry; the simulator and tests call ``handle``, which
raises) answers a part that raised with ``CoreFailed`` (:meth:`RequestFlow.after_error`),
and makes sure an event whose shell awaits the request's next step gets one
(:meth:`RequestFlow.next_step`): run it here as ``fallback`` when the core gave none (a
stale refusal or failure, or the core failed on it), and serve a peer's forward the core
failed on (the sender chose this node; a refusal would need a reason).
"""

from __future__ import annotations

import traceback
from dataclasses import replace

from radixmesh.core.admission import AdmissionControl
from radixmesh.core.cost_model import Candidate
from radixmesh.core.events import (
    AcceptForward,
    Action,
    CoreFailed,
    Event,
    ExecuteLocally,
    Forward,
    ForwardAccepted,
    ForwardArrived,
    ForwardFailed,
    ForwardRefused,
    Log,
    RefuseForward,
    RejectRequest,
    RequestAction,
    RequestArrived,
    RequestCancelled,
    RequestDone,
)
from radixmesh.core.gossip import Gossiper
from radixmesh.core.lifecycle import Flight, Lifecycle, Stage
from radixmesh.core.load_estimates import RttTable
from radixmesh.core.peer_estimate import bump
from radixmesh.core.peer_loads import PeerLoads
from radixmesh.core.peerview import PeerView
from radixmesh.core.placer import Placer
from radixmesh.core.routing import Routing


class RequestFlow:
    """Applies the request events of the entry node (see the module docstring)."""

    def __init__(self, lifecycle: Lifecycle, routing: Routing, admission: AdmissionControl,
                 peers: PeerLoads, placer: Placer, gossip: Gossiper, view: PeerView,
                 rtt: RttTable, metrics: dict[str, float]) -> None:
        self._lifecycle, self._routing, self._admission = lifecycle, routing, admission
        self._peers, self._placer, self._gossip = peers, placer, gossip
        self._view, self._rtt = view, rtt
        self._metrics = metrics

    def arrived(self, event: RequestArrived, now: float) -> list[Action]:
        full = self._admission.full_for(event.prompt_tokens, event.max_tokens, now)
        by_quota = full is None and event.over_quota  # (core/quotas.py) full for this tenant
        if by_quota:
            full = self._admission.quota_retry_after_s()
        candidates = self._candidates(event, now)
        last_resort = self._admission.leaving and self._admission.serves_while_leaving(
            event, candidates, now)
        return self._counted(self._lifecycle.start(event, candidates, full, last_resort,
                                                   by_quota))

    def _counted(self, actions: list[RequestAction]) -> list[Action]:
        """``actions``, counting a 429 the tenant's quota decided (no peer took it either)."""
        for action in actions:
            if isinstance(action, RejectRequest) and action.quota:
                bump(self._metrics, "admission_full_quota")
        return list(actions)

    def accepted(self, event: ForwardAccepted, _: float) -> list[Action]:
        if self._lifecycle.is_current(event.rid, event.peer_id, "accepted"):
            self._lifecycle.accepted(event.rid)
        return []

    def refused(self, event: ForwardRefused, now: float) -> list[Action]:
        if not self._lifecycle.is_current(event.rid, event.peer_id, "refused"):
            return []
        bump(self._metrics, "forwards_refused")
        self._gossip.refused_forward(event.peer_id, event.retry_after_s, now)
        if event.queue_s is not None:
            self._peers.queue_reported(event.peer_id, event.queue_s, now)
            self._late(event.rid, event.peer_id, event.queue_s, now)
        return self._counted(self._lifecycle.refused(event.rid,
                                                     self._ranked_again(event.rid, now)))

    def failed(self, event: ForwardFailed, now: float) -> list[Action]:
        if not self._lifecycle.is_current(event.rid, event.peer_id, "failed"):
            return []
        bump(self._metrics, "forwards_failed")
        actions = self._gossip.forward_failed(event.peer_id, now)
        fresh = self._ranked_again(event.rid, now)
        actions.extend(self._counted(self._lifecycle.failed(event.rid, event.tokens_so_far,
                                                            fresh)))
        return actions

    def _ranked_again(self, rid: int, now: float) -> list[Candidate] | None:
        """The request ranked from the current view (after a refusal or a failure)."""
        flight = self._lifecycle.get(rid)
        if flight is None or flight.stage is Stage.STREAMING:
            return None  # (accepted: the answer continues here whatever the view says)
        self._lifecycle.release(rid)  # its try there no longer holds the prompt's blocks
        return self._candidates(flight.arrived, now)

    def _candidates(self, event: RequestArrived, now: float) -> list[Candidate]:
        """The routing's ranking; with this node's engine down, every available peer after
        it (least loaded first): a policy that would not look past this node (``none``, or
        ``paper`` with no peer holding the prefix) must not reject what a peer can run."""
        ranked = self._routing.candidates(event, now)
        if not self._admission.engine_down or event.local_only or not event.plain:
            return ranked
        # nothing can run here: a peer has no alternative of ours to beat (it refuses only
        # when it is full). With ``beat_s`` kept, a real vLLM's peer refused 169 forwards of
        # a killed engine's node as slower in a minute, and its clients got 429s
        ranked = [replace(c, beat_s=None) for c in ranked]
        listed = {c.node_id for c in ranked}
        more = [p for p in self._peers.least_loaded(now) if p not in listed]
        more += [p for p in self._gossip.routable if p not in listed and p not in more]
        return ranked + [Candidate(p, False, 0, 0.0) for p in more]

    def done(self, event: RequestDone, now: float) -> list[Action]:
        flight = self._lifecycle.get(event.rid)
        peer = None if flight is None else flight.peer
        if not self._lifecycle.is_current(event.rid, peer, "done"):
            return []
        flight = self._lifecycle.done(event.rid, event.error)
        if flight.peer is None or event.error is not None:
            return []
        if event.forward_overhead_s is not None:
            self._forward_ok(flight.peer, flight.arrived.hashes, event.forward_overhead_s)
        if event.forward_queue_s is not None:
            self._waited(flight, event.forward_queue_s, now)
        if event.forward_ttft_s is not None:
            self._first_token(flight, event.forward_ttft_s, now)
        return []

    def _first_token(self, flight: Flight, ttft_s: float, now: float) -> None:
        """The forward's first token came ``ttft_s`` after it was offered: how late that was
        against the chosen candidate's prediction (``Lateness``). The first token, not the
        whole answer: with the decodes' errors in it, the correction drove agentic steps and
        chat turns to cold copies (16 simulated H100s at 80 %, seed 3: 0.46 -> 0.59 s chat)."""
        choice = flight.choice
        if choice is None or flight.peer is None or choice.node_id != flight.peer:
            return
        if choice.ranked_ttft_s is not None and ttft_s >= 0.0:
            self._peers.late_by(flight.peer, ttft_s - choice.ranked_ttft_s, now)

    def _late(self, rid: int, peer: str, queue_s: float, now: float) -> None:
        """``peer``, a batching engine's node, refused the forward of ``rid`` as slower,
        saying its queue wait: how much longer that was than the wait predicted for it
        (``Lateness``). A refusal is where a stale view shows first: learning only from
        accepted forwards, senders kept offering agentic steps to peers that refused them (16
        simulated H100s at 80 %: 45 % of the requests fell back). A peer without a batch
        report takes the wait as its fresh queue instead (``PeerLoads.queue_reported``)."""
        flight = self._lifecycle.get(rid)
        choice = None if flight is None else flight.choice
        if choice is None or choice.node_id != peer or not self._peers.reports_batch(peer):
            return
        if self._peers.believable_wait(queue_s):
            self._peers.late_by(peer, queue_s - choice.wait_s, now)

    def _waited(self, flight: Flight, waited: float, now: float) -> None:
        """The forward met a queue wait ``waited`` at its peer: the prediction's error, and
        for a rental, rent paid."""
        choice = flight.choice
        if choice is None or flight.peer is None or choice.node_id != flight.peer:
            return
        if self._peers.believable_wait(waited):
            self._peers.wait_met(flight.peer, waited - choice.wait_s, now)
            if choice.rent_key is not None:
                self._placer.rent_waited(choice.rent_key, waited, flight.candidates, now)

    def _forward_ok(self, peer: str, hashes: tuple[int, ...], rtt_s: float) -> None:
        """A peer answered a forward: an RTT sample, and it now holds the request's prefix."""
        bump(self._metrics, "forwards_succeeded")
        self._rtt.observe(peer, rtt_s)
        est = self._gossip.estimates.get(peer)
        if est is not None and est.version is not None and hashes:
            self._view.optimistic_insert(peer, hashes)

    def cancelled(self, event: RequestCancelled, _: float) -> list[Action]:
        return list(self._lifecycle.cancel(event.rid))

    # --------------------------------------------------------------- the server's guard
    def after_error(self, event: Event, exc: Exception) -> list[Action]:
        """The core raised on ``event`` (a bug): say so, and still answer the request."""
        error = "".join(traceback.format_exception(exc))
        return self.next_step(event, [CoreFailed(type(event).__name__, error)])

    def next_step(self, event: Event, actions: list[Action]) -> list[Action]:
        """``actions``, plus the next step of the request ``event`` is about when its shell
        awaits one and the core gave none: run it here (never a lost request); a peer's
        forward is served."""
        if isinstance(event, ForwardArrived):
            if not any(isinstance(a, AcceptForward | RefuseForward) for a in actions):
                return [*actions, AcceptForward(event.rid)]
            return actions
        if not isinstance(event, RequestArrived | ForwardRefused | ForwardFailed):
            return actions
        if any(isinstance(a, Forward | ExecuteLocally | RejectRequest) for a in actions):
            return actions
        log = Log("error", f"no lifecycle action for request {event.rid}: running it locally")
        return [*actions, log, ExecuteLocally(event.rid, "fallback", 0)]
