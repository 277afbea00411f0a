"""Anti-entropy over the fake network: convergence, ordering faults, restarts, partitions."""

from __future__ import annotations

import random

import pytest

from radixmesh.core.codec import Codec
from radixmesh.core.config import GossipConfig, GossipMode
from radixmesh.core.events import MessageReceived
from radixmesh.core.messages import Gossip
from radixmesh.testing import LinkConfig, TwinCluster

DIRECT = [GossipMode.SNAPSHOT, GossipMode.DELTA]
DELTA_T = 0.5  # Δpoll of the default GossipConfig


def churn(c: TwinCluster, rng: random.Random, node: str, n_add: int, n_remove: int) -> None:
    held = sorted(c.truth(node))
    removed = rng.sample(held, min(n_remove, len(held)))
    c.change_cache(node, [rng.getrandbits(64) for _ in range(n_add)], removed)


def joined(c: TwinCluster) -> None:
    c.run_for(3 * DELTA_T)
    for node in c.nodes.values():
        assert node.metrics()["peers_alive"] == len(c.nodes) - 1, node.node_id


@pytest.mark.parametrize("mode", DIRECT)
def test_views_equal_truth_within_two_rounds_after_last_change(mode: GossipMode) -> None:
    rng = random.Random(1)
    c = TwinCluster(5, mode=mode, seed=1)
    joined(c)
    for _ in range(20):  # changes keep arriving at random nodes and times
        churn(c, rng, f"n{rng.randrange(5)}", n_add=rng.randrange(1, 40), n_remove=5)
        c.run_for(rng.random() * DELTA_T)
    churn(c, rng, "n3", n_add=5, n_remove=1)
    assert not c.converged()  # the last change cannot have travelled yet
    c.run_for(2 * DELTA_T)
    assert c.stale_pairs() == []


@pytest.mark.parametrize("mode", list(GossipMode))
def test_converges_under_half_loss(mode: GossipMode) -> None:
    rng = random.Random(2)
    c = TwinCluster(6, mode=mode, seed=2, link=LinkConfig(delay_s=0.002, jitter_s=0.003, loss=0.5))
    c.run_for(5.0)
    for i in range(6):
        churn(c, rng, f"n{i}", n_add=50, n_remove=0)
    c.run_for(2.0)
    for i in range(6):
        churn(c, rng, f"n{i}", n_add=10, n_remove=20)
    assert c.run_until_converged(30.0, step_s=0.1) is not None
    assert c.net.stats["dropped"] > 0.4 * c.net.stats["sent"]


def test_epidemic_converges_and_keeps_everyone_alive_at_larger_n() -> None:
    rng = random.Random(3)
    gossip = GossipConfig(fanout=3, suspect_after_s=3.0, dead_after_s=10.0)
    c = TwinCluster(24, mode=GossipMode.EPIDEMIC, gossip=gossip, seed=3)
    c.run_for(8.0)
    for i in range(24):
        churn(c, rng, f"n{i}", n_add=20, n_remove=0)
    took = c.run_until_converged(10.0, step_s=0.1)
    assert took is not None
    for node in c.nodes.values():  # liveness travels through relayed heartbeats
        assert node.metrics()["peers_suspect"] == 0
        assert node.metrics()["peers_alive"] == 23
    # each node talked directly to far fewer than all peers per round
    rounds = c.metric("gossip_rounds")
    assert c.metric("gossip_messages_out") < rounds * 2 * (3 + 1)


def test_epidemic_detects_a_crash() -> None:
    gossip = GossipConfig(fanout=3, suspect_after_s=2.0, dead_after_s=6.0)
    c = TwinCluster(12, mode=GossipMode.EPIDEMIC, gossip=gossip, seed=4)
    c.run_for(6.0)
    c.crash("n5")
    c.run_for(10.0)
    assert all(n.peer_state("n5") == "dead" for n in c.nodes.values())


@pytest.mark.parametrize("mode", list(GossipMode))
def test_duplicates_and_reordering_never_regress_or_corrupt_a_view(mode: GossipMode) -> None:
    rng = random.Random(5)
    link = LinkConfig(delay_s=0.001, jitter_s=0.2, duplicate=0.5, reorder=0.5, reorder_window_s=2)
    c = TwinCluster(4, mode=mode, seed=5, link=link)
    history: dict[str, dict[int, frozenset[int]]] = {f"n{i}": {0: frozenset()} for i in range(4)}
    seen: dict[tuple[str, str], int] = {}
    for step in range(300):
        if step % 10 == 0:
            node = f"n{rng.randrange(4)}"
            churn(c, rng, node, n_add=rng.randrange(1, 8), n_remove=rng.randrange(0, 4))
            history[node][int(c.nodes[node].metrics()["summary_version"])] = c.truth(node)
        c.run_for(0.05)
        for obs, node in c.nodes.items():
            for peer in c.nodes:
                version = node.view_version(peer)
                if peer == obs or version is None:
                    continue
                assert version >= seen.get((obs, peer), 0), "a view went backwards"
                seen[(obs, peer)] = version
                assert node.estimate(peer) == history[peer][version], "a view is not a state"
    assert c.net.stats["duplicated"] > 0
    assert c.run_until_converged(10.0) is not None


@pytest.mark.parametrize("mode", list(GossipMode))
def test_restart_replaces_the_old_estimate_at_once(mode: GossipMode) -> None:
    rng = random.Random(6)
    c = TwinCluster(3, mode=mode, seed=6)
    joined(c)
    churn(c, rng, "n2", n_add=100, n_remove=0)
    c.run_for(2 * DELTA_T)
    old = c.truth("n2")
    assert c.nodes["n0"].estimate("n2") == old
    c.restart("n2")
    churn(c, rng, "n2", n_add=30, n_remove=0)
    c.run_for(0.05)  # n2's first Tick joins through the seed (n0) at once
    assert c.nodes["n0"].estimate("n2") == c.truth("n2")
    assert c.nodes["n0"].estimate("n2").isdisjoint(old)
    assert c.nodes["n0"].metrics()["peer_restarts"] == 1
    assert c.run_until_converged(2 * DELTA_T) is not None


def test_partition_keeps_both_sides_working_and_healing_converges() -> None:
    rng = random.Random(7)
    c = TwinCluster(6, seed=7)
    joined(c)
    left, right = ["n0", "n1", "n2"], ["n3", "n4", "n5"]
    c.partition(left, right)
    for node in left + right:
        churn(c, rng, node, n_add=40, n_remove=0)
    c.run_for(12.0)  # longer than dead_after_s (10 s)
    assert c.converged(left) and c.converged(right)
    for node in left:
        assert c.nodes[node].peer_state("n4") == "dead"
        assert c.nodes[node].estimate("n4") == frozenset()
        hashes = sorted(c.truth("n1"))[:4]
        candidates = c.nodes[node].route(hashes, 64, 0, 1, c.now)
        assert {cand.node_id for cand in candidates} <= set(left)
    c.heal()
    took = c.run_until_converged(10.0, step_s=0.1)
    assert took is not None
    assert all(n.metrics()["peers_alive"] == 5 for n in c.nodes.values())


def test_delta_mode_falls_back_to_snapshot_when_the_receiver_is_behind_the_log() -> None:
    rng = random.Random(8)
    c = TwinCluster(3, gossip=GossipConfig(change_log_limit=32), seed=8)
    joined(c)
    c.partition(["n0", "n2"], ["n1"])
    for _ in range(10):
        churn(c, rng, "n0", n_add=10, n_remove=3)  # > 32 hashes of changes
        c.run_for(0.2)
    c.heal()
    assert c.run_until_converged(3.0) is not None
    assert c.nodes["n0"].metrics()["gossip_snapshot_fallbacks"] > 0


def test_delta_steady_state_bytes_follow_churn_not_cache_size() -> None:
    rng = random.Random(9)
    c = TwinCluster(3, seed=9)
    joined(c)
    churn(c, rng, "n0", n_add=20_000, n_remove=0)
    c.run_for(2.0)
    before = c.nodes["n0"].metrics()
    c.run_for(10.0)  # no changes: only heartbeats
    after = c.nodes["n0"].metrics()
    per_message = (after["gossip_bytes_out"] - before["gossip_bytes_out"]) / (
        after["gossip_messages_out"] - before["gossip_messages_out"]
    )
    assert per_message < 200


def test_rtt_is_measured_through_gossip_without_clock_sync() -> None:
    c = TwinCluster(2, seed=10, link=LinkConfig(delay_s=0.005))
    c.run_for(3.0)
    peer = next(p for p in c.nodes["n0"].mesh_state(c.now)["peers"])  # type: ignore[attr-defined]
    assert peer["rtt_measured"] is True
    assert peer["rtt_s"] == pytest.approx(0.010, abs=1e-6)


def test_epidemic_rumors_reach_every_node_quickly_beyond_the_full_digest() -> None:
    # Above DIGEST_FULL nodes digests are samples, so a node the rumors miss waits for a
    # digest that happens to name the changed node (~48/N per message). A guard on that path
    # at 100 nodes; the tail it bounds grows with N (docs/scale.md §3 measures 512 and 1,024).
    rng = random.Random(4)
    gossip = GossipConfig(fanout=3, suspect_after_s=6.0, dead_after_s=20.0)
    c = TwinCluster(100, mode=GossipMode.EPIDEMIC, gossip=gossip, seed=4)
    c.run_for(12.0)
    assert c.run_until_converged(20.0, step_s=0.25) is not None  # the join
    churn(c, rng, "n7", n_add=16, n_remove=0)
    took = c.run_until_converged(20.0, step_s=0.05)
    assert took is not None
    assert took <= 5 * gossip.interval_s, took


def _sent(c: TwinCluster, src: str, dst: str) -> list[Gossip]:
    """From now on, every message ``src`` sends ``dst`` (decoded), in order."""
    out: list[Gossip] = []
    send, codec = c.net.send, Codec()

    def spy(a: str, b: str, payload: bytes, now: float) -> None:
        if (a, b) == (c.address(src), c.address(dst)):
            out.append(codec.decode(payload))
        send(a, b, payload, now)

    c.net.send = spy  # type: ignore[method-assign]
    return out


def test_identity_rides_until_acknowledged_then_every_sixteenth_message() -> None:
    """Protocol 3: address and fingerprint go with the first messages to a peer and then
    with one in ``identity_every`` (16): a peer that knows us needs neither."""
    c = TwinCluster(2, seed=3)
    msgs = _sent(c, "n0", "n1")
    c.run_for(20 * DELTA_T)
    with_identity = [m.address is not None for m in msgs]
    assert with_identity[0] and msgs[0].fingerprint is not None
    assert all((m.address is None) == (m.fingerprint is None) for m in msgs)
    assert not all(with_identity[2:])  # left out once acknowledged ...
    assert all(any(with_identity[i:i + 16]) for i in range(len(msgs) - 15))  # ... not for long
    assert c.converged()


def test_a_message_without_identity_from_a_stranger_is_refused() -> None:
    c = TwinCluster(2, seed=4)
    msgs = _sent(c, "n0", "n1")
    c.run_for(20 * DELTA_T)
    anonymous = next(m for m in msgs if m.address is None)
    stranger = c.add_node("n2", seeds=())  # knows nobody
    before = stranger.metrics()["messages_rejected_unverified"]
    c.deliver("n2", MessageReceived(Codec().encode(anonymous), c.address("n0")))
    assert stranger.metrics()["messages_rejected_unverified"] == before + 1
    assert stranger.peer_state("n0") is None  # not taken for a member
    c.nodes["n1"].handle(MessageReceived(Codec().encode(anonymous), None), c.now)  # known:
    assert c.nodes["n1"].metrics()["messages_rejected_unverified"] == 0  # accepted


def test_a_restarted_peer_gets_our_identity_again() -> None:
    c = TwinCluster(3, seed=5)
    c.run_for(10 * DELTA_T)
    c.change_cache("n0", [11, 12, 13])
    c.restart("n1")  # forgets everyone; n0 had stopped sending it our identity
    assert c.run_until_converged(timeout_s=10 * DELTA_T) is not None
    assert c.nodes["n1"].peer_state("n0") == "alive"
