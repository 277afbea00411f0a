"""The in-memory twin cluster: N real ``NodeCore``s over a :class:`FakeNetwork`, virtual clock.

Theory of operation
-------------------
The harness is a tiny discrete-event shell, the same interpreter of actions as the runtime::

    loop:  t = min(next delivery, every live node's next_deadline())
           clock := t; deliver due datagrams (MessageReceived); Tick nodes that are due
           carry out their actions: Send -> network, Log / PeerStateChanged -> recorded

Tests mutate a node's cache (``change_cache``), set its load, crash, restart or partition it,
and ask whether every live node's estimate of every other live node equals the truth
(``converged``). Everything is seeded: the same seed replays the same run.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from radixmesh.core.blocks import Fingerprint
from radixmesh.core.config import GossipConfig, GossipMode, NodeConfig, PushbackConfig
from radixmesh.core.events import (
    Action,
    CacheChanged,
    Event,
    LoadChanged,
    Log,
    MessageReceived,
    PeerStateChanged,
    Send,
    Tick,
)
from radixmesh.core.node import NodeCore
from radixmesh.core.router import RouterConfig
from radixmesh.testing.fakenet import FakeNetwork, LinkConfig, VirtualClock

DEFAULT_FINGERPRINT = Fingerprint("test-model", "bytes", 16)


@dataclass(frozen=True, slots=True)
class Recorded:
    at: float
    node_id: str
    action: Log | PeerStateChanged


class TwinCluster:
    """N nodes named ``n0 .. n{N-1}`` at addresses ``mem://n0 ..``; ``n0`` is everyone's seed."""

    def __init__(
        self,
        n: int,
        *,
        mode: GossipMode | None = None,  # overrides gossip.mode when given
        gossip: GossipConfig | None = None,
        pushback: PushbackConfig | None = None,
        router: RouterConfig | None = None,
        link: LinkConfig | None = None,
        seed: int = 0,
        fingerprint: Fingerprint = DEFAULT_FINGERPRINT,
        decision_log: int = 0,  # routing decisions each node keeps (NodeConfig.decision_log)
    ) -> None:
        self.clock = VirtualClock()
        self.decision_log = decision_log
        self.net = FakeNetwork(random.Random(seed), link)
        base = gossip or GossipConfig()
        self.gossip = base if mode is None else replace(base, mode=mode)
        self.pushback = pushback or PushbackConfig()
        self.router = router or RouterConfig()
        self.fingerprint = fingerprint
        self.nodes: dict[str, NodeCore] = {}
        self.records: list[Recorded] = []
        self._seed = seed
        self._incarnations: dict[str, int] = {}
        for i in range(n):
            self.add_node(f"n{i}")

    # ---------------------------------------------------------------------- membership
    @staticmethod
    def address(node_id: str) -> str:
        return f"mem://{node_id}"

    @property
    def now(self) -> float:
        return self.clock.now

    def add_node(
        self,
        node_id: str,
        *,
        fingerprint: Fingerprint | None = None,
        seeds: tuple[str, ...] | None = None,
    ) -> NodeCore:
        """Start (or restart, with a higher incarnation and an empty cache) ``node_id``."""
        incarnation = self._incarnations.get(node_id, 0) + 1
        self._incarnations[node_id] = incarnation
        config = NodeConfig(
            node_id=node_id,
            address=self.address(node_id),
            fingerprint=fingerprint or self.fingerprint,
            incarnation=incarnation,
            seeds=(self.address("n0"),) if seeds is None else seeds,
            router=self.router,
            gossip=self.gossip,
            pushback=self.pushback,
            decision_log=self.decision_log,
        )
        rng = random.Random(f"{self._seed}/{node_id}/{incarnation}")
        node = NodeCore(config, rng, self.clock.now)
        self.nodes[node_id] = node
        return node

    def crash(self, node_id: str) -> None:
        """Stop ``node_id`` silently; datagrams to it are lost."""
        self.nodes.pop(node_id)

    def restart(self, node_id: str) -> NodeCore:
        self.nodes.pop(node_id, None)
        return self.add_node(node_id)

    def partition(self, *groups: Iterable[str]) -> None:
        self.net.partition(*({self.address(n) for n in g} for g in groups))

    def heal(self) -> None:
        self.net.heal()

    # --------------------------------------------------------------------------- events
    def change_cache(
        self, node_id: str, added: Iterable[int] = (), removed: Iterable[int] = ()
    ) -> None:
        self.deliver(node_id, CacheChanged(tuple(added), tuple(removed)))

    def set_load(self, node_id: str, queue_depth: int, inflight: int = 0) -> None:
        self.deliver(node_id, LoadChanged(queue_depth, inflight, 0, 1 << 20))

    def busy_for(self, seconds: Mapping[str, float]) -> None:
        """Each named node has a request queued or running from now for its number of
        seconds (what its utilization measures); the clock runs until the longest ends."""
        for node_id in seconds:
            self.set_load(node_id, 1, 1)
        ran = 0.0
        for node_id, s in sorted(seconds.items(), key=lambda kv: kv[1]):
            self.run_for(max(0.0, s - ran))
            ran = max(ran, s)
            self.set_load(node_id, 0)

    def deliver(self, node_id: str, event: Event) -> list[Action]:
        node = self.nodes[node_id]
        actions = node.handle(event, self.clock.now)
        self._carry_out(node, actions)
        return actions

    def _carry_out(self, node: NodeCore, actions: list[Action]) -> None:
        src = node.config.address
        for a in actions:
            if isinstance(a, Send):
                self.net.send(src, a.address, a.payload, self.clock.now)
            else:
                self.records.append(Recorded(self.clock.now, node.node_id, a))

    # ---------------------------------------------------------------------------- time
    def run_for(self, seconds: float) -> None:
        self.run_until(self.clock.now + seconds)

    def run_until(self, t_end: float) -> None:
        while True:
            t = self._next_event_time()
            if t is None or t > t_end:
                self.clock.advance_to(t_end)
                return
            self.clock.advance_to(t)
            self._step()

    def _next_event_time(self) -> float | None:
        times = [n.next_deadline() for n in self.nodes.values()]
        net = self.net.next_time()
        if net is not None:
            times.append(net)
        return min(times) if times else None

    def _step(self) -> None:
        now = self.clock.now
        by_address = {n.config.address: n for n in self.nodes.values()}
        for d in self.net.pop_due(now):
            node = by_address.get(d.dst)
            if node is not None:
                self._carry_out(node, node.handle(MessageReceived(d.payload, d.src), now))
        for node in list(self.nodes.values()):
            if node.next_deadline() <= now:
                self._carry_out(node, node.handle(Tick(), now))

    # ----------------------------------------------------------------------- inspection
    def truth(self, node_id: str) -> frozenset[int]:
        return self.nodes[node_id].local_hashes()

    def stale_pairs(self, among: Iterable[str] | None = None) -> list[tuple[str, str]]:
        """(observer, peer) pairs whose estimate differs from the peer's truth."""
        ids = list(self.nodes) if among is None else list(among)
        out = []
        for observer in ids:
            for peer in ids:
                if peer == observer:
                    continue
                if self.nodes[observer].estimate(peer) != self.truth(peer):
                    out.append((observer, peer))
        return out

    def converged(self, among: Iterable[str] | None = None) -> bool:
        return not self.stale_pairs(among)

    def run_until_converged(
        self, timeout_s: float, among: Iterable[str] | None = None, step_s: float = 0.01
    ) -> float | None:
        """Run until converged; returns the virtual time it took, or None on timeout."""
        ids = None if among is None else list(among)
        start = self.clock.now
        while self.clock.now - start <= timeout_s:
            if self.converged(ids):
                return self.clock.now - start
            self.run_for(step_s)
        return None

    def logs(self, node_id: str | None = None, level: str | None = None) -> list[Log]:
        out = []
        for r in self.records:
            a = r.action
            if isinstance(a, Log) and node_id in (None, r.node_id) and level in (None, a.level):
                out.append(a)
        return out

    def state_changes(self, node_id: str | None = None) -> list[PeerStateChanged]:
        return [
            r.action
            for r in self.records
            if isinstance(r.action, PeerStateChanged) and node_id in (None, r.node_id)
        ]

    def metric(self, name: str) -> float:
        """Sum of one metric over all live nodes."""
        return sum(n.metrics().get(name, 0.0) for n in self.nodes.values())
