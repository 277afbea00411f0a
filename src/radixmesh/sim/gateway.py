"""Centralized gateways for the simulator: sglang-router 0.3.2's and SMG 1.13's ``cache_aware``.

Theory of operation
-------------------
The real-cluster benchmark compares the mesh with two centralized gateways (sglang-router
0.3.2 and SMG 1.13, ``--policy cache_aware``) in front of nodes that do not route. Those are
Rust processes and cannot run on a virtual clock, so the simulator carries a model of the
policy, to compare the mesh with a central router deterministically and at any size
(``radixmesh sim --policy cache_aware``). The algorithm, as sglang-router's source has it
and SMG's documents it for its approximate trees (read Dec 2026):

* **Load** is the number of requests the gateway has sent to a worker and not yet seen
  answered (it counts them itself; it does not ask the worker).
* The system is **imbalanced** when ``max - min > balance_abs`` *and*
  ``max > balance_rel × min`` over the workers' loads; then the request goes to the least
  loaded worker, whatever its cache.
* Otherwise, **cache affinity**: the gateway keeps one approximate prefix tree per worker of
  every prompt it sent there (inserted when it routes, before the worker has computed
  anything; never told of the worker's evictions). The worker with the longest match gets the
  request if the match covers more than ``cache_threshold`` of the prompt, else the worker
  whose tree is smallest ("the most cache capacity left").
* Either way the prompt is inserted into the chosen worker's tree.

Differences from the real gateways, on purpose or by necessity:

* The trees hold token ids (the simulator has no text); the HTTP gateways match characters.
  The match fraction is compared with the threshold all the same.
* Ties (equal match, equal load, equal tree size) go to the lower-numbered worker; the
  gateways' trees pick the first tenant they find. A longest-match tie goes to the less
  loaded worker first (SMG's event-driven mode does that; the approximate tree does not say).
* Eviction: the gateways trim each worker's tree to ``max_tree_size`` every 60 s, least
  recently used first; here a tree is trimmed to ``max_tree_tokens`` at insertion. At the
  default (2^24 tokens) no simulated run reaches it, as no benchmark run reaches theirs.
* The gateway itself is free and infinitely fast: no request waits for it, however many
  workers there are. Its hop to a worker and back costs what a mesh forward's does (see
  ``sim/shell.py``); in the real benchmark that hop crosses the same emulated link.
* It only picks workers that are up (the gateways health-check theirs) and does not retry a
  request whose worker fails.
* A run's records name the chosen worker as the request's entry node (route ``local``: the
  worker serves what it is given); the bench's records of a gateway run say ``router``.
* :class:`CacheAwareGateway` is sglang-router's policy, not SMG 1.13's, which keeps the
  name and the knobs and changed the choice (:class:`SmgGateway`, policy ``smg``).

SMG 1.13 (``policies/cache_aware.rs`` of the SMG sources nearest the 1.13.0 wheel, whose own
help text and metric labels they match; read Dec 2026):

* **Spill gate**, per candidate: a worker is skipped when its in-flight count exceeds both
  ``balance_rel`` × the fleet's mean and the mean plus a margin: ``balance_abs`` capped at
  "the in-flight count's natural swing at the pool's current mean (two standard deviations,
  never under four)" (the 1.13 wheel's help; the sources read have the uncapped 64), read
  here as two standard deviations of the workers' counts, at least 4: at 64 H100s on RAG
  this reading gives the real SMG's figures (TTFT 39.4 against 37.8-43.0 ms, 91.0 against
  89.2-90.1 % cached); a Poisson count's 2 √mean spills far more (72.2 ms, 85.5 %). On agentic at 16
  H100s it is the other way round: a hot tool prompt's holder never exceeds the mean by 2σ
  of counts it skews itself (146.8 ms against the real 40.3), 2 √mean gives 42.5. The
  formula the wheel compiles is not in the sources read. No fleet-wide imbalance switch.
* **Expected wait**, what picks the worker: the running and waiting requests its last
  ``/metrics`` poll read (every ``poll_s``, 10 s) plus 1,024 tokens credited per request
  dispatched since, over 2,000 tokens/s (vLLM reports no throughput); the lowest wins, ties
  drawn uniformly. Here the poll reads the gateway's in-flight counts (what the worker holds
  but for requests on the wire).
* **Hit** (match > ``cache_threshold``): the deepest match's holders, at most 8 (here drawn
  at random when more hold it; SMG takes them in its map's order), less the
  gated; the lowest expected wait among them; all gated: the lowest among the ungated
  workers, which then hold the prefix too (a replica). **Miss**: the lowest expected wait of
  all workers, not the smallest tree.
* Not modelled: the overload veto (waiting ≥ 8 or KV use ≥ 0.8 at the last poll), the
  tree's 2^26-character budget, and KV events (SMG's gRPC mode; the bench runs HTTP).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from random import Random

from radixmesh.core.radix import RadixTree

CACHE_AWARE = "cache_aware"  # the simulator's policy name for a gateway in front of `none` nodes
SMG = "smg"  # SMG 1.13's cache_aware (spill gate, expected wait): :class:`SmgGateway`
GATEWAY_KINDS = (CACHE_AWARE, SMG)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """The ``cache_aware`` knobs, at sglang-router 0.3.2's and SMG 1.13's defaults."""

    cache_threshold: float = 0.3  # a match must cover more than this share of the prompt
    balance_abs: int = 64  # imbalanced when max - min load exceeds this ...
    balance_rel: float = 1.5  # ... and max exceeds this × min
    max_tree_tokens: int = 2**24  # per worker tree, trimmed least recently used first
    kind: str = CACHE_AWARE  # which gateway's choice: sglang-router's or SMG 1.13's (``smg``)
    poll_s: float = 10.0  # smg: its load monitor's interval (``--load-monitor-interval``)

    def __post_init__(self) -> None:
        if self.kind not in GATEWAY_KINDS:
            raise ValueError(f"gateway kind must be one of {GATEWAY_KINDS}")
        if not 0.0 <= self.cache_threshold <= 1.0 or not self.poll_s > 0:
            raise ValueError("cache_threshold must be in [0, 1] and poll_s > 0")
        if self.balance_abs < 0 or self.balance_rel < 1.0 or self.max_tree_tokens < 1:
            raise ValueError("balance_abs >= 0, balance_rel >= 1 and max_tree_tokens >= 1")


class CacheAwareGateway:
    """The gateway's state (a tree and a load count per worker) and its choice."""

    def __init__(self, workers: int, config: GatewayConfig, block_size: int = 16) -> None:
        if workers < 1:
            raise ValueError("a gateway needs at least one worker")
        self.config = config
        self.trees: list[RadixTree[None]] = [RadixTree(block_size, 0) for _ in range(workers)]
        self.load = [0] * workers
        self.balanced_choices = 0  # choices made by cache affinity (or the smallest tree)
        self.imbalanced_choices = 0  # choices made by load alone

    def choose(self, tokens: Sequence[int], up: Sequence[bool], now: float) -> int | None:
        """The worker for a prompt of ``tokens`` among those ``up`` (None: none is), counted
        in its load and its tree from now on."""
        alive = [w for w, ok in enumerate(up) if ok]
        if not alive:
            return None
        worker = self._pick(tokens, alive)
        self._insert(worker, tokens, now)
        self.load[worker] += 1
        return worker

    def finished(self, worker: int) -> None:
        """The gateway saw ``worker``'s answer (or its failure) go back to the client."""
        self.load[worker] = max(0, self.load[worker] - 1)

    def _pick(self, tokens: Sequence[int], alive: list[int]) -> int:
        cfg, load = self.config, self.load
        low = min(load[w] for w in alive)
        high = max(load[w] for w in alive)
        if high - low > cfg.balance_abs and high > cfg.balance_rel * low:
            self.imbalanced_choices += 1
            return min(alive, key=lambda w: (load[w], w))
        self.balanced_choices += 1
        matched = {w: self.trees[w].match(tokens) for w in alive}
        best = min(alive, key=lambda w: (-matched[w], load[w], w))
        if tokens and matched[best] / len(tokens) > cfg.cache_threshold:
            return best
        return min(alive, key=lambda w: (self.trees[w].total_tokens, w))

    def _insert(self, worker: int, tokens: Sequence[int], now: float) -> None:
        tree = self.trees[worker]
        tree.insert(tokens, now)
        tree.drain_delta()  # (the tree journals block hashes for gossip; nobody reads them)
        excess = tree.total_tokens - self.config.max_tree_tokens
        if excess > 0:
            tree.evict(excess)
            tree.drain_delta()


SMG_SPILL_FLOOR = 4  # the spill margin is never under this (unless balance_abs is)
SMG_MATCHED_CAP = 8  # holders of the deepest match considered (``MATCHED_TENANTS_CAP``)


class SmgGateway(CacheAwareGateway):
    """SMG 1.13's choice (module docstring): the spill gate, then the lowest expected wait."""

    def __init__(self, workers: int, config: GatewayConfig, block_size: int = 16,
                 seed: int = 0) -> None:
        super().__init__(workers, config, block_size)
        self.polled = [0] * workers  # in flight at the last poll
        self.since_poll = [0] * workers  # dispatched since it
        self.next_poll = 0.0
        self._rng = Random(seed)

    def choose(self, tokens: Sequence[int], up: Sequence[bool], now: float) -> int | None:
        if now >= self.next_poll:
            self.polled, self.since_poll = list(self.load), [0] * len(self.load)
            self.next_poll = now + self.config.poll_s
        worker = super().choose(tokens, up, now)
        if worker is not None:
            self.since_poll[worker] += 1
        return worker

    def _pick(self, tokens: Sequence[int], alive: list[int]) -> int:
        line = self._gate_line(alive)
        ungated = [w for w in alive if self.load[w] <= line]
        matched = {w: self.trees[w].match(tokens) for w in alive}
        deepest = max(matched.values())
        if tokens and deepest / len(tokens) > self.config.cache_threshold:
            self.balanced_choices += 1
            holders = [w for w in alive if matched[w] == deepest]
            if len(holders) > SMG_MATCHED_CAP:
                holders = self._rng.sample(holders, SMG_MATCHED_CAP)
            open_holders = [w for w in holders if w in ungated]
            if open_holders:
                return self._least_wait(open_holders)
            self.imbalanced_choices += 1  # every holder gated: spill
        return self._least_wait(ungated or alive)

    def _gate_line(self, alive: list[int]) -> float:
        """The in-flight count over which a worker is gated: more than ``balance_rel`` × the
        mean and more than the mean plus the margin."""
        loads = [self.load[w] for w in alive]
        mean = statistics.fmean(loads)
        margin = min(self.config.balance_abs,
                     max(SMG_SPILL_FLOOR, 2.0 * statistics.pstdev(loads)))  # fmt: skip
        return max(mean * self.config.balance_rel, mean + margin)

    def _least_wait(self, workers: list[int]) -> int:
        """The lowest expected wait (the polled requests plus those dispatched since, each
        1,024 tokens at 2,000 tokens/s: proportional to their count), ties drawn uniformly."""
        waits = {w: self.polled[w] + self.since_poll[w] for w in workers}
        low = min(waits.values())
        return self._rng.choice([w for w in workers if waits[w] == low])


def make_gateway(workers: int, config: GatewayConfig, block_size: int = 16,
                 seed: int = 0) -> CacheAwareGateway:
    """The gateway ``config.kind`` names."""
    if config.kind == SMG:
        return SmgGateway(workers, config, block_size, seed)
    return CacheAwareGateway(workers, config, block_size)
