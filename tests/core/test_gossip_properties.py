"""Hypothesis: an adversarial network (any order, duplicates, losses, stale replays) never
regresses or corrupts a view, and delivery of fresh rounds always converges."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from radixmesh.core.blocks import Fingerprint
from radixmesh.core.config import GossipConfig, GossipMode, JoinConfig, NodeConfig
from radixmesh.core.events import CacheChanged, MessageReceived, Send, Tick
from radixmesh.core.node import NodeCore

FP = Fingerprint("prop-model", "bytes", 16)
IDS = ("a", "b", "c")

op = st.one_of(
    st.tuples(st.just("change"), st.integers(0, 2), st.integers(0, 5), st.integers(0, 3)),
    st.tuples(st.just("tick"), st.integers(0, 2), st.just(0), st.just(0)),
    st.tuples(st.just("deliver"), st.integers(0, 10_000), st.just(0), st.just(0)),
)


class Mesh:
    """Three nodes whose every sent message goes into a pool the test delivers at will."""

    def __init__(self, mode: GossipMode, log_limit: int) -> None:
        gossip = GossipConfig(
            mode=mode, change_log_limit=log_limit, suspect_after_s=1e6, dead_after_s=1e6
        )
        self.now = 0.0
        self.nodes = {
            i: NodeCore(
                NodeConfig(i, f"mem://{i}", FP, 1, seeds=("mem://a",), gossip=gossip),
                random.Random(i),
                0.0,
            )
            for i in IDS
        }
        self.pool: list[tuple[str, bytes]] = []
        self.history: dict[str, dict[int, frozenset[int]]] = {i: {0: frozenset()} for i in IDS}
        self.seen: dict[tuple[str, str], int] = {}
        self.rng = random.Random(0)

    def tick(self, i: str) -> None:
        self.now += 0.6
        node = self.nodes[i]
        for a in node.handle(Tick(), max(self.now, node.next_deadline())):
            if isinstance(a, Send):
                self.pool.append((a.address.removeprefix("mem://"), a.payload))

    def change(self, i: str, n_add: int, n_remove: int) -> None:
        node = self.nodes[i]
        held = sorted(node.local_hashes())
        removed = held[:n_remove]
        added = [self.rng.getrandbits(64) for _ in range(n_add)]
        node.handle(CacheChanged(tuple(added), tuple(removed)), self.now)
        self.history[i][int(node.metrics()["summary_version"])] = node.local_hashes()

    def deliver(self, k: int) -> None:
        if not self.pool:
            return
        dst, payload = self.pool[k % len(self.pool)]  # kept in the pool: may come again
        for a in self.nodes[dst].handle(MessageReceived(payload), self.now):
            if isinstance(a, Send):
                self.pool.append((a.address.removeprefix("mem://"), a.payload))

    def check(self) -> None:
        for obs, node in self.nodes.items():
            for peer in IDS:
                version = node.view_version(peer)
                if peer == obs or version is None:
                    continue
                assert version >= self.seen.get((obs, peer), 0), "view went backwards"
                self.seen[(obs, peer)] = version
                assert node.estimate(peer) == self.history[peer][version], "view is not a state"

    def converge(self) -> bool:
        # Fresh rounds delivered in order, nothing lost: enough of them for a node that knows
        # no alive peer yet (its seed's answers all lost so far) to reach its next seed
        # contact, which backs off up to ``seed_backoff_max_rounds`` rounds, and then spread.
        for _ in range(JoinConfig().seed_backoff_max_rounds + 6):
            for i in IDS:
                start = len(self.pool)
                self.tick(i)
                fresh = self.pool[start:]
                del self.pool[start:]
                for dst, payload in fresh:
                    self._deliver_now(dst, payload)
        return all(
            self.nodes[o].estimate(p) == self.nodes[p].local_hashes()
            for o in IDS
            for p in IDS
            if o != p
        )

    def _deliver_now(self, dst: str, payload: bytes) -> None:
        for a in self.nodes[dst].handle(MessageReceived(payload), self.now):
            if isinstance(a, Send):
                self._deliver_now(a.address.removeprefix("mem://"), a.payload)


@given(
    st.sampled_from(list(GossipMode)),
    st.sampled_from([4, 1000]),
    st.lists(op, min_size=1, max_size=60),
)
@settings(max_examples=120, deadline=None)
def test_adversarial_delivery_never_regresses_and_fresh_rounds_converge(
    mode: GossipMode, log_limit: int, ops: list[tuple[str, int, int, int]]
) -> None:
    mesh = Mesh(mode, log_limit)
    for i in IDS:
        mesh.tick(i)
    for kind, x, y, z in ops:
        if kind == "change":
            mesh.change(IDS[x], y, z)
        elif kind == "tick":
            mesh.tick(IDS[x])
        else:
            mesh.deliver(x)
        mesh.check()
    assert mesh.converge()
    mesh.check()
