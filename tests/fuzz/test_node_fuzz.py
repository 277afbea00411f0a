"""Fuzz of ``NodeCore.handle(MessageReceived(...))``: hostile peer bytes never raise.

Two properties:
- *malformed* bytes (arbitrary, or real gossip payloads mutated at byte level) never raise,
  are counted as rejected, and leave the node's state exactly as it was;
- *well-formed but hostile* messages (any field values, our own id as sender, relays about us,
  absurd versions and incarnations) never raise either, and the node keeps serving: ticks,
  routes and mesh snapshots still work afterwards. (Such a message can mislead the view — that
  is what peer authentication is for — but it cannot crash the node.)

The corpus of genuine payloads comes from a 3-node cluster on the in-memory network.
"""

from __future__ import annotations

import random
from functools import cache

from gossip_strategies import gossip_strategy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixmesh.core.codec import Codec
from radixmesh.core.events import Log, MessageReceived, PeerStateChanged, Send, Tick
from radixmesh.core.messages import Gossip
from radixmesh.core.node import NodeCore
from radixmesh.testing.twin import TwinCluster

SETTINGS = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@cache
def corpus() -> tuple[bytes, ...]:
    """Genuine payloads addressed to n0: joins, snapshots, deltas, push-back, replies."""
    cluster = TwinCluster(3, seed=7)
    seen: list[bytes] = []
    send = cluster.net.send

    def record(src: str, dst: str, payload: bytes, now: float) -> None:
        if dst == TwinCluster.address("n0"):
            seen.append(payload)
        send(src, dst, payload, now)

    cluster.net.send = record  # type: ignore[method-assign]
    cluster.run_for(1.0)
    cluster.change_cache("n1", added=range(1, 200))
    cluster.change_cache("n2", added=range(100, 150))
    cluster.run_for(1.0)
    cluster.change_cache("n1", removed=range(1, 50), added=range(500, 520))
    cluster.set_load("n2", queue_depth=50)
    cluster.run_for(1.0)
    assert len(seen) > 10
    return tuple(seen)


def fresh_node() -> tuple[TwinCluster, NodeCore]:
    """A running n0 that already knows n1 and n2."""
    cluster = TwinCluster(3, seed=11)
    cluster.change_cache("n1", added=range(1, 100))
    cluster.run_for(2.0)
    return cluster, cluster.nodes["n0"]


def assert_actions_ok(actions: object) -> None:
    assert isinstance(actions, list)
    for a in actions:
        assert isinstance(a, Send | Log | PeerStateChanged)
        if isinstance(a, Send):
            assert isinstance(a.payload, bytes) and a.address


def observable(node: NodeCore, now: float) -> tuple[object, ...]:
    mesh = node.mesh_state(now)
    peers = mesh.pop("peers")
    assert isinstance(peers, list)
    for p in peers:
        p.pop("age_s")
    return (mesh, peers, {p: node.estimate(p) for p in ("n1", "n2")})


def mutate(data: bytes, rng: random.Random, ops: int) -> bytes:
    out = bytearray(data)
    for _ in range(ops):
        i = rng.randrange(len(out) + 1)
        op = rng.randrange(4)
        if op == 0 and out:
            out[min(i, len(out) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:
            del out[i:]
        elif op == 2:
            out[i:i] = rng.randbytes(rng.randint(1, 6))
        elif out:
            out[min(i, len(out) - 1)] = rng.choice([0x00, 0xC1, 0xFF, 0xDD, 0xC6])
    return bytes(out)


@SETTINGS
@given(
    picks=st.lists(
        st.tuples(st.integers(0, 10_000), st.integers(0, 2**32), st.integers(1, 6)),
        min_size=1,
        max_size=8,
    ),
    junk=st.lists(st.binary(max_size=200), max_size=4),
)
def test_malformed_bytes_never_raise_and_change_nothing(
    picks: list[tuple[int, int, int]], junk: list[bytes]
) -> None:
    cluster, node = fresh_node()
    now = cluster.now
    codec = Codec()
    before = observable(node, now)
    rejected = node.metrics()["messages_rejected"]
    payloads = list(junk)
    for index, seed, ops in picks:
        genuine = corpus()[index % len(corpus())]
        payloads.append(mutate(genuine, random.Random(seed), ops))
    bad = 0
    for data in payloads:
        try:
            codec.decode(data)
            continue  # a mutation that is still a valid message: covered by the test below
        except Exception:
            bad += 1
        assert_actions_ok(node.handle(MessageReceived(data, "mem://x"), now))
    assert node.metrics()["messages_rejected"] == rejected + bad
    assert observable(node, now) == before


HOSTILE_IDS = st.sampled_from(["n0", "n1", "n2", "ghost", "n0 ", "x" * 128])


@SETTINGS
@given(
    msgs=st.lists(
        gossip_strategy(
            senders=HOSTILE_IDS,
            fingerprints=st.sampled_from([TwinCluster(1).fingerprint.digest, 0, 2**64 - 1]),
            ids=HOSTILE_IDS,
        ),
        min_size=1,
        max_size=6,
    ),
    dt=st.floats(0, 5),
)
def test_hostile_valid_messages_never_raise(msgs: list[Gossip], dt: float) -> None:
    cluster, node = fresh_node()
    codec = Codec()
    now = cluster.now
    before = node.metrics()
    for msg in msgs:
        assert_actions_ok(node.handle(MessageReceived(codec.encode(msg), None), now))
    after = node.metrics()
    # Every hostile message was taken in (none was lost to an exception); all of them decode,
    # so none counts as a malformed-bytes rejection.
    assert after["gossip_messages_in"] == before["gossip_messages_in"] + len(msgs)
    assert after["messages_rejected_decode"] == before["messages_rejected_decode"]
    # The node still works: timers, routing, metrics, mesh snapshot.
    assert_actions_ok(node.handle(Tick(), now + dt))
    assert_actions_ok(node.handle(Tick(), node.next_deadline()))
    ranked = node.route(tuple(range(1, 40)), 640, 0, 4, now + dt)
    assert ranked and ranked[0].node_id
    assert sum(c.is_self for c in ranked) == 1
    mesh = node.mesh_state(now + dt)
    assert mesh["node_id"] == "n0" and isinstance(mesh["peers"], list)


def test_genuine_corpus_is_accepted() -> None:
    """Sanity of the corpus: genuine payloads decode and are not rejected."""
    _, node = fresh_node()
    codec = Codec()
    assert {codec.decode(data).sender for data in corpus()} == {"n1", "n2"}
    rejected = node.metrics()["messages_rejected"]
    for data in corpus()[:5]:
        assert_actions_ok(node.handle(MessageReceived(data, None), 10.0))
    assert node.metrics()["messages_rejected"] == rejected


def test_member_flood_is_bounded_and_forgotten() -> None:
    """Gossip naming thousands of fake peers: the member table stays bounded, and peers known
    only by hearsay that never speak are forgotten (no tombstones), so real nodes can join."""
    from radixmesh.core.config import GossipConfig
    from radixmesh.core.messages import Load, PeerAddress

    max_members = GossipConfig().membership.max_members
    cluster, node = fresh_node()
    codec = Codec()
    fp = cluster.fingerprint.digest
    for k in range(max_members // 4096 + 2):
        peers = tuple(PeerAddress(f"fake{k}-{i}", f"10.9.{k}.{i % 250}:{1000 + i}")
                      for i in range(4096))
        msg = Gossip(sender="n1", address=TwinCluster.address("n1"), incarnation=1, version=0,
                     heartbeat=10_000 + k, fingerprint=fp, stamp=0.0,
                     load=Load(0, 0, 0, 1, None), peers=peers)
        assert_actions_ok(node.handle(MessageReceived(codec.encode(msg)), cluster.now))
    metrics = node.metrics()
    assert metrics["peers_alive"] + metrics["peers_suspect"] <= max_members
    assert metrics["members_full_ignored"] > 0
    cluster.run_for(node.config.gossip.dead_after_s + 2.0)  # the real peers keep talking
    # Rumours that never speak are forgotten (a few keep circulating through peer samples).
    assert node.metrics()["peers_alive"] + node.metrics()["peers_suspect"] < 64
    assert node.peer_state("n1") == node.peer_state("n2") == "alive"
