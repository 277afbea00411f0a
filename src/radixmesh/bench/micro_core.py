"""Core micro-benchmarks: block hashing, radix tree match/insert, and the routing decision.

Note for ``NodeCore.route`` (what this benchmark proves fast enough, per request):

1. ``view.match_top(hashes, k=ROUTE_TOP_K, rng, skip=unavailable)`` — the k deepest-matching
   available peers, O(blocks + k + skipped), never O(peers). ``skip`` is any
   ``Container[str]``: a small object whose ``__contains__(peer)`` says "not routable now"
   (suspect, pushed back, no load report) is evaluated lazily, only for peers examined.
2. ``NodeInfo`` for those k peers, for self (``local_cached_tokens``) and for the
   least-loaded available peer (cold requests may go there when self is busy) — keep that
   peer up to date when load reports arrive (gossip), not by scanning all peers per request.
3. ``Router.rank`` over those <= k + 2 nodes.

Never build a NodeInfo per peer per request: at 1,024 peers that alone costs > 1 ms, and
``PeerView.match`` (the full per-peer dict) costs O(matched peers) (~150 µs when ~900 peers
share a popular prefix).

Workload: MMLU-shaped prompts with a byte-level tokenizer (~3,000 tokens; the shared
few-shot prefix is ~85% of a prompt): 57 subject prefixes of 2,540 tokens with Zipf-like
popularity, per-question suffixes of ~460 tokens. Each peer caches 8 subject prefixes and
8 question suffixes per prefix (~3,600 block hashes; ``--quick``: 1 suffix), so popular
prefixes are on hundreds of peers at 1,024 peers.
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from radixmesh.core.blocks import Fingerprint, block_hashes, extend_hashes
from radixmesh.core.estimators import ComputeModel, CostPriors
from radixmesh.core.peerview import PeerView
from radixmesh.core.radix import RadixTree
from radixmesh.core.router import NodeInfo, Policy, RouteInput, Router, RouterConfig
from radixmesh.results.run_summary import percentile

BLOCK = 16
PROMPT_TOKENS = 3_000
PREFIX_TOKENS = 2_540
SUBJECTS = 57
PREFIXES_PER_PEER = 8
SUFFIXES_PER_PREFIX = 8
ROUTE_TOP_K = 8
PEER_COUNTS = (4, 64, 1024)


def _time_us(fn: Callable[[], object], iterations: int) -> list[float]:
    """Per-call thread CPU time in µs: on a shared box, preemption by other processes is not
    the code's cost (wall-clock figures are reported beside, see ``run``)."""
    out: list[float] = []
    clock = time.thread_time_ns
    for _ in range(iterations):
        t0 = clock()
        fn()
        out.append((clock() - t0) / 1e3)
    return out


def _wall_us(fn: Callable[[], object], iterations: int) -> list[float]:
    out: list[float] = []
    clock = time.perf_counter_ns
    for _ in range(iterations):
        t0 = clock()
        fn()
        out.append((clock() - t0) / 1e3)
    return out


class Workload:
    """Synthetic MMLU-shaped token prompts (deterministic for a seed)."""

    def __init__(self, rng: random.Random, seed: int) -> None:
        self.rng = rng
        self.seed = seed
        self.prefixes = [self._tokens(PREFIX_TOKENS) for _ in range(SUBJECTS)]
        self.prefix_hashes = [block_hashes(p, BLOCK, seed) for p in self.prefixes]
        self.weights = [1.0 / (i + 1) for i in range(SUBJECTS)]

    def _tokens(self, n: int) -> list[int]:
        return list(self.rng.randbytes(n))

    def subject(self) -> int:
        return self.rng.choices(range(SUBJECTS), self.weights)[0]

    def prompt(self, subject: int) -> list[int]:
        return self.prefixes[subject] + self._tokens(PROMPT_TOKENS - PREFIX_TOKENS)

    def peer_hashes(self, suffixes: int) -> list[int]:
        out: list[int] = []
        for s in self.rng.choices(range(SUBJECTS), self.weights, k=PREFIXES_PER_PEER):
            out.extend(self.prefix_hashes[s])
            known = self.prefix_hashes[s]
            for _ in range(suffixes):
                chain = extend_hashes(known, self.prompt(s), BLOCK, self.seed)
                out.extend(chain[len(known) :])
        return out


@dataclass(frozen=True, slots=True)
class RouteFigures:
    cpu_us: list[float]  # thread CPU time per decision
    wall_us: list[float]  # wall-clock time per decision (includes preemption on a busy box)
    matched_peers: float  # mean number of peers with a match > 0 (what match_top avoids)


def _route_bench(work: Workload, peers: int, iterations: int, suffixes: int) -> RouteFigures:
    view = PeerView()
    for p in range(peers):
        view.replace(f"n{p}", work.peer_hashes(suffixes))
    speed = ComputeModel(CostPriors()).report()
    rng = random.Random(7)
    loads = {f"n{p}": rng.randrange(4) for p in range(peers)}
    rtts = {f"n{p}": 0.001 + rng.random() * 0.002 for p in range(peers)}
    unavailable = {f"n{p}" for p in range(0, peers, 16)}  # some suspect / pushed back
    idle = next(p for p in loads if p not in unavailable)  # kept up to date by membership
    router = Router(RouterConfig(policy=Policy.COST))
    requests = [block_hashes(work.prompt(work.subject()), BLOCK, work.seed) for _ in range(64)]
    req = RouteInput(prompt_tokens=PROMPT_TOKENS, max_tokens=1)
    cursor = itertools.cycle(requests)

    def route() -> object:
        hashes = next(cursor)
        top = view.match_top(hashes, ROUTE_TOP_K, rng, unavailable)
        nodes = [NodeInfo("self", True, 0, 0.0, 2, speed)]
        nodes.extend(
            NodeInfo(p, False, depth * BLOCK, rtts[p], loads[p], speed) for p, depth in top
        )
        if all(p != idle for p, _ in top):
            nodes.append(NodeInfo(idle, False, 0, rtts[idle], loads[idle], speed))
        return router.rank(req, nodes, rng)

    for _ in range(min(50, iterations)):
        route()
    matched = statistics.mean(len(view.match(h)) for h in requests)
    return RouteFigures(_time_us(route, iterations), _wall_us(route, iterations), matched)


def _radix_bench(work: Workload, iterations: int) -> tuple[list[float], list[float]]:
    """A node's tree holding 8 subject prefixes x 32 questions (~110k tokens)."""
    tree: RadixTree[None] = RadixTree(BLOCK, work.seed)
    subjects = list(range(PREFIXES_PER_PEER))
    now = 0.0
    for s in subjects:
        for _ in range(32):
            now += 1.0
            tree.insert(work.prompt(s), now)
    prompts = [work.prompt(work.rng.choice(subjects)) for _ in range(iterations)]
    hashes = [block_hashes(p, BLOCK, work.seed) for p in prompts]
    cursor = itertools.cycle(prompts)
    matches = _time_us(lambda: tree.match(next(cursor)), iterations)
    pending = iter(zip(prompts, hashes, itertools.count(now + 1.0), strict=False))

    def insert() -> None:
        prompt, hs, t = next(pending)
        tree.insert(prompt, t, hashes=hs)  # a new question under a cached subject prefix

    return matches, _time_us(insert, iterations)


def _pct(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (results.run_summary.percentile, nearest rank) in µs, to 0.01."""
    value = percentile(samples, q)
    if value is None:
        raise ValueError("no samples")
    return round(value, 2)


def run(quick: bool) -> dict[str, object]:
    iterations = 300 if quick else 3_000
    suffixes = 1 if quick else SUFFIXES_PER_PREFIX  # --quick: smaller views, faster set-up
    seed = Fingerprint("bench", "bytes", BLOCK).digest
    work = Workload(random.Random(0), seed)
    prompt = work.prompt(0)
    hashing = _time_us(lambda: block_hashes(prompt, BLOCK, seed), iterations)
    matches, inserts = _radix_bench(work, iterations)
    figures = {str(peers): _route_bench(work, peers, iterations, suffixes) for peers in PEER_COUNTS}
    return {
        "timer": "thread CPU time; *_wall_* keys are wall-clock",
        "hash_p50_us": _pct(hashing, 50),
        "hash_prompt_tokens": len(prompt),
        "radix_match_p50_us": _pct(matches, 50),
        "radix_insert_p50_us": _pct(inserts, 50),
        "route_p50_us": {k: _pct(f.cpu_us, 50) for k, f in figures.items()},
        "route_p99_us": {k: _pct(f.cpu_us, 99) for k, f in figures.items()},
        "route_wall_p50_us": {k: _pct(f.wall_us, 50) for k, f in figures.items()},
        "route_wall_p99_us": {k: _pct(f.wall_us, 99) for k, f in figures.items()},
        "route_matched_peers_mean": {k: round(f.matched_peers, 1) for k, f in figures.items()},
        "route_policy": "cost",
        "route_top_k": ROUTE_TOP_K,
    }
