"""The gossip layer's parts on their own: the cache payload, failure detection, and the
tuning knobs of GossipConfig taking effect."""

from __future__ import annotations

import random
from dataclasses import replace

from radixmesh.core.blocks import Fingerprint
from radixmesh.core.cache_payload import CachePayload
from radixmesh.core.cache_summary import LocalSummary
from radixmesh.core.config import GossipConfig, MembershipConfig, NodeConfig
from radixmesh.core.dissemination import Payload
from radixmesh.core.events import Action, Log, PeerStateChanged
from radixmesh.core.failure import FailureDetector
from radixmesh.core.membership import Membership, MemberState
from radixmesh.core.messages import Change, PeerAddress, Snapshot
from radixmesh.core.peerview import PeerView

FP = Fingerprint("m", "t", 16)


def config(membership: MembershipConfig | None = None, seeds: tuple[str, ...] = ()) -> NodeConfig:
    gossip = GossipConfig(membership=membership or MembershipConfig())
    return NodeConfig("me", "me:1", FP, 1, seeds=seeds, gossip=gossip)


def detector(cfg: NodeConfig) -> tuple[FailureDetector, list[str]]:
    dropped: list[str] = []
    members = Membership(cfg.node_id, cfg.seeds)
    return FailureDetector(cfg, members, random.Random(0), {}, dropped.append, 4096), dropped


# ---------------------------------------------------------------------------- payload
def test_cache_payload_is_a_payload_and_moves_summaries() -> None:
    summary, view = LocalSummary(1024), PeerView()
    payload: Payload = CachePayload(summary, view)
    summary.apply([1, 2, 3], ())
    assert payload.version == 1 and payload.local_state().hashes == (1, 2, 3)
    delta = payload.local_changes(0)
    assert delta is not None and [c.version for c in delta.changes] == [1]
    payload.merge_remote_state("p", Snapshot(4, (10, 11)))
    payload.merge_remote_changes("p", [Change(5, (12,), (10,)), Change(6, (13,), ())])
    assert view.held("p") == {11, 12, 13}
    assert payload.remote_state("p", 6, limit=2) is None  # over the limit
    snap = payload.remote_state("p", 6, limit=10)
    assert snap == Snapshot(6, (11, 12, 13))
    assert payload.remote_state("p", 6, limit=10) is snap  # built once per version
    payload.forget_remote("p")
    assert "p" not in view and payload.remote_state("p", 7, 10) == Snapshot(7, ())


def test_received_snapshot_is_relayed_without_rebuilding_it() -> None:
    payload = CachePayload(LocalSummary(16), PeerView())
    snap = Snapshot(3, (5, 6))
    payload.merge_remote_state("p", snap)
    assert payload.remote_state("p", 3, 100) is snap


# -------------------------------------------------------------------- failure detector
def test_join_restart_and_stale_incarnations() -> None:
    fd, dropped = detector(config())
    out: list[Action] = []
    est = fd.resolve("p", 2, "p:1", 0.0, out)
    assert est is not None and est.incarnation == 2
    assert PeerStateChanged("p", "unknown", "alive") in out
    est.version = 7
    assert fd.resolve("p", 1, "p:1", 1.0, out) is None  # older incarnation: stale
    assert fd.resolve("p", 3, "p:2", 1.0, out) is est  # restart: state dropped
    assert est.version is None and est.incarnation == 3 and dropped == ["p"]
    member = fd.members.get("p")
    assert member is not None and member.address == "p:2"
    assert any(isinstance(a, Log) and "restarted" in a.message for a in out)


def test_hearsay_adopts_first_incarnation_and_is_forgotten_if_silent() -> None:
    fd, _ = detector(config())
    out: list[Action] = []
    fd.learn_peers((PeerAddress("q", "q:1"),), 0.0, out)
    assert fd.estimates["q"].hearsay and "q" not in fd.routable
    fd.expire(fd.cfg.dead_after_s + 1.0)
    assert "q" not in fd.members and "q" not in fd.estimates  # no tombstone for a rumour
    fd.learn_peers((PeerAddress("r", "r:1"),), 0.0, out)
    est = fd.resolve("r", 5, "r:1", 0.5, out)
    assert est is not None and not est.hearsay and est.incarnation == 5


def test_member_cap_comes_from_the_config() -> None:
    fd, _ = detector(config(MembershipConfig(max_members=2)))
    out: list[Action] = []
    fd.learn_peers(tuple(PeerAddress(f"p{i}", f"p{i}:1") for i in range(5)), 0.0, out)
    assert len(fd.members) == 2 and fd.metrics["members_full_ignored"] == 1
    assert fd.resolve("z", 1, "z:1", 0.0, out) is None


def test_dead_probe_and_seed_cadences_come_from_the_config() -> None:
    cfg = config(MembershipConfig(dead_probe_every=3, seed_every=2), seeds=("s:1",))
    fd, _ = detector(cfg)
    out: list[Action] = []
    assert fd.seeds_due() == ["s:1"]  # lonely: every round
    fd.resolve("p", 1, "p:1", 0.0, out)
    fd.resolve("d", 1, "d:1", 0.0, out)
    fd.heard("p", 100.0, out)
    fd.expire(100.0)
    member = fd.members.get("d")
    assert member is not None and member.state is MemberState.DEAD
    probes, seeds = [], []
    for _ in range(6):
        fd.begin_round()
        probes.append(fd.dead_due())
        seeds.append(fd.seeds_due())
    assert probes == [[], [], ["d"], [], [], ["d"]]
    assert seeds == [[], ["s:1"], [], ["s:1"], [], ["s:1"]]


def test_back_after_silence_resends_from_the_ack() -> None:
    fd, _ = detector(config())
    out: list[Action] = []
    est = fd.resolve("p", 1, "p:1", 0.0, out)
    assert est is not None
    est.sent_version, est.unacked_since = 9, 1.0
    fd.expire(fd.cfg.suspect_after_s + 0.1)
    fd.heard_relayed(est, 5, fd.cfg.suspect_after_s + 0.2, out)
    assert est.heartbeat == 5 and est.sent_version is None and est.unacked_since is None
    fd.heard_relayed(est, 5, 10.0, out)  # not newer: not a heartbeat
    member = fd.members.get("p")
    assert member is not None and member.last_heard < 10.0


def test_peer_sample_size_comes_from_the_config() -> None:
    fd, _ = detector(config(replace(MembershipConfig(), peer_sample=2)))
    out: list[Action] = []
    for i in range(6):
        fd.resolve(f"p{i}", 1, f"p{i}:1", 0.0, out)
    fd.begin_round()
    sample = fd.peer_list("p0", first=True, full=False, sent=1)
    assert 2 <= len(sample) <= 3 and all(p.node_id != "p0" for p in sample)
    assert len(fd.peer_list(None, first=True, full=True, sent=0)) == 6
    assert fd.peer_list("p0", first=False, full=False, sent=3) == ()
