"""Admission: whether this node takes new work — push-back, bounded queue, leaving.

Theory of operation
-------------------
Three states of this node keep work away, each decided here and nowhere else:

* **push-back** (``PushbackConfig``; not for a batching engine, :meth:`pushes_back_at`): a
  queue over ``queue_threshold`` (and, with ``relative``, over that many times the mean
  queue its peers reported) advertises a back-off for ``duration_s`` in the very next
  gossip round (the node's shell ticks it at once), and peers stop routing to it the
  moment the message arrives;
* **bounded admission** (``AdmissionConfig``): :func:`admission` says when the queue is
  *full* (requests, expected wait, tokens); a full node skips itself for its own clients'
  requests (the lifecycle tries its peers, then rejects with a retry-after) and refuses
  forwards;
* **leaving** (``LeaveRequested(grace_s)``): the node counts as full for everything new,
  refuses every forward (retry after the rest of the grace) and advertises push-back for
  the whole grace, at least ``PushbackConfig.duration_s``. Why push-back and not a new wire
  field: every peer already honours it, so old and new nodes interoperate with the wire
  format unchanged; when the node is gone, the silence timeouts take over. A leaving node
  still serves a request no peer took while its predicted latency ends within the grace
  (:meth:`AdmissionControl.serves_while_leaving`);
* **engine down** (``EngineStateChanged(up=False)``): as leaving, but until the engine is back
  and with no last resort here (nothing can run): full for everything new, forwards refused
  (retry after ``min_retry_after_s``), push-back advertised while down.

* **tenant quotas** (core/quotas.py, ``--tenant-queue-share``): the shell says when a
  request's tenant is over its share of this node's bounds (``over_quota`` on the event):
  the node is full for that request (:meth:`AdmissionControl.quota_retry_after_s`), so a
  client's goes to a peer or gets the 429, a peer's forward is refused as busy (counted as
  ``admission_full_quota`` only then: by the 429, core/requests.py, or that refusal).

A peer's forward is answered here too (:meth:`AdmissionControl.forward_arrived`): refused by
the states above, or — when the sender said what serving it here must beat — when this
node's exact queue and cache cannot beat it (``forwards_refused_slower``; the refusal says
the queue wait, a report fresher than gossip's). Every verdict goes into the node's
``DecisionLog``.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixmesh.core.config import AdmissionConfig, NodeConfig
from radixmesh.core.cost_model import Candidate, RouteInput, mesh_cost, predict_wait
from radixmesh.core.decisions import DecisionLog
from radixmesh.core.estimators import SpeedReport
from radixmesh.core.events import (
    AcceptForward,
    Action,
    ForwardArrived,
    LoadChanged,
    Log,
    RefuseForward,
    RequestArrived,
)
from radixmesh.core.messages import Load
from radixmesh.core.own_load import OwnLoad
from radixmesh.core.peer_estimate import bump
from radixmesh.core.peer_loads import PeerLoads
from radixmesh.core.shadow_state import BatchState, ttft_parts


@dataclass(frozen=True, slots=True)
class Full:
    """:func:`admission`'s answer for a node without room: its queue's expected wait (the
    retry-after's base) and the bound that was reached (``requests``, ``wait``, ``tokens``)."""

    wait_s: float
    bound: str


def token_cap(adm: AdmissionConfig, tokens_per_s: float, streams: float = 1) -> int | None:
    """The token bound in force: ``max_queue_tokens``, or (0, the default) the tokens the
    engine gets through within ``max_queue_wait_s`` at its measured rate (``tokens_per_s``
    per request stream, times the ``streams`` it serves at once: ``OwnLoad.streams``; at
    least 1); None: no token bound."""
    if adm.max_queue_tokens is None or adm.max_queue_tokens > 0:
        return adm.max_queue_tokens
    return int(adm.max_queue_wait_s * max(tokens_per_s, 0.0) * max(streams, 1))


def admission(adm: AdmissionConfig, speed: SpeedReport, tokens_per_s: float,
              load: LoadChanged, prompt_tokens: int, max_tokens: int,
              streams: float = 1.0, batch: BatchState | None = None) -> Full | None:
    """Bounded admission, the whole decision: None if a node with ``load`` (and this speed)
    has room for one more request of ``prompt_tokens`` + ``max_tokens``, else :class:`Full`.

    An idle node (nothing waiting or running) always has room: a request larger than every
    bound must still run somewhere. Otherwise the node is full when its queue
    * holds ``max_queue_requests`` requests, or
    * would keep the request waiting ``max_queue_wait_s`` (depth x mean service, over the
      requests the engine serves at once: ``streams``, at least those running), or
    * with this request would hold more tokens (prompt + max_tokens of every request waiting
      or running) than :func:`token_cap`: ``max_queue_tokens``, or by default the tokens the
      engine gets through within ``max_queue_wait_s`` at its measured rate.
    (:func:`_measured_wait`; ``streams``: an invisible queue's requests served at once, so
    that 8 sharing a real vLLM CPU engine are not 8 x 2.5 s of queued work: docs/reliability.md.)
    ``batch``: the node's shadow of a batching engine (``LoadChanged.batch``, aged to now);
    then the wait is the shadow's, before the request's prefill (``ttft_parts``), and only an
    explicit ``max_queue_tokens`` bounds tokens: Little's law lags a surge (16 emulated H100s
    at 160 % of their planned capacity answered 429 at the wait's bound on first requests)."""
    depth = load.queue_depth
    if depth <= 0:
        return None
    if batch is not None:
        wait = reported = ttft_parts(batch, max(prompt_tokens, 1), 0)[0]
        cap = adm.max_queue_tokens or None
    else:
        wait, reported, cap = _measured_wait(adm, speed, tokens_per_s, load, streams)
    queued = load.queue_prompt_tokens + load.queue_output_tokens
    if adm.max_queue_requests is not None and depth >= adm.max_queue_requests:
        return Full(reported, "requests")
    if wait >= adm.max_queue_wait_s:
        return Full(reported, "wait")
    if cap is not None and queued + max(prompt_tokens, 0) + max(max_tokens, 0) > cap:
        return Full(reported, "tokens")
    return None


def _measured_wait(adm: AdmissionConfig, speed: SpeedReport, tokens_per_s: float,
                   load: LoadChanged, streams: float) -> tuple[float, float, int | None]:
    """Without an engine's batch: the queue's wait (depth x mean service over the streams,
    at least those running), the wait reported (the larger of that and the queue's tokens at
    the measured rate) and the token bound in force (:func:`token_cap`)."""
    streams = max(float(load.inflight), streams, 1.0)
    queued = load.queue_prompt_tokens + load.queue_output_tokens
    wait = load.queue_depth * speed.mean_service_s / streams
    reported = max(wait, queued / max(tokens_per_s * streams, 1e-9))
    return wait, reported, token_cap(adm, tokens_per_s, streams)


class AdmissionControl:
    """Push-back, bounded admission and leaving of one node (see the module docstring)."""

    def __init__(self, config: NodeConfig, own: OwnLoad, peers: PeerLoads,
                 decisions: DecisionLog, metrics: dict[str, float]) -> None:
        self._config = config
        self._own = own
        self._peers = peers
        self._decisions = decisions
        self._metrics = metrics
        self._pushback_until: float | None = None
        self._leaving_until: float | None = None  # LeaveRequested: end of the grace period
        self.engine_down = False  # EngineStateChanged: nothing new can run here

    @property
    def leaving(self) -> bool:
        """Whether ``LeaveRequested`` arrived: no new work is taken."""
        return self._leaving_until is not None

    def pushback_remaining(self, now: float) -> float | None:
        """Seconds left of this node's own push-back (None: never started), for ``/mesh``."""
        until = self._pushback_until
        return None if until is None else max(0.0, until - now)

    # ------------------------------------------------------------------------ push-back
    def pushback(self, depth: int, now: float) -> Log | None:
        """The own queue is ``depth`` deep: push back (again) if it is one this node pushes
        back at; a Log when a push-back starts (the shell must advertise it at once)."""
        pb = self._config.pushback
        if not self.pushes_back_at(depth):
            return None
        active = self._pushback_until is not None and self._pushback_until > now
        self._pushback_until = now + pb.duration_s
        if active:
            return None
        bump(self._metrics, "pushback_started")
        return Log("info", f"queue depth {depth} > {pb.queue_threshold}: push-back")

    def pushes_back_at(self, depth: int) -> bool:
        """Whether a queue ``depth`` deep is one this node pushes back at: over the threshold
        and, with ``relative``, over that many times the mean queue its peers last reported
        (their gossip, or the waits they gave when refusing us). When every node is as busy,
        backing off from one only moves its work to nodes as busy and makes the prefixes it
        holds look held by nobody: in the simulator, Poisson arrivals at 45 % of the capacity
        of a mesh that caches 85 % (4 nodes) turned into a collapse, every queue over the
        threshold, every node pushed back, every request computed where it entered (`cost`
        1.0x `none`, 3.4 s a request, against the gateway model's 0.35 s); at 16 nodes from
        80 %.

        A node whose engine reports a batch (``LoadChanged.batch``: a batching engine, its
        shadow's state) never pushes back at a depth: its depth counts the requests running in
        the batch, not a queue, and its predicted TTFT already prices its load (as the load
        bound exempts it, ``core/cost_model.py``). A holder of popular prefixes runs more of
        them at once than its peers, so the depth rule sent its hits away as cold copies on
        the nodes they entered, adding prefill to a mesh already at its limit: 16 emulated
        H100s, RAG at 80 % of the planned capacity, `cost` 2.26x SMG's TTFT on real processes
        (hits 80 / 87 %); in the simulator 0.56 s against the gateway's 0.13-0.24 s, 0.56
        refusals per request, 41 % of requests fallen back (issue #52). Forwards it cannot
        beat are still refused as slower (their ``beat_s``), and a full node as full."""
        pb = self._config.pushback
        if depth <= pb.queue_threshold or self._own.load.batch is not None:
            return False
        if pb.relative is None or not self._peers.reported():
            return True
        return depth > pb.relative * self._peers.mean_queue()

    def pushback_left(self, now: float) -> float | None:
        """Seconds peers should back off now (None: not at all): a queue over the threshold,
        or leaving (the rest of the grace, at least one push-back duration)."""
        until = self._pushback_until
        left = until - now if until is not None and until > now else None
        if self._leaving_until is not None:
            leave = max(self._leaving_until - now, self._config.pushback.duration_s)
            left = leave if left is None else max(left, leave)
        if self.engine_down:
            left = max(left or 0.0, self._config.pushback.duration_s)
        return left

    def advertised_load(self, now: float) -> Load:
        """This node's load as its gossip advertises it now (with any push-back)."""
        return self._own.advertised(now, self.pushback_left(now))

    def leave(self, grace_s: float, now: float) -> Log | None:
        """Stop taking new work (None: already leaving); the shell's next round tells every
        peer (push-back for the grace period)."""
        if self._leaving_until is not None:
            return None
        self._leaving_until = now + max(grace_s, 0.0)
        self._own.invalidate()
        return Log("info", f"leaving: draining for {grace_s:g} s")

    def engine_state(self, up: bool, reason: str) -> Log | None:
        """The engine went down or came back (None: no change); the shell's next round tells
        every peer (push-back while down)."""
        if self.engine_down != up:
            return None
        self.engine_down = not up
        self._own.invalidate()
        bump(self._metrics, "engine_came_back" if up else "engine_went_down")
        return Log("info" if up else "warning", f"engine {'back' if up else 'down'}: {reason}")

    # ----------------------------------------------------------------- own requests
    def full_for(self, prompt_tokens: int, max_tokens: int, now: float) -> float | None:
        """None if this node has room for one more request of ``prompt_tokens`` +
        ``max_tokens``; else its queue's expected wait (0 while leaving: it has no room for
        anything new, whatever its queue). The decision is :func:`admission`'s."""
        if self._leaving_until is not None or self.engine_down:
            return 0.0
        full = admission(self._config.admission, self._own.speed(), self._own.token_rate(),
                         self._own.load, prompt_tokens, max_tokens, self._own.streams(now),
                         self._own.batch(now))
        if full is None:
            return None
        bump(self._metrics, f"admission_full_{full.bound}")
        return full.wait_s

    def quota_retry_after_s(self) -> float:
        """A request's tenant is over its share of this node's queue (core/quotas.py): the
        node is full for it; the retry-after is the node's shortest."""
        return self._config.admission.min_retry_after_s

    def serves_while_leaving(
        self, event: RequestArrived, candidates: list[Candidate], now: float
    ) -> bool:
        """A leaving node serves a request no peer took if its admission bounds have room and
        the request's predicted latency here ends within the rest of the grace."""
        if self._leaving_until is None:
            return False
        own = next((c for c in candidates if c.is_self), None)
        if own is None or now + own.predicted_latency_s > self._leaving_until:
            return False
        return admission(self._config.admission, self._own.speed(), self._own.token_rate(),
                         self._own.load, event.prompt_tokens, event.max_tokens,
                         self._own.streams(now), self._own.batch(now)) is None

    # ------------------------------------------------------------------ peers' forwards
    def forward_arrived(self, event: ForwardArrived, now: float) -> list[Action]:
        """Accept or refuse a peer's forward, and keep the verdict in the decision log."""
        refusal, cost, wait = self._refusal(event, now)
        verdict = "accepted" if refusal is None else "slower" if cost is not None else "busy"
        self._decisions.admitted(now, event.prompt_tokens, event.cached_tokens,
                                 event.max_tokens, event.beat_s, cost, wait,
                                 self._own.load.queue_depth, verdict)
        return [AcceptForward(event.rid) if refusal is None else refusal]

    def _refusal(
        self, event: ForwardArrived, now: float
    ) -> tuple[RefuseForward | None, float | None, float | None]:
        """Whether to refuse a request a peer forwarded here (None: admit it), with what
        serving it here costs and the queue wait in that (None: not compared). Client requests
        entering here are always served; forwards are refused
        * by this node's state — leaving, full, at the push-back threshold — with the
          seconds the peer should leave us alone, and
        * when the sender said what we must beat (``beat_s``: its local prediction, the
          alternative to our answer — its way here is spent, the way back paid either way)
          and what serving it here costs, known exactly here (``mesh_cost``: our queue wait
          + its service, plus that service again for each request queued here, as the
          sender counted its own), is more. This node is not busy as such, so the sender
          need not leave it alone (retry after 0): the refusal tells it our queue wait
          instead (``queue_s``), a report of our queue fresher than gossip's.
        A sender routing on a view of our queue that is a gossip round old finds out in one
        round trip instead of waiting in a queue that many nodes picked at once."""
        retry = self._refusal_by_state(now, event.prompt_tokens, event.max_tokens)
        if retry is None and event.over_quota:  # the quota decides this refusal
            bump(self._metrics, "admission_full_quota")
            retry = self.quota_retry_after_s()
        if retry is not None:
            return RefuseForward(event.rid, retry), None, None
        if event.beat_s is None:
            return None, None, None
        me = self._own.self_info(event.cached_tokens, now)
        req = RouteInput(max(event.prompt_tokens, 1), max(event.max_tokens, 1))
        predicted = mesh_cost(req, [me], self._config.router.context_scale)[0]
        wait = predict_wait(me)
        if predicted <= event.beat_s:
            return None, predicted, wait
        bump(self._metrics, "forwards_refused_slower")
        return RefuseForward(event.rid, 0.0, wait), predicted, wait

    def _refusal_by_state(self, now: float, prompt_tokens: int, max_tokens: int) -> float | None:
        """Refusals by this node's state: leaving, full (for this request's tokens: bounded
        admission), or at the push-back threshold."""
        adm = self._config.admission
        if self.engine_down:
            bump(self._metrics, "forwards_refused_engine_down")
            return adm.min_retry_after_s
        if self._leaving_until is not None:
            bump(self._metrics, "forwards_refused_leaving")
            cap = self._config.gossip.exchange.max_retry_after_s
            return min(max(self._leaving_until - now, adm.min_retry_after_s), cap)
        full = self.full_for(prompt_tokens, max_tokens, now)
        if full is not None:
            bump(self._metrics, "forwards_refused_full")
            return max(full, adm.min_retry_after_s)
        pb = self._config.pushback
        if self.pushes_back_at(self._own.load.queue_depth + 1):  # one more would be over
            bump(self._metrics, "forwards_refused_busy")
            until = self._pushback_until
            return pb.duration_s if until is None or until <= now else until - now
        return None
