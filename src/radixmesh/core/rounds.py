"""When this node gossips, and the bytes in and out: the node's side of the gossip layer.

Theory of operation
-------------------
:class:`~radixmesh.core.gossip.Gossiper` builds rounds and applies messages; this part
decides *when* and accounts for the wire:

* **rounds**: one every ``interval_s`` × (1 + jitter), the first at once (joining the seeds);
  a change to this node's cache, or a request joining or leaving its engine's queue, brings
  the next one forward to ``announce_gap_s`` after the last (delta mode only), and a
  push-back that starts makes it due at once (the shell ticks the node immediately). Before
  each round a stale own speed restarts from the peers' (``OwnLoad.refresh_stale_speed``);
  every round advertises the load admission says (``AdmissionControl.advertised_load``:
  with any push-back);
* **messages in**: bytes from a network are decoded and validated here (a bad one is
  counted by reason and logged, never raised); applied messages' load reports go to
  ``PeerLoads``;
* **cache and queue changes** update the own summary (``Holdings``);
* **seeds** learnt later (DNS) are greeted at once;
* every message sent is counted (``gossip_messages_out``, ``gossip_bytes_out``).
"""

from __future__ import annotations

from random import Random  # the type only: instances are passed in, never the global one

from radixmesh.core.admission import AdmissionControl
from radixmesh.core.cache_summary import Holdings
from radixmesh.core.checked import RemoteProtocolError
from radixmesh.core.codec import Codec
from radixmesh.core.config import NodeConfig
from radixmesh.core.events import (
    Action,
    CacheChanged,
    Log,
    MessageReceived,
    QueueChanged,
    SeedsDiscovered,
    Tick,
)
from radixmesh.core.gossip import Gossiper
from radixmesh.core.own_load import OwnLoad
from radixmesh.core.peer_estimate import bump
from radixmesh.core.peer_loads import PeerLoads
from radixmesh.core.shadow_state import BatchState, aged, grew

URGENT_GAP = 0.2  # of ``announce_gap_s``: the soonest a round follows the last for a grown queue
URGENT_GROWTH = 0.5  # ... one predicting a TTFT this much longer (and two steps' fixed part)


class GossipRounds:
    """This node's gossip schedule and wire accounting (see the module docstring)."""

    def __init__(self, config: NodeConfig, gossip: Gossiper, codec: Codec, holdings: Holdings,
                 own: OwnLoad, admission: AdmissionControl, peers: PeerLoads, rng: Random,
                 metrics: dict[str, float], now: float) -> None:
        self._config = config
        self._gossip, self._codec, self._holdings = gossip, codec, holdings
        self._own, self._admission, self._peers = own, admission, peers
        self._rng = rng
        self._metrics = metrics
        self._next_round = now  # the first Tick joins the seeds at once
        self._last_round = now
        self._round_batch: tuple[BatchState, float] | None = None  # our batch at the last round

    def next_deadline(self) -> float:
        """When the next Tick is due (the shell's clock)."""
        return self._next_round

    def tick(self, _: Tick, now: float) -> list[Action]:
        if now < self._next_round:
            return []
        actions = self._gossip.expire(now)
        actions.extend(self.round(now))
        return actions

    def round(self, now: float) -> list[Action]:
        """One gossip round now (and the next one scheduled)."""
        cfg = self._config.gossip
        self._last_round = now
        self._next_round = now + cfg.interval_s * (1.0 + cfg.jitter_frac * self._rng.random())
        bump(self._metrics, "gossip_rounds")
        self._own.refresh_stale_speed(now)
        load = self._admission.advertised_load(now)
        self._round_batch = None if load.batch is None else (load.batch, now)
        sends = self._gossip.round(now, load)
        return self._account_out(sends)

    def batch_changed(self, batch: BatchState | None, now: float) -> None:
        """Our engine's batch changed: when it predicts a TTFT materially longer than the
        batch of our last round did (aged to now: a cold prompt queued, a burst), the next
        round comes ``URGENT_GAP`` x ``announce_gap_s`` after the last instead of
        ``announce_gap_s``: peers pricing us from the old batch would send their forwards
        into the queue for up to 50 ms, twice an H100's TTFT. Simulated at 80 % (against
        announcements at the gap alone): 16 H100s RAG, 24 runs, TTFT 0.977x, p99 0.890x,
        +5 % messages; agentic 0.988x / 0.978x, +13 %; 64 H100s RAG 0.941x / 0.830x, +7 %.
        At a growth of 20 % instead of 50 %: RAG 0.959x / 0.879x but agentic +82 % messages
        for the same TTFT."""
        gap, last = self._config.gossip.announce_s, self._round_batch
        if batch is None or last is None or gap is None:
            return
        if not grew(aged(last[0], now - last[1]), batch, URGENT_GROWTH):
            return
        due = max(now, self._last_round + URGENT_GAP * gap)
        if due < self._next_round:
            self._next_round = due
            bump(self._metrics, "gossip_rounds_urgent")

    def advertise_now(self, now: float) -> None:
        """The next round is due now (a push-back started: peers must hear of it at once)."""
        self._next_round = now

    def receive(self, event: MessageReceived, now: float) -> list[Action]:
        data, msg = event.data, event.message
        bump(self._metrics, "gossip_messages_in")
        bump(self._metrics, "gossip_bytes_in", len(data))
        if msg is None:  # from a network: decode and validate (the in-process one is trusted)
            try:
                msg = self._codec.decode(data)
            except RemoteProtocolError as exc:
                bump(self._metrics, "messages_rejected")
                bump(self._metrics, f"messages_rejected_{exc.reason}")
                return [Log("debug", f"rejected a peer message: {exc}")]
        actions = self._gossip.receive(msg, now, self._admission.advertised_load(now))
        self._peers.note_load(msg.sender, now)
        for relayed in msg.relays:
            self._peers.note_load(relayed.node_id, now)
        return self._account_out(actions)

    def cache_changed(self, event: CacheChanged, now: float) -> list[Action]:
        if self._holdings.cache_changed(event.added, event.removed):
            self._announce(now)
        return []

    def queue_changed(self, event: QueueChanged, now: float) -> list[Action]:
        """A request joined or left the engine's queue: its blocks go out as held (or no
        longer) with the next round, and so does the load, brought forward as a cache change
        is. 63 routers pricing a holder from a load one announcement old herd onto it: at 64
        H100s (RAG at 80 %, simulated) announcing only cache changes left rounds irregular
        (15.6 a second) and `cost` at 48.1 ms TTFT; announcing queue changes too, 19 a second
        (+22 % messages), 35.8 ms (docs/ideas-tried.md, "64 H100s: the gossip's age")."""
        self._holdings.queue_changed(event.hashes, event.joined)
        self._announce(now)
        return []

    def _announce(self, now: float) -> None:
        """Bring the next round forward (to ``announce_gap_s`` after the last one) so peers
        hear of a change to our cache or queue before the next request that needs it. A chat turn or
        an agent's step follows its predecessor's answer within milliseconds, at whichever
        node; a view a whole round old sent it where its history was not
        (docs/benchmarks-history.md, "The round of `aed2d82`": chat with 16 simulated
        clients cached 68 % of its prompt tokens, 75 % with announcements).
        Delta mode only: a round there carries the few changed hashes to every member; a
        snapshot round carries the whole set, and an epidemic one reaches ``fanout`` members."""
        gap = self._config.gossip.announce_s
        if gap is None:
            return
        due = max(now, self._last_round + gap)
        if due < self._next_round:
            self._next_round = due
            bump(self._metrics, "gossip_rounds_announced")

    def seeds_discovered(self, event: SeedsDiscovered, now: float) -> list[Action]:
        """Greet new seed addresses at once (then the failure detector's backoff applies)."""
        added = self._gossip.failure.add_seeds(event.addresses)
        if not added:
            return []
        bump(self._metrics, "seeds_discovered", len(added))
        load = self._admission.advertised_load(now)
        hello = self._gossip.dissemination.hello
        actions: list[Action] = [hello(a, now, load, reply=True) for a in added]
        self._account_out(actions)
        actions.append(Log("info", f"new seeds: {', '.join(added)}"))
        return actions

    def _account_out(self, actions: list[Action]) -> list[Action]:
        for a in actions:
            payload = getattr(a, "payload", None)
            if isinstance(payload, bytes):
                bump(self._metrics, "gossip_messages_out")
                bump(self._metrics, "gossip_bytes_out", len(payload))
        return actions
