"""What a node says about itself: counters, gauges, and its mesh as ``GET /mesh`` shows it.

Theory of operation
-------------------
Read-only: every figure is read from the part that owns it (the shared counters dict the
parts bump, membership, the gossip estimates, the view, the own summary, own load,
admission, the lifecycle's counters, peer loads). Metric names are stable: the runtime
exports them as Prometheus series, so a name here is a public interface.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixmesh.core.admission import AdmissionControl
from radixmesh.core.cache_summary import Holdings, LocalSummary
from radixmesh.core.config import NodeConfig
from radixmesh.core.cost_model import Tag
from radixmesh.core.gossip import Gossiper
from radixmesh.core.lifecycle import Lifecycle
from radixmesh.core.load_estimates import RttTable
from radixmesh.core.membership import Membership, MemberState
from radixmesh.core.own_load import OwnLoad
from radixmesh.core.peer_loads import PeerLoads
from radixmesh.core.peerview import PeerView


@dataclass(frozen=True, slots=True)
class NodeReport:
    """The node's metrics and mesh state, read from its parts."""

    config: NodeConfig
    counters: dict[str, float]
    summary: LocalSummary
    holdings: Holdings
    view: PeerView
    members: Membership
    gossip: Gossiper
    lifecycle: Lifecycle
    own: OwnLoad
    admission: AdmissionControl
    peers: PeerLoads
    rtt: RttTable

    def metrics(self) -> dict[str, float]:
        """Flat counters and gauges (names are stable: the runtime exports them)."""
        out = dict(self.counters)
        out["peers_alive"] = float(self.members.count(MemberState.ALIVE))
        out["peers_suspect"] = float(self.members.count(MemberState.SUSPECT))
        out["peers_dead"] = float(self.members.count(MemberState.DEAD))
        out["peers_routable"] = float(len(self.gossip.routable))
        out["view_peers"] = float(len(self.view.peers()))
        out["view_entries"] = float(self.view.total_entries())
        out["summary_version"] = float(self.summary.version)
        out["summary_blocks"] = float(len(self.summary))
        out["incarnation"] = float(self.config.incarnation)
        out["queue_depth"] = float(self.own.load.queue_depth)
        out["leaving"] = float(self.admission.leaving)
        out["engine_down"] = float(self.admission.engine_down)
        out.update(self._lifecycle_metrics())
        return out

    def _lifecycle_metrics(self) -> dict[str, float]:
        lc = self.lifecycle.counters
        out = {
            "requests_in_flight": float(len(self.lifecycle)),
            "forwards_unknown_peer": float(lc.unknown_peer),
            "lifecycle_stale_events": float(lc.stale),
            "requests_cancelled": float(lc.cancelled),
            "requests_failed": float(lc.failed),
            "requests_rejected": float(lc.rejected),
        }
        for route in ("local", "forwarded", "fallback"):
            out[f"requests_{route}"] = float(lc.routes.get(route, 0))
        # cost: who served each request, by the router's placement tag (core/router.Tag):
        # placement_second_copy = accidental cold copies of a prefix cached elsewhere (in the
        # view) at decision time; placement_replica = deliberate hot-prefix replicas;
        # placement_local_copy = copies kept at the entry once forwarding cost more (rent)
        for tag in Tag:
            out[f"placement_{tag.value}"] = float(lc.placements.get(tag.value, 0))
        return out

    def mesh_state(self, now: float) -> dict[str, object]:
        """JSON-able view of this node's mesh, for ``GET /mesh``."""
        cfg = self.config
        return {
            "node_id": cfg.node_id,
            "address": cfg.address,
            "incarnation": cfg.incarnation,
            "fingerprint": f"{cfg.fingerprint.digest:016x}",
            "gossip_mode": cfg.gossip.mode.value,
            "version": self.summary.version,
            "blocks": len(self.summary),
            "queue_depth": self.own.load.queue_depth,
            "pushback_remaining_s": self.admission.pushback_remaining(now),
            "leaving": self.admission.leaving,
            "engine_down": self.admission.engine_down,
            "seeds": list(self.members.seeds),
            "peers": [self._peer_state(m.node_id, now) for m in self.members],
        }

    def _peer_state(self, peer: str, now: float) -> dict[str, object]:
        member = self.members.get(peer)
        est = self.gossip.estimates[peer]
        assert member is not None
        load = est.load
        speed = est.speed or self.own.prior_speed
        until = est.pushback_until
        return {
            "node_id": peer,
            "address": member.address,
            "state": member.state.value,
            "incarnation": est.incarnation,
            "view_version": est.version,
            "view_blocks": self.view.size(peer),
            "age_s": max(0.0, now - member.last_heard),
            "heartbeat": est.heartbeat,
            "load": None
            if load is None
            else {
                "queue_depth": load.queue_depth,
                "inflight": load.inflight,
                "cache_tokens": load.cache_tokens,
                "cache_budget": load.cache_budget,
                "prefill_s_per_token": speed.prefill_s_per_token,
                "decode_s_per_token": speed.decode_s_per_token,
                "mean_service_s": speed.mean_service_s,
            },
            "pushback_remaining_s": None if until is None else max(0.0, until - now),
            "rtt_s": self.rtt.get(peer),
            "rtt_measured": self.rtt.measured(peer),
            "wait_error_s": self.peers.spread_of(peer, now),
            "lateness_s": self.peers.lateness_of(peer, now),
            "lateness_median_s": self.peers.lateness_median_of(peer, now),
        }
