"""The simulator's shell: N ``NodeCore``s, simulated engines and a simulated network.

Theory of operation
-------------------
This is the second interpreter of ``NodeCore``'s actions (the asyncio runtime is the first).
Every node is a real :class:`~radixmesh.core.node.NodeCore` — routing, gossip, membership,
push-back and peer view are never re-implemented here. The shell only owns what the runtime
owns: a clock (virtual), the engine (a :class:`SimEngine`: the project's continuous-batching
scheduler and prefix cache, its steps timed by a step-time model) and the wire (a
:class:`Network`).

What happens to a client request is decided by the entry node's core (``core.lifecycle``);
this shell only delivers its actions and reports back what the simulated world did::

    entry E: tokenize, hash blocks, engine.match ── RequestArrived ──▶ E's core
      ExecuteLocally        -> E's engine (scheduler) -> RequestDone
      Forward(P)            -> one-way delay + hop overhead -> P's core: ForwardArrived
        RefuseForward       <- one-way delay back: ForwardRefused to E (next action follows)
        AcceptForward       -> P's engine (hop limit 1: P executes); ForwardAccepted
                               travels back to E; the response follows it:
                               RequestDone(forward_overhead_s) to E
        P down / reset / partitioned / silent -> ForwardFailed to E (next action follows)
    (the receiver answers a first byte at once and heartbeats while queued, so a live peer's
    forward never times out, however long its queue; a partitioned one does)
    an engine's scheduler takes a request its profile's admission_s after it arrived
    (``sim/engine.py``); it counts in the node's queue meanwhile
    serving node X, after each request: RequestServed, CacheChanged, LoadChanged
    serving node X on a profile, as each step with prefill chunks is planned and done:
    CacheChanged (the prompt blocks the scheduler cached, as the KV events of an emulated or
    vLLM engine's step come; a legacy cost model stands for the built-in engine, whose node
    learns them per request)
    engine: one event per step, or per run of identical decode steps (``SimEngine.plan``);
    a request arriving mid-run cuts the run at the step then running
    every node: Tick at core.next_deadline(); Send actions become deliveries (or losses)

Why one file over 400 lines: it is the simulator's whole world (nodes, queues, wire,
crashes) and its callbacks form one chain per request; split, that chain would be harder to
follow than long.

Crashes drop a node's queue and cache; requests forwarded to it fail back to their entry
after one one-way delay (connection reset) and the entry's core decides what next; requests
whose entry crashed are client errors. A restart is a fresh NodeCore with the next
incarnation and an empty cache.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from radixmesh.core.blocks import Fingerprint, block_hashes
from radixmesh.core.config import ForwardConfig, GossipConfig, NodeConfig, PushbackConfig
from radixmesh.core.estimators import CostPriors
from radixmesh.core.events import (
    AcceptForward,
    Action,
    CacheChanged,
    Event,
    ExecuteLocally,
    Forward,
    ForwardAccepted,
    ForwardArrived,
    ForwardFailed,
    ForwardRefused,
    LoadChanged,
    Log,
    MessageReceived,
    PeerStateChanged,
    QueueChanged,
    RefuseForward,
    RejectRequest,
    RequestArrived,
    RequestDone,
    RequestServed,
    Send,
    Tick,
)
from radixmesh.core.load_estimates import ArrivalRate, QueuedBlocks
from radixmesh.core.messages import busy_reply
from radixmesh.core.node import NodeCore
from radixmesh.core.profile import Profile
from radixmesh.core.router import DELIBERATE, Policy, RouterConfig
from radixmesh.core.shadow import RATE_MIN_SPAN, RATE_WINDOW_S, batch_state
from radixmesh.core.shadow_state import BatchState
from radixmesh.sim.clock import EventLoop
from radixmesh.sim.compute import SharedCompute
from radixmesh.sim.costs import CostModel
from radixmesh.sim.engine import Planned, SimEngine, SimRun
from radixmesh.sim.gateway import CacheAwareGateway, GatewayConfig, make_gateway
from radixmesh.sim.network import Network, NetworkConfig
from radixmesh.workload.request import Request

INF = float("inf")


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    nodes: int
    cost: CostModel
    router: RouterConfig = field(default_factory=RouterConfig)
    gossip: GossipConfig = field(default_factory=GossipConfig)
    pushback: PushbackConfig = field(default_factory=PushbackConfig)
    forward: ForwardConfig = field(default_factory=ForwardConfig)  # peer tries and timeouts
    network: NetworkConfig = field(default_factory=NetworkConfig)
    cache_tokens: int = 65_536  # per node
    block_size: int = 16
    seeds: int = 3  # each node joins through this many seed nodes (all nodes if N <= seeds+1)
    start_spread_s: float = 0.05  # nodes start at uniform random times in [0, spread)
    seed: int = 0
    model: str = "preset:tiny:seed0:float32"  # fingerprint identity (sim and real agree)
    tokenizer: str = "bytes"
    service_noise: float = 0.0  # sigma of a mean-1 log-normal factor on each request's time
    tuned_priors: bool = False  # router priors from the cost model (else the runtime defaults)
    # a centralized cache_aware gateway in front of the nodes (``sim/gateway.py``): every
    # request goes through it; the nodes must not route (policy none)
    gateway: GatewayConfig | None = None
    # the nodes' engines share one machine of this many cores (``sim/compute.py``:
    # processor sharing; None: every node has its own hardware)
    shared_cores: float | None = None
    # mixed hardware (``--profiles``): each node's own cost model, in node order; empty: every
    # node runs ``cost`` (which then stands for the cluster: priors, forward overhead)
    node_costs: tuple[CostModel, ...] = ()
    # records carry their serving node as the entry's router saw it (``Considered``)
    decisions: bool = False

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError("nodes must be >= 1")
        if self.node_costs and len(self.node_costs) != self.nodes:
            raise ValueError(f"node_costs: {len(self.node_costs)} for {self.nodes} nodes")
        if self.shared_cores is not None and not self.shared_cores > 0:
            raise ValueError("shared_cores must be > 0")
        if self.cache_tokens < 1 or self.block_size < 1 or self.seeds < 1:
            raise ValueError("cache_tokens, block_size and seeds must be >= 1")
        if self.gateway is not None and self.router.policy is not Policy.NONE:
            raise ValueError("the nodes behind a gateway run policy none")

    @property
    def policy_name(self) -> str:
        """The run's policy: the nodes' router policy, or the gateway's kind."""
        return self.gateway.kind if self.gateway is not None else self.router.policy.value

    def cost_of(self, idx: int) -> CostModel:
        """Node ``idx``'s cost model (its own under mixed hardware, else ``cost``)."""
        return self.node_costs[idx] if self.node_costs else self.cost

    def cache_of(self, idx: int) -> int:
        """Node ``idx``'s KV pool in tokens: under mixed hardware its profile's own (as its
        emulated engine has), else ``cache_tokens``."""
        profile = self.node_costs[idx].profile if self.node_costs else None
        return self.cache_tokens if profile is None else profile.kv_blocks * profile.block_size

    def priors(self) -> CostPriors:
        """The default priors (what ``radixmesh serve`` runs with), or, with ``tuned_priors``,
        priors taken from the cost model and the network, as a deployment configured for its
        hardware would have. Nodes learn their speeds and RTTs either way."""
        if not self.tuned_priors:
            return CostPriors()
        c = self.cost
        return CostPriors(
            rtt_s=2 * self.network.delay_s + c.forward_overhead_s,
            prefill_overhead_s=c.prefill_overhead_s + c.request_overhead_s,
            prefill_s_per_token=c.prefill_s_per_token,
            context_scale=c.context_scale,
            decode_s_per_token=c.decode_s_per_token,
        )


@dataclass(slots=True)
class Journey:
    """One client request, from arrival at its entry node to the response."""

    index: int  # also the request id the entry's core knows it by
    req: Request
    entry: int
    tokens: list[int]
    hashes: tuple[int, ...]
    t_arrival: float
    attempt: int = -1  # counts the core's Forward / ExecuteLocally actions (the current try)
    target: int = -1  # node executing the current try
    beat_s: float | None = None  # sent with the current forward
    route: str = "local"
    expected_cached: int = 0
    placement: str | None = None  # the router's tag of the current choice (Record.placement)
    estimate_error: int = 0  # expected - truth at the target at decision time (tokens)
    predicted_ttft_s: float | None = None  # the router's TTFT at the current try's node
    view_age_s: float = 0.0  # how long the estimate used had been out of date (0: current)
    considered: dict[str, object] | None = None  # the current try's node as its router saw it
    sent_at: float = 0.0
    served_by: int = -1
    cached: int = 0
    queue_s: float = 0.0
    service_s: float = 0.0
    decode_s: float = 0.0  # first token to the last on the serving engine
    decode_tokens: int = 0  # tokens it generated
    t_done: float = -1.0
    error: str | None = None
    via_gateway: bool = False  # sent through the gateway, which chose ``entry`` (counted there)
    client_leg_s: float = 0.0  # via the gateway, across regions: the client's one-way delay to it
    # what ``Counters`` counted of this request (a run's figures leave the warm-up's out)
    forward_failures: int = 0
    forward_refusals: int = 0
    deliberate_replicas: int = 0
    second_cold_copies: int = 0

    def current(self, attempt: int) -> bool:
        """Whether a callback made for try ``attempt`` still matters."""
        return self.attempt == attempt and self.t_done < 0 and self.error is None


@dataclass(slots=True)
class Work:
    flight: Journey
    attempt: int
    t_enqueued: float
    uncached: int = 0  # prompt tokens not cached when it was queued (set by ``_enqueue``)


class SimNode:
    __slots__ = (
        "address",
        "arrivals",
        "compute_key",
        "core",
        "engine",
        "epoch",
        "idx",
        "incarnation",
        "next_seq",
        "node_id",
        "planned",
        "planned_at",
        "planned_version",
        "queued_blocks",
        "queued_tokens",
        "served",
        "tick_at",
        "up",
        "version_times",
        "works",
    )

    def __init__(self, idx: int) -> None:
        self.idx = idx
        self.node_id = f"n{idx}"
        self.address = f"sim-{idx}:80"
        self.core: NodeCore | None = None
        self.engine: SimEngine | None = None
        self.works: dict[int, Work] = {}  # by engine sequence id: waiting or running
        self.next_seq = 0
        self.planned: Planned | None = None  # the step (or decode run) in flight
        self.planned_at = 0.0
        self.planned_version = 0  # bumps when the step in flight is replaced (a cut run)
        self.compute_key = -1  # the step in flight on the shared machine (if shared)
        # prompt, output budget and uncached prompt tokens of the work waiting or running,
        # summed, as the runtime reports them in LoadChanged (its bounded admission by
        # tokens, and the price of a place in its queue, see them as a real node's would)
        self.queued_tokens = [0, 0, 0]
        self.queued_blocks = QueuedBlocks(1)  # the cluster's block size: set by start()
        self.up = False
        self.incarnation = -1
        self.epoch = 0  # bumps on crash: stale callbacks for an old life are ignored
        self.tick_at = INF
        self.served = 0
        # requests its engine took per second lately (a batch report's rate; as a shadow's)
        self.arrivals = ArrivalRate(RATE_WINDOW_S, RATE_MIN_SPAN)
        self.version_times: list[float] = []  # [v - 1]: when summary version v was made

    @property
    def depth(self) -> int:
        return len(self.works)


@dataclass(slots=True)
class Counters:
    gossip_messages: int = 0
    gossip_bytes: int = 0
    gossip_lost: int = 0
    forwards: int = 0
    forward_failures: int = 0
    forward_refusals: int = 0
    # cold prefills of a prefix (the router's placement key) that another node's engine held
    # when the request was placed: deliberate hot-prefix replicas (the router tagged the
    # node a replica owner) and accidental second copies (everything else)
    deliberate_replicas: int = 0
    second_cold_copies: int = 0
    logs: dict[str, int] = field(default_factory=dict)
    peer_states: list[tuple[float, str, str, str, str]] = field(default_factory=list)


OnJourneyDone = Callable[[Journey], None]


class SimCluster:
    """N simulated nodes on one event loop; requests go in via :meth:`submit`."""

    def __init__(self, config: ClusterConfig, loop: EventLoop | None = None) -> None:
        self.config = config
        self.loop = loop or EventLoop()
        self.rng = random.Random(f"sim/{config.seed}")
        self.net = Network(config.network, config.nodes, random.Random(f"net/{config.seed}"))
        self.fingerprint = Fingerprint(config.model, config.tokenizer, config.block_size)
        self.hash_seed = self.fingerprint.digest
        self.nodes = [SimNode(i) for i in range(config.nodes)]
        self.by_address = {n.address: n for n in self.nodes}
        self.by_id = {n.node_id: n for n in self.nodes}
        self.counters = Counters()
        self.on_complete: OnJourneyDone = lambda f: None
        self.active: dict[int, Journey] = {}
        self.record_peer_states = config.nodes <= 64
        self.holders: dict[int, int] = {}  # block hash -> up nodes whose engine caches it
        depth = config.router.placement_depth_blocks
        self.key_depth = 16 if depth is None else depth  # blocks: the prefix copies are of
        self.gateway = (
            None if config.gateway is None
            else make_gateway(config.nodes, config.gateway, config.block_size, config.seed)
        )
        self.compute = (
            None if config.shared_cores is None
            else SharedCompute(self.loop, config.shared_cores)
        )

    # ------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        spread = self.config.start_spread_s
        for node in self.nodes:
            self.loop.at(self.rng.random() * spread, self._boot, node)

    def schedule_faults(self, offset: float) -> None:
        """Crashes, restarts and partitions, with times counted from ``offset``."""
        self.net.time_offset = offset
        for f in self.config.network.faults:
            self.loop.at(offset + f.crash_s, self.crash, self.nodes[f.node])
            if f.restart_s is not None:
                self.loop.at(offset + f.restart_s, self._boot, self.nodes[f.node])

    def _seeds_for(self, idx: int) -> tuple[str, ...]:
        n, k = self.config.nodes, self.config.seeds
        if n <= k + 1:
            return tuple(m.address for m in self.nodes if m.idx != idx)
        picks = [(idx + 1 + j * max(1, n // k)) % n for j in range(k)]
        return tuple(self.nodes[p].address for p in dict.fromkeys(picks) if p != idx)

    def _boot(self, node: SimNode) -> None:
        if node.up:
            return
        cfg = self.config
        node.incarnation += 1
        node.up = True
        node.tick_at = INF
        node.version_times = []
        node.queued_blocks = QueuedBlocks(cfg.block_size)
        node.arrivals = ArrivalRate(RATE_WINDOW_S, RATE_MIN_SPAN)  # a fresh shadow's
        node.engine = SimEngine(
            cfg.cost_of(node.idx),
            cfg.cache_of(node.idx),
            cfg.block_size,
            self.hash_seed,
            cfg.service_noise,
            random.Random(f"engine/{cfg.seed}/{node.idx}/{node.incarnation}"),
        )
        rng = random.Random(f"node/{cfg.seed}/{node.idx}/{node.incarnation}")
        node.core = NodeCore(self._node_config(node), rng, self.loop.now)
        self.net.set_down(node.idx, False)
        self.feed(node, Tick())
        self._load_changed(node)

    def _node_config(self, node: SimNode) -> NodeConfig:
        cfg = self.config
        return NodeConfig(
            node_id=node.node_id,
            address=node.address,
            fingerprint=self.fingerprint,
            incarnation=node.incarnation,
            seeds=self._seeds_for(node.idx),
            router=cfg.router,
            gossip=cfg.gossip,
            pushback=cfg.pushback,
            priors=cfg.priors(),
            forward=cfg.forward,
            decision_log=1 if cfg.decisions else 0,  # read at once (``_record_estimate``)
        )

    def crash(self, node: SimNode) -> None:
        if not node.up:
            return
        node.up = False
        node.epoch += 1
        node.tick_at = INF
        self.net.set_down(node.idx, True)
        lost = list(node.works.values())
        if node.planned is not None and self.compute is not None:
            self.compute.cancel(node.compute_key)
        node.works = {}
        node.planned = None
        node.queued_tokens = [0, 0, 0]  # (and start() gives it new queued_blocks)
        if node.core is not None:
            self._holding(node.core.cached_hashes(), ())
        node.core = None
        node.engine = None
        for work in lost:
            self._work_lost(node, work)
        for flight in [f for f in self.active.values() if f.entry == node.idx]:
            self._fail_client(flight, "entry node crashed")

    # ------------------------------------------------------------------------- core glue
    def feed(self, node: SimNode, event: Event) -> list[Action]:
        core = node.core
        if core is None:
            return []
        actions = core.handle(event, self.loop.now)
        if actions:
            self._carry_out(node, actions)
        deadline = core.next_deadline()
        if deadline < node.tick_at:
            node.tick_at = deadline
            self.loop.at(deadline, self._tick, node, node.epoch, deadline)
        return actions

    def _tick(self, node: SimNode, epoch: int, deadline: float) -> None:
        if node.epoch != epoch or node.tick_at != deadline:
            return
        node.tick_at = INF
        self.feed(node, Tick())

    def _carry_out(self, node: SimNode, actions: Sequence[Action]) -> None:
        for action in actions:
            if isinstance(action, Send):
                self._send(node, action)
            elif isinstance(action, Forward):
                self._forward(self.active[action.rid], action)
            elif isinstance(action, ExecuteLocally):
                self._execute_locally(self.active[action.rid], action)
            elif isinstance(action, RejectRequest):  # full and no peer took it: a 429
                self._fail_client(self.active[action.rid], "rejected: overloaded")
            elif isinstance(action, PeerStateChanged):
                if self.record_peer_states:
                    self.counters.peer_states.append(
                        (self.loop.now, node.node_id, action.peer_id, action.old, action.new)
                    )
            elif isinstance(action, Log):
                logs = self.counters.logs
                logs[action.level] = logs.get(action.level, 0) + 1
            # AcceptForward / RefuseForward are read by _arrive_remote; no Abort: no client
            # of the simulator goes away

    def _send(self, node: SimNode, action: Send) -> None:
        dst = self.by_address.get(action.address)
        c = self.counters
        c.gossip_messages += 1
        c.gossip_bytes += len(action.payload)
        now = self.loop.now
        copies = () if dst is None else self.net.gossip_copies(node.idx, dst.idx, now)
        if not copies:
            c.gossip_lost += 1
        for delay in copies:
            self.loop.at(now + delay, self._deliver, dst, action, node.address)

    def _deliver(self, dst: SimNode, sent: Send, source: str) -> None:
        # In process, the decoded message travels with its bytes: the receiver skips decoding
        # (the bytes are still counted), and equal hashes are shared objects across nodes.
        if dst.up:
            self.feed(dst, MessageReceived(sent.payload, source, sent.message))

    def _load_changed(self, node: SimNode) -> None:
        assert node.engine is not None
        running = node.engine.sched.running
        prompt, output, uncached = node.queued_tokens
        event = LoadChanged(node.depth, running, node.engine.total_tokens,
                            self.config.cache_of(node.idx), prompt, output, uncached,
                            self._batch(node))
        self.feed(node, event)

    def _batch(self, node: SimNode) -> BatchState | None:
        """A profiled engine's batch as its node's shadow would report it (exact here: the
        node runs the engine), so the simulator routes as an emulated mesh does."""
        engine = node.engine
        assert engine is not None
        if not isinstance(engine.timer, Profile):
            return None
        planned, now = node.planned, self.loop.now
        rate = node.arrivals.at(now)
        if planned is None:
            return batch_state(engine.sched, engine.timer, None, 0.0, rate, engine.admission_s)
        # a run of decode steps: the step under way is its j-th, j - 1 of them done
        j = engine.steps_by(planned, now - node.planned_at)
        end = node.planned_at + j * planned.first_s + planned.delta_s * j * (j - 1) / 2
        return batch_state(engine.sched, engine.timer, planned.step, max(0.0, end - now), rate,
                           engine.admission_s, j - 1)

    # ------------------------------------------------------------------------- requests
    def submit(self, index: int, req: Request, tokens: list[int], entry: int) -> Journey:
        """A client sends ``req`` (already tokenized) to node ``entry`` now (or, with a
        gateway, to the gateway, which picks the node)."""
        hashes = tuple(block_hashes(tokens, self.config.block_size, self.hash_seed))
        if self.gateway is not None:
            return self._through_gateway(self.gateway, index, req, tokens, hashes, entry)
        flight = Journey(index, req, entry, tokens, hashes, self.loop.now)
        self._arrive(flight)
        return flight

    def _arrive(self, flight: Journey) -> None:
        """The request reaches its entry node (from the client, or from the gateway)."""
        node = self.nodes[flight.entry]
        if not node.up or node.core is None or node.engine is None:
            self._fail_client(flight, "entry node down")
            return
        self.active[flight.index] = flight
        local = _cached_prefix(node, flight)
        n, max_tokens = len(flight.tokens), flight.req.max_tokens
        self.feed(node, RequestArrived(flight.index, flight.hashes, n, local, max_tokens))

    def _through_gateway(
        self, gateway: CacheAwareGateway, index: int, req: Request, tokens: list[int],
        hashes: tuple[int, ...], client: int,
    ) -> Journey:  # fmt: skip
        """The gateway picks a node; the request crosses one link to it (a mesh forward's
        one-way delay and half its hop overhead), and its answer crosses back (``_answer``).
        Across regions the gateway stands in the first region (node 0's, as the bench places
        it) and the client, in its entry node's region, crosses to it and back too."""
        now = self.loop.now
        chosen = gateway.choose(tokens, [n.up for n in self.nodes], now)
        if chosen is None:  # (nothing counted by the gateway)
            flight = Journey(index, req, 0, tokens, hashes, now)
            self._fail_client(flight, "no worker up")
            return flight
        flight = Journey(index, req, chosen, tokens, hashes, now, via_gateway=True)
        if self.config.network.regions:
            flight.client_leg_s = self.net.delay(client, 0)
        hop = (flight.client_leg_s + self.net.delay(self._gateway_at(chosen), chosen)
               + self.config.cost.forward_overhead_s / 2)  # fmt: skip
        self.loop.at(now + hop, self._arrive, flight)
        return flight

    def _gateway_at(self, node: int) -> int:
        """The node whose region the gateway stands in, seen from ``node``: the first region
        across regions, else ``node``'s own link (a flat network: one hop as any)."""
        return 0 if self.config.network.regions else node

    def _execute_locally(self, flight: Journey, action: ExecuteLocally) -> None:
        flight.attempt += 1
        flight.route = action.route
        flight.expected_cached, flight.placement = action.expected_cached, action.placement
        flight.predicted_ttft_s = action.predicted_ttft_s
        self._record_estimate(flight, flight.entry)
        if action.resume_after == 0:
            self._count_copy(flight, self.nodes[flight.entry])
        self._enqueue(self.nodes[flight.entry], Work(flight, flight.attempt, self.loop.now))

    def _record_estimate(self, flight: Journey, target: int) -> None:
        """Error and age of the estimate the entry node used for ``target``, against the
        truth the simulator can see (the target's engine and summary versions)."""
        node = self.nodes[target]
        engine = node.engine
        truth = 0 if engine is None else _cached_prefix(node, flight)
        flight.estimate_error = flight.expected_cached - truth
        core = self.nodes[flight.entry].core
        if self.config.decisions and core is not None:
            seen = core.decisions.considered(flight.index, node.node_id)
            flight.considered = None if seen is None else seen.to_json()
        if target == flight.entry:
            flight.view_age_s = 0.0
            return
        held = estimate_version(self.nodes[flight.entry].core, node.node_id) or 0
        times = node.version_times
        flight.view_age_s = self.loop.now - times[held] if held < len(times) else 0.0

    def _forward(self, flight: Journey, action: Forward) -> None:
        target = self.by_address[action.address]
        now = self.loop.now
        flight.attempt += 1
        flight.route, flight.expected_cached = action.route, action.expected_cached
        flight.placement, flight.predicted_ttft_s = action.placement, action.predicted_ttft_s
        flight.target, flight.beat_s, flight.sent_at = target.idx, action.beat_s, now
        self.counters.forwards += 1
        self._record_estimate(flight, target.idx)
        src, attempt = flight.entry, flight.attempt
        if self.net.partitioned(src, target.idx, now):
            timeout = self.config.forward.connect_timeout_s
            self._fail_after(timeout, flight, target, "connect timeout")
            return
        out = self.net.delay(src, target.idx)
        if not target.up:
            back = self.net.delay(target.idx, src)
            self._fail_after(out + back, flight, target, "connection refused")
            return
        hop = self.config.cost.forward_overhead_s / 2
        self.loop.at(now + out + hop, self._arrive_remote, target, target.epoch, flight, attempt)

    def _arrive_remote(self, target: SimNode, epoch: int, flight: Journey, attempt: int) -> None:
        if not flight.current(attempt):
            return  # the entry already gave up on this try
        back = self.net.delay(target.idx, flight.entry)
        if not target.up or target.epoch != epoch:
            self._fail_after(back, flight, target, "connection reset")
            return
        assert target.engine is not None
        cached = _cached_prefix(target, flight)  # (the runtime's count: differential test)
        ask = ForwardArrived(flight.index, len(flight.tokens), cached, flight.req.max_tokens,
                             flight.beat_s)
        [answer] = self.feed(target, ask)
        if isinstance(answer, RefuseForward):  # the first (and only) event back
            self.loop.at(self.loop.now + back, self._refused, flight, attempt, target, answer)
            return
        assert isinstance(answer, AcceptForward)
        self._count_copy(flight, target)
        self.loop.at(self.loop.now + back, self._accepted, flight, attempt, target, cached)
        self._enqueue(target, Work(flight, attempt, self.loop.now))

    def _accepted(self, flight: Journey, attempt: int, target: SimNode, cached: int) -> None:
        if flight.current(attempt):
            event = ForwardAccepted(flight.index, target.node_id, cached)
            self.feed(self.nodes[flight.entry], event)

    def _refused(
        self, flight: Journey, attempt: int, target: SimNode, answer: RefuseForward
    ) -> None:
        if flight.current(attempt):
            self.counters.forward_refusals += 1
            flight.forward_refusals += 1
            wire = busy_reply(target.node_id, answer.retry_after_s, answer.queue_s)
            event = ForwardRefused(flight.index, target.node_id, wire.retry_after_s, wire.queue_s)
            self.feed(self.nodes[flight.entry], event)

    def _holding(self, removed: Sequence[int] | frozenset[int], added: Sequence[int]) -> None:
        holders = self.holders
        for h in removed:
            left = holders.get(h, 0) - 1
            if left > 0:
                holders[h] = left
            else:
                holders.pop(h, None)
        for h in added:
            holders[h] = holders.get(h, 0) + 1

    def _count_copy(self, flight: Journey, node: SimNode) -> None:
        """A request is placed on ``node``: count a cold copy of its prefix if another node's
        engine holds that prefix now (the truth, not any node's view)."""
        if not flight.hashes or node.engine is None:
            return
        depth = min(len(flight.hashes), self.key_depth)
        key = flight.hashes[depth - 1]
        here = node.engine.match(flight.tokens) >= depth * self.config.block_size
        if here or self.holders.get(key, 0) == 0:
            return
        entry = self.nodes[flight.entry].core
        tag = None if entry is None else entry.placement_of(flight.index)
        if tag in DELIBERATE:
            self.counters.deliberate_replicas += 1
            flight.deliberate_replicas += 1
        else:
            self.counters.second_cold_copies += 1
            flight.second_cold_copies += 1

    def _fail_after(self, delay: float, flight: Journey, target: SimNode, reason: str) -> None:
        self.loop.at(self.loop.now + delay, self._failed, flight, flight.attempt, target, reason)

    def _failed(self, flight: Journey, attempt: int, target: SimNode, reason: str) -> None:
        if flight.current(attempt):
            self.counters.forward_failures += 1
            flight.forward_failures += 1
            event = ForwardFailed(flight.index, target.node_id, reason)
            self.feed(self.nodes[flight.entry], event)

    def _work_lost(self, node: SimNode, work: Work) -> None:
        flight = work.flight
        if flight.entry == node.idx:
            return  # the client's connection died with the entry node (handled by crash)
        back = self.net.delay(node.idx, flight.entry)
        self.loop.at(
            self.loop.now + back, self._failed, flight, work.attempt, node, "connection reset"
        )

    # ------------------------------------------------------------------------- execution
    def _enqueue(self, node: SimNode, work: Work) -> None:
        engine = node.engine
        assert engine is not None
        flight, now = work.flight, self.loop.now
        work.uncached = node.queued_blocks.uncached(
            flight.hashes, len(flight.tokens), _engine_prefix(engine, flight.tokens))
        seq = node.next_seq
        node.next_seq += 1
        if engine.admission_s > 0:  # it joins the scheduler that much later (sim/engine.py)
            node.works[seq] = work
            node.arrivals.add(now)
            self._count_queued(node, work, 1)
            self._load_changed(node)
            self.loop.at(now + engine.admission_s, self._admit, node, node.epoch, seq, work)
            return
        self._admit(node, node.epoch, seq, work)

    def _admit(self, node: SimNode, epoch: int, seq: int, work: Work) -> None:
        """``work`` joins the engine's scheduler: on arrival, or ``admission_s`` later (then it
        already counts in the node's queue, as a runtime counts what it sent its engine)."""
        engine = node.engine
        if node.epoch != epoch or engine is None:
            return  # the node crashed meanwhile (the work was reported lost)
        flight, now, held = work.flight, self.loop.now, seq in node.works
        try:
            engine.add(seq, flight.tokens, _generated(flight), now, work.t_enqueued)
        except ValueError:  # prompt + max_tokens never fit the engine's KV pool
            if held:
                del node.works[seq]
                self._count_queued(node, work, -1)
            self._too_long(node, work)
            if held:
                self._load_changed(node)
            return
        if not held:
            node.works[seq] = work
            node.arrivals.add(now)
            self._count_queued(node, work, 1)
        if node.planned is None:
            self._run_next(node)
        elif node.planned.step is None and self.compute is None:
            self._cut_run(node)
        self._load_changed(node)

    def _too_long(self, node: SimNode, work: Work) -> None:
        reason = "prompt + max_tokens exceed the engine's KV pool"
        if work.flight.entry == node.idx:
            self.feed(node, RequestDone(work.flight.index, error=reason))
            self._fail_client(work.flight, reason)
        else:
            self._work_lost(node, work)

    def _count_queued(self, node: SimNode, work: Work, sign: int) -> None:
        """``work`` joined (``sign`` 1) or left (-1) ``node``'s queue: its blocks and tokens,
        for the node's load report and its summary (``QueueChanged``)."""
        hashes = work.flight.hashes
        (node.queued_blocks.add if sign > 0 else node.queued_blocks.remove)(hashes)
        q = node.queued_tokens
        q[0] += sign * len(work.flight.tokens)
        q[1] += sign * work.flight.req.max_tokens
        q[2] += sign * work.uncached
        self.feed(node, QueueChanged(hashes, sign > 0))

    def _run_next(self, node: SimNode) -> None:
        """Plan the engine's next step (or decode run) and time it; idle if nothing to do."""
        engine = node.engine
        assert engine is not None
        planned = engine.plan(self.loop.now, coalesce=self.compute is None)
        node.planned = planned
        if planned is None:
            return
        self._prefill_cached(node, planned)  # vLLM's rule: cached when scheduled
        node.planned_at = self.loop.now
        node.planned_version += 1
        epoch, version = node.epoch, node.planned_version
        if self.compute is None:
            self.loop.at(self.loop.now + planned.duration_s, self._stepped, node, epoch, version)
            return
        node.compute_key = self.compute.start(
            planned.duration_s, lambda _elapsed: self._stepped(node, epoch, version))

    def _cut_run(self, node: SimNode) -> None:
        """A request arrived during a decode run: end the run with the step now running, so
        the engine can admit it at the next step boundary."""
        planned = node.planned
        assert planned is not None and node.engine is not None
        k = node.engine.steps_by(planned, self.loop.now - node.planned_at)
        if k >= planned.k:
            return
        node.planned = cut = node.engine.cut(planned, k)
        node.planned_version += 1
        end = node.planned_at + cut.duration_s
        self.loop.at(end, self._stepped, node, node.epoch, node.planned_version)

    def _stepped(self, node: SimNode, epoch: int, version: int) -> None:
        if node.epoch != epoch or node.engine is None or node.planned_version != version:
            return
        planned = node.planned
        assert planned is not None
        for finished, run in node.engine.apply(planned, self.loop.now):
            self._finish(node, node.works.pop(finished.seq), run)
        self._prefill_cached(node, planned)  # the radix rule: cached when computed
        self._run_next(node)
        self._load_changed(node)

    def _finish(self, node: SimNode, work: Work, run: SimRun) -> None:
        flight = work.flight
        node.served += 1
        self._report_served(node, flight, run)  # its cache change before it leaves the queue
        self._count_queued(node, work, -1)  # (as in the runtime): no flicker in the summary
        if flight.current(work.attempt):  # else the entry timed out on this try: work wasted
            self._answer(node, work, run, run.queue_s)

    def _report_served(self, node: SimNode, flight: Journey, run: SimRun) -> None:
        self.feed(
            node,
            RequestServed(
                len(flight.tokens),
                run.cached_tokens,
                run.prefill_s,
                run.decode_tokens,
                run.decode_s,
                run.service_s,
            ),
        )
        self._cache_changed(node)

    def _prefill_cached(self, node: SimNode, planned: Planned) -> None:
        """A profiled engine's step with prefill chunks, planned or done, may have cached
        prompt blocks (``SchedulerConfig.cache_rule``): its node learns them now, as a node
        learns an emulated or vLLM engine's from the KV events of that step."""
        step = planned.step
        if step is not None and step.prefills and node.engine is not None \
                and isinstance(node.engine.timer, Profile):
            self._cache_changed(node)

    def _cache_changed(self, node: SimNode) -> None:
        """The engine's cache changes since the last call go to the node (``CacheChanged``):
        at each request served, and at each step with prefill chunks on a profile
        (``_prefill_cached``; not at decode-only steps: a block a decode fills is of no use
        to another request before its own ends, and a run of decode steps, one event, then
        reports what single steps do). Drained only as
        requests ended, a profiled node's new blocks reached its peers a whole request later
        than an emulated engine's KV events (4 emulated RAG nodes, ``sim --validate``: the
        replay computed 14-23 % more uncached warm-up tokens than the real run)."""
        added, removed = node.engine.drain_delta() if node.engine else ([], [])
        self._holding(removed, added)
        if added or removed:
            self.feed(node, CacheChanged(tuple(added), tuple(removed)))
            version = summary_version(node.core)
            while len(node.version_times) < version:
                node.version_times.append(self.loop.now)

    def _answer(self, node: SimNode, work: Work, run: SimRun, queue_s: float) -> None:
        flight, now = work.flight, self.loop.now
        if node.idx == flight.entry:
            self._served(flight, node, run, queue_s)
            self.feed(node, RequestDone(flight.index))
            if not flight.via_gateway:
                self._complete(flight)
                return
            back = (flight.client_leg_s + self.net.delay(node.idx, self._gateway_at(node.idx))
                    + self.config.cost.forward_overhead_s / 2)  # fmt: skip
            self.loop.at(now + back, self._back_through_gateway, flight)
            return
        if self.net.partitioned(node.idx, flight.entry, now):  # heartbeats stopped: timeout
            self._fail_after(self.config.forward.silence_timeout_s, flight, node, "timeout")
            return
        back = self.net.delay(node.idx, flight.entry) + self.config.cost.forward_overhead_s / 2
        self.loop.at(now + back, self._response, flight, work.attempt, node, run, queue_s)

    def _served(self, flight: Journey, node: SimNode, run: SimRun, queue_s: float) -> None:
        flight.served_by = node.idx
        flight.cached = run.cached_tokens
        flight.queue_s = queue_s
        flight.service_s = run.service_s
        flight.decode_s = run.decode_s
        flight.decode_tokens = run.decode_tokens

    def _response(
        self, flight: Journey, attempt: int, node: SimNode, run: SimRun, queue_s: float
    ) -> None:
        if not flight.current(attempt):
            return
        self._served(flight, node, run, queue_s)
        since = self.loop.now - flight.sent_at  # its first token: decode_s before the end
        self.feed(
            self.nodes[flight.entry],
            RequestDone(flight.index, forward_overhead_s=since - queue_s - run.service_s,
                        forward_queue_s=queue_s, forward_ttft_s=since - run.decode_s),
        )
        self._complete(flight)

    def _back_through_gateway(self, flight: Journey) -> None:
        if flight.t_done < 0 and flight.error is None:
            self._complete(flight)

    def _complete(self, flight: Journey) -> None:
        flight.t_done = self.loop.now
        self.active.pop(flight.index, None)
        if flight.via_gateway and self.gateway is not None:
            self.gateway.finished(flight.entry)
        self.on_complete(flight)

    def _fail_client(self, flight: Journey, reason: str) -> None:
        if flight.t_done >= 0:
            return
        flight.error = reason
        self._complete(flight)


def summary_version(core: NodeCore | None) -> int:
    """The node's own summary version (0 for a node that is down)."""
    return 0 if core is None else core.summary_version


def estimate_version(core: NodeCore | None, peer_id: str) -> int | None:
    """Which version of ``peer_id``'s summary ``core`` holds (None: nothing)."""
    return None if core is None else core.view_version(peer_id)


def routable_count(core: NodeCore | None) -> int:
    """Peers ``core`` would route to now (alive, with a load report)."""
    return 0 if core is None else core.routable_count()


def _generated(flight: Journey) -> list[int]:
    """Stand-in output ids (the simulator does not sample): deterministic per request."""
    n = flight.req.max_tokens
    base = zlib.crc32(flight.req.id.encode("utf-8")) & 0x7F
    return [32 + (base + i) % 95 for i in range(n)]


def _cached_prefix(node: SimNode, flight: Journey) -> int:
    """Tokens of the request ``node`` will have cached when it runs it."""
    assert node.engine is not None
    tokens = flight.tokens
    return node.queued_blocks.cached_when_run(flight.hashes, len(tokens), node.engine.match(tokens))


def _engine_prefix(engine: SimEngine, tokens: list[int]) -> int:
    """Tokens of ``tokens`` the engine would reuse (at least the last one is computed)."""
    return min(engine.match(tokens), max(len(tokens) - 1, 0))
