"""A peer's messages that decode but say what cannot be: the node keeps its view of the mesh
sound, and never lets one message bar a peer or skew its mean for good."""

from __future__ import annotations

import pytest

from radixmesh.core.checked import RemoteProtocolError
from radixmesh.core.codec import Codec
from radixmesh.core.config import GossipConfig
from radixmesh.core.dissemination import STAMP_AHEAD_S
from radixmesh.core.events import MessageReceived
from radixmesh.core.messages import Change, Delta, Gossip, Load, NodeState
from radixmesh.core.peer_loads import MAX_QUEUE_DEPTH
from radixmesh.testing.twin import TwinCluster

CODEC = Codec()


def cluster(n: int) -> TwinCluster:
    c = TwinCluster(n, seed=11)
    c.change_cache("n1", added=range(1, 100))
    c.run_for(2.0)
    return c


def forge(c: TwinCluster, sender: str, load: Load, stamp: float | None = None,
          relays: tuple[NodeState, ...] = (), summary: Delta | None = None) -> Gossip:
    """A message from ``sender`` as n0 would take it (its incarnation, a newer stamp)."""
    est = c.nodes["n0"]._parts.gossip.estimates[sender]
    return Gossip(sender=sender, address=TwinCluster.address(sender),
                  incarnation=c.nodes[sender].config.incarnation, version=0, heartbeat=10**6,
                  fingerprint=c.fingerprint.digest,
                  stamp=(est.stamp or 0.0) + 1.0 if stamp is None else stamp, load=load,
                  relays=relays, summary=summary)


def deliver(c: TwinCluster, msg: Gossip) -> None:
    c.nodes["n0"].handle(MessageReceived(CODEC.encode(msg), None), c.now)


def test_a_dead_peers_last_queue_leaves_the_mesh_mean() -> None:
    c = cluster(3)
    peers = c.nodes["n0"]._parts.peers
    c.set_load("n2", 60)
    c.run_for(1.0)
    assert peers.mean_queue() > 0
    c.crash("n2")
    c.run_for(120.0)  # n1 (idle) keeps reporting; n2 is dead
    assert peers.mean_queue() == 0.0


def test_a_huge_queue_report_cannot_skew_the_mean_for_good() -> None:
    c = cluster(4)
    peers = c.nodes["n0"]._parts.peers
    deliver(c, forge(c, "n1", Load(2**32 - 1, 0, 0, 1 << 20, None)))
    assert peers.mean_queue() <= MAX_QUEUE_DEPTH / 3
    for peer in ("n1", "n2", "n3"):
        deliver(c, forge(c, peer, Load(0, 0, 0, 1 << 20, None)))
    assert peers.mean_queue() == 0.0


def test_a_queue_beyond_any_real_count_is_refused_at_decode() -> None:
    c = cluster(2)
    data = CODEC.encode(forge(c, "n1", Load(2**63 - 1, 0, 0, 1 << 20, None)))
    with pytest.raises(RemoteProtocolError, match="queue_depth"):
        CODEC.decode(data)
    before = c.nodes["n0"].metrics().get("messages_rejected", 0)
    c.nodes["n0"].handle(MessageReceived(data, None), c.now)
    assert c.nodes["n0"].metrics()["messages_rejected"] == before + 1


def test_a_relayed_stamp_from_the_future_is_dropped_and_counted() -> None:
    c = cluster(3)
    n0 = c.nodes["n0"]
    est = n0._parts.gossip.estimates["n2"]
    before = est.stamp
    lie = NodeState("n2", TwinCluster.address("n2"), c.nodes["n2"].config.incarnation, 10**6,
                    1e300, Load(0, 0, 0, 1 << 20, None, pushback_s=1e300), None)
    deliver(c, forge(c, "n1", Load(0, 0, 0, 1 << 20, None), relays=(lie,)))
    assert est.stamp == before and est.pushback_until is None
    assert n0.metrics()["gossip_relays_from_future"] == 1
    c.set_load("n2", 7)
    c.run_for(5.0)
    assert est.load is not None and est.load.queue_depth == 7
    assert n0._parts.peers.available("n2", c.now)


def test_a_stamp_held_far_ahead_of_the_peers_own_gives_way_to_its_next_message() -> None:
    """A future stamp that got in before the peer was ever heard first-hand (so nothing told
    where its clock stands): the peer's own next message replaces it."""
    c = cluster(3)
    n0 = c.nodes["n0"]
    est = n0._parts.gossip.estimates["n2"]
    est.stamp = (est.stamp or 0.0) + 10 * STAMP_AHEAD_S  # as a relay from the future left it
    c.set_load("n2", 5)
    c.run_for(5.0)
    assert est.load is not None and est.load.queue_depth == 5
    assert n0.metrics()["gossip_future_stamps_dropped"] >= 1


def test_an_endless_push_back_is_held_to_the_longest_back_off() -> None:
    c = cluster(3)
    n0 = c.nodes["n0"]
    deliver(c, forge(c, "n2", Load(0, 0, 0, 1 << 20, None, pushback_s=1e300)))
    est = n0._parts.gossip.estimates["n2"]
    cap = n0.config.gossip.exchange.max_retry_after_s
    assert est.pushback_until is not None and est.pushback_until <= c.now + cap


def test_a_peer_view_grown_past_one_snapshots_worth_is_dropped() -> None:
    """Deltas that add up to more hashes than a whole summary may carry: what the node holds
    of that peer is wrong; it is dropped (bounded memory) and counted, to be sent whole."""
    c = TwinCluster(2, seed=3, gossip=GossipConfig(max_hashes=1000))
    c.change_cache("n1", added=range(1, 10))
    c.run_for(2.0)
    n0 = c.nodes["n0"]
    est = n0._parts.gossip.estimates["n1"]
    view = n0._parts.gossip.payload.view
    assert est.version is not None and view.size("n1") == 9
    base = est.version
    for i in range(3):  # 3 x 400 new hashes: 1,209 > 1,000
        first = 10_000 * (i + 1)
        change = Change(base + i + 1, tuple(range(first, first + 400)), ())
        deliver(c, forge(c, "n1", Load(0, 0, 0, 1 << 20, None), summary=Delta(base + i, (change,))))
    assert view.size("n1") == 0 and est.version is None
    assert n0.metrics()["gossip_views_over_limit"] == 1
