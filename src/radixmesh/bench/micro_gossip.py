"""Gossip micro-benchmarks: snapshot size per cached block, and delta bandwidth at steady churn.

Everything runs real ``NodeCore`` instances over the in-memory fake network on a virtual clock
(``radixmesh.testing.TwinCluster``), so bandwidth figures are exact byte counts of encoded messages,
independent of machine speed; only the ``*_ms`` figures are timings.

Churn model (stated, because bytes/s are proportional to it): the measured node holds a full
cache of ``CACHE_BLOCKS`` blocks; each request it serves adds ``blocks_per_request`` new blocks
and evicts as many of the oldest, i.e. ``2 * blocks_per_request`` block changes per request.
The headline ``delta_bytes_per_s`` is at 1 request/s with 6 new blocks per request (an MMLU
question suffix of ~460 characters is ~100 BPE tokens = 6 blocks of 16): 12 changes/s. The
sweep shows other rates, including a byte-level tokenizer (29 blocks per request).
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import replace

from radixmesh.core.cache_summary import LocalSummary, pack_hashes, unpack_hashes
from radixmesh.core.codec import Codec
from radixmesh.core.config import GossipConfig, GossipMode
from radixmesh.core.events import LoadChanged
from radixmesh.core.messages import Gossip, Load
from radixmesh.core.profile import resolve
from radixmesh.core.sessions import SessionConfig
from radixmesh.core.shadow import Shadow
from radixmesh.testing import LinkConfig, TwinCluster

CACHE_BLOCKS = 100_000
PEERS = 4
INTERVAL_S = 0.5
HEADLINE = (1.0, 6)  # requests/s, new blocks per request


def run(quick: bool = False) -> dict[str, object]:
    out: dict[str, object] = {}
    out.update(_snapshot_figures(quick))
    out.update(_delta_figures(quick))
    out.update(_session_figures())
    return out


# ------------------------------------------------------------------------------- sessions
def _session_figures() -> dict[str, object]:
    """(tenants) The line of session ids (core/sessions.py): what they add to one message at
    the most a message carries (``SessionConfig.max_gossip``), and per second to ``PEERS``
    peers every ``INTERVAL_S``; exact byte counts."""
    rng = random.Random(3)
    n = SessionConfig().max_gossip
    base = Gossip("n1", "127.0.0.1:9001", 1, 1, 1, 7, 0.0, Load(0, 0, 0, 0, None))
    ids = tuple(rng.getrandbits(64) for _ in range(n))
    codec = Codec()
    extra = len(codec.encode(replace(base, sessions=ids))) - len(codec.encode(base))
    return {
        "sessions_per_message_max": n,
        "sessions_bytes_per_message_max": extra,
        "sessions_bytes_per_s_max": round(extra * PEERS / INTERVAL_S),
    }


# ------------------------------------------------------------------------------- snapshot
def _snapshot_figures(quick: bool) -> dict[str, object]:
    rng = random.Random(0)
    summary = LocalSummary(log_limit=1 << 16)
    summary.apply([rng.getrandbits(64) for _ in range(CACHE_BLOCKS)], ())
    snap = summary.snapshot()
    reps = 2 if quick else 5
    t0 = time.perf_counter()
    for _ in range(reps):
        packed = pack_hashes(snap.hashes)
    t1 = time.perf_counter()
    for _ in range(reps):
        unpack_hashes(packed, CACHE_BLOCKS)
    t2 = time.perf_counter()
    return {
        "snapshot_blocks": CACHE_BLOCKS,
        "snapshot_bytes_per_block": round(len(packed) / CACHE_BLOCKS, 3),
        "snapshot_raw_bytes_per_block": 8.0,
        "snapshot_encode_ms": round((t1 - t0) / reps * 1e3, 2),
        "snapshot_decode_ms": round((t2 - t1) / reps * 1e3, 2),
        "snapshot_message_bytes": _snapshot_message_bytes(snap.hashes),
    }


def _snapshot_message_bytes(hashes: tuple[int, ...]) -> int:
    """A whole first-contact message carrying the 100k-block snapshot."""
    c = TwinCluster(2, seed=0)
    c.change_cache("n0", hashes)
    c.run_for(0.01)
    return int(c.nodes["n0"].metrics()["gossip_bytes_out"])


# ---------------------------------------------------------------------------------- delta
def _delta_figures(quick: bool) -> dict[str, object]:
    seconds = 10.0 if quick else 60.0
    out: dict[str, object] = {
        "delta_peers": PEERS,
        "delta_interval_s": INTERVAL_S,
        "delta_churn_requests_per_s": HEADLINE[0],
        "delta_churn_blocks_per_request": HEADLINE[1],
        "delta_churn_changes_per_s": 2 * HEADLINE[0] * HEADLINE[1],
    }
    out["delta_bytes_per_s"] = _bytes_per_s(GossipMode.DELTA, *HEADLINE, seconds)
    out["delta_bytes_per_s_idle"] = _bytes_per_s(GossipMode.DELTA, 0.0, 0, seconds)
    # a node fronting a batching engine (load changes at each request's start and end):
    # without its batch report, and with it (what ``Load.batch`` adds is the difference)
    out["delta_bytes_per_s_busy"] = _bytes_per_s(GossipMode.DELTA, *HEADLINE, seconds,
                                                 busy=True)
    out["delta_bytes_per_s_batch"] = _bytes_per_s(GossipMode.DELTA, *HEADLINE, seconds,
                                                  busy=True, batch=True)
    sweep = [] if quick else [(1.0, 29), (5.0, 6), (5.0, 29), (20.0, 6)]
    for rate, blocks in sweep:
        key = f"delta_bytes_per_s_{rate:g}rps_{blocks}blocks"
        out[key] = _bytes_per_s(GossipMode.DELTA, rate, blocks, seconds)
    if not quick:  # the paper's full snapshots, same churn (slow: 100k-hash messages)
        out["snapshot_mode_bytes_per_s"] = _bytes_per_s(GossipMode.SNAPSHOT, *HEADLINE, 5.0)
    return out


def _bytes_per_s(mode: GossipMode, rate: float, blocks: int, seconds: float,
                 busy: bool = False, batch: bool = False) -> float:
    """Bytes/s sent by one node with a full cache at steady churn, to PEERS peers. ``busy``:
    its load changes when each request arrives and again halfway to the next (its end);
    ``batch``: with its shadow's batch (``Load.batch``) of an H100 (``core/shadow.py``)."""
    rng = random.Random(1)
    gossip = GossipConfig(interval_s=INTERVAL_S, mode=mode)
    c = TwinCluster(PEERS + 1, gossip=gossip, seed=1, link=LinkConfig(delay_s=0.0005))
    resident = deque(rng.getrandbits(64) for _ in range(CACHE_BLOCKS))
    c.change_cache("n0", resident)
    shadow = Shadow(resolve("h100-llama3-8b")) if batch else None
    c.run_for(5.0)  # join and first snapshots
    node = c.nodes["n0"]
    start = node.metrics()["gossip_bytes_out"]
    t_end = c.now + seconds
    while c.now < t_end:
        gap = 1.0 / rate if rate > 0 else seconds
        wait = min(rng.expovariate(1.0 / gap), t_end - c.now)
        if busy:
            c.run_for(wait / 2)
            c.deliver("n0", _load(0, shadow, c.now))
            wait /= 2
        c.run_for(wait)
        if busy and c.now < t_end:
            prompt = [rng.getrandbits(20) for _ in range(512)]  # (the same arrivals either way)
            if shadow is not None:
                shadow.add(c.now, prompt, 64, c.now)
            c.deliver("n0", _load(1, shadow, c.now))
        if rate > 0 and c.now < t_end:
            added = [rng.getrandbits(64) for _ in range(blocks)]
            removed = [resident.popleft() for _ in range(blocks)]
            resident.extend(added)
            c.change_cache("n0", added, removed)
    sent = node.metrics()["gossip_bytes_out"] - start
    c.run_for(2.5 * INTERVAL_S)
    if not c.converged():  # the figure is only worth something if the views are right
        raise RuntimeError("peers' views did not converge after the benchmark")
    return round(sent / seconds, 1)


def _load(depth: int, shadow: Shadow | None, now: float) -> LoadChanged:
    """A load report of ``depth`` requests, with the shadow's batch if any."""
    batch = None if shadow is None else shadow.state(now)
    return LoadChanged(depth, depth, 0, 1 << 20, batch=batch)
