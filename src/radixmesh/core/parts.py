"""A node's parts, made and wired together once: what ``NodeCore`` holds and dispatches to.

Theory of operation
-------------------
Each part owns one concern and its state (see ``core/node.py``'s table); a part that needs
another's knowledge is given that part here and asks it through its public methods. The
counters are one dict that every part bumps (names: ``core/node.py``'s ``_COUNTERS``, plus
those the parts add as they happen, e.g. ``admission_full_<bound>``), and ``NodeReport``
reads. The order of construction is the order of dependence: gossip (membership, view,
estimates) first, the request flow last.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from random import Random  # the type only: instances are passed in, never the global one

from radixmesh.core.adapters import PeerAdapters
from radixmesh.core.admission import AdmissionControl
from radixmesh.core.cache_summary import Holdings, LocalSummary
from radixmesh.core.codec import Codec, Limits
from radixmesh.core.config import NodeConfig
from radixmesh.core.decisions import DecisionLog
from radixmesh.core.gossip import Gossiper
from radixmesh.core.lifecycle import Lifecycle
from radixmesh.core.load_estimates import RttTable
from radixmesh.core.membership import Membership
from radixmesh.core.node_report import NodeReport
from radixmesh.core.own_load import OwnLoad
from radixmesh.core.peer_loads import PeerLoads
from radixmesh.core.peerview import PeerView
from radixmesh.core.placer import Placer
from radixmesh.core.requests import RequestFlow
from radixmesh.core.rounds import GossipRounds
from radixmesh.core.routing import Routing
from radixmesh.core.sessions import SessionTable


@dataclass(frozen=True, slots=True)
class Parts:
    """The parts of one node (see the module docstring)."""

    gossip: Gossiper
    rounds: GossipRounds
    own: OwnLoad
    peers: PeerLoads
    admission: AdmissionControl
    placer: Placer
    routing: Routing
    lifecycle: Lifecycle
    requests: RequestFlow
    report: NodeReport
    sessions: SessionTable


def build_parts(config: NodeConfig, rng: Random, now: float, decisions: DecisionLog,
                counters: Iterable[str], address_of: Callable[[str], str | None]) -> Parts:
    """Make one node's parts, each given the others it consults; ``counters``: the names of
    the counters they share (all 0 at first); ``address_of``: a peer's address as the node
    answers it (``NodeCore.peer_address``: membership's), which the lifecycle forwards to."""
    metrics: dict[str, float] = dict.fromkeys(counters, 0.0)
    summary = LocalSummary(config.gossip.change_log_limit)
    holdings = Holdings(summary)  # the summary: cached + queued blocks
    view = PeerView()
    members = Membership(config.node_id, tuple(s for s in config.seeds if s != config.address))
    rtt = RttTable(config.priors)
    limits = Limits(max_message_bytes=config.gossip.max_message_bytes,
                    max_hashes=config.gossip.max_hashes)
    codec = Codec(limits)
    gossip = Gossiper(config, summary, view, members, rtt, codec, rng, metrics)
    lifecycle = Lifecycle(config.forward, address_of,
                          config.admission.min_retry_after_s)
    own = OwnLoad(config, gossip, metrics)
    peers = PeerLoads(config, gossip, rtt, lifecycle, own.prior_speed, metrics)
    admission = AdmissionControl(config, own, peers, decisions, metrics)
    placer = Placer(config, gossip, view, peers, rng, now)
    sessions = SessionTable(config.node_id, config.sessions)
    gossip.dissemination.sessions = sessions
    adapters = gossip.dissemination.adapters = PeerAdapters()
    routing = Routing(config, own, peers, placer, gossip, view, lifecycle, rtt, rng, decisions,
                      metrics, sessions, adapters)
    report = NodeReport(config, metrics, summary, holdings, view, members, gossip, lifecycle,
                        own, admission, peers, rtt)
    return Parts(
        gossip=gossip,
        rounds=GossipRounds(config, gossip, codec, holdings, own, admission, peers, rng,
                            metrics, now),
        own=own, peers=peers, admission=admission, placer=placer, routing=routing,
        lifecycle=lifecycle,
        requests=RequestFlow(lifecycle, routing, admission, peers, placer, gossip, view, rtt,
                             metrics),
        report=report,
        sessions=sessions,
    )
