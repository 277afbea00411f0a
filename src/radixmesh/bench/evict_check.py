"""Would an eviction-aware prediction have matched the engine more often? Captured real-vLLM
runs replayed offline through :mod:`radixmesh.core.free_queue`.

Theory of operation
-------------------
A run capture (``tests/fixtures/vllm_0_32_concurrency/``, or a whole run saved the same way
with every engine's frames under ``engines_frames`` and each request's ``engine``) holds each
engine's KV-event batches with their arrival times and, per request it served, the prompt, the
node's prediction ``P`` at acceptance, the engine's count ``A``, the client's instants and the
run's verdict (``bench/mismatch.py``). Per request ``R`` of an engine, in acceptance order:

    index     = the engine's events replayed up to the latest point of R's acceptance window
                that gives P (the node's view; the classifier's window and slack), else the
                events by R's response headers
    finished  = the engine's requests whose stream ended by then (max_tokens 1 here: the
                first token), released into a FreeOrder in that order
    in flight = accepted before R, not finished: *running* when the index holds its prompt's
                full blocks (the engine stored them: scheduled), else *waiting* (in acceptance
                order, which is the order the node sent them)
    P'        = min(P, surviving_blocks(R's chain, ...) x engine block)

and ``P'`` is judged against ``A``: the same class as before when ``P' == P``, else ``match``
(fixed), ``evicted`` (still over) or ``over`` (discounted below ``A``: a mismatch the estimate
made). The capacity is the engine's ``num_gpu_blocks`` (``--num-blocks``, 48 in the captures)
less vLLM's null block.

Usage: ``python -m radixmesh.bench.evict_check [--num-blocks 48] CAPTURE.msgpack ...``
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixmesh.bench.mismatch import CLASSES, DEFAULT_SLACK_S, EventStream, stream_of
from radixmesh.core.blocks import block_hashes
from radixmesh.core.free_queue import EngineQueue, Held
from radixmesh.engine.http_engine import exact_match

AFTER = (*CLASSES, "over")


@dataclass(frozen=True, slots=True)
class Served:
    id: str
    prompt: tuple[int, ...]
    predicted: int
    actual: int
    t_sent: float
    t_headers: float
    t_first: float
    kind: str  # the run's verdict


def estimates(stream: EventStream, served: Sequence[Served], capacity: int,
              slack_s: float = DEFAULT_SLACK_S) -> list[int]:
    """The eviction-aware estimate (tokens) of every request of one engine (the module
    docstring's rule; ``P'`` is ``min(P, estimate)``)."""
    eb = stream.engine_block_size
    if stream.block_size != eb:
        raise ValueError("the mesh block must equal the engine block (mesh_block_size)")
    held = {s.id: Held.of_prompt(block_hashes(s.prompt, eb, 0), len(s.prompt), eb)
            for s in served}
    steps = sorted([(s.t_headers, 1, s.id) for s in served]
                   + [(s.t_first, 0, s.id) for s in served])  # max_tokens 1: first = last
    out = []
    for r in served:
        node = EngineQueue(capacity)
        for t, is_sent, rid in steps:
            if t >= r.t_headers:
                break
            if is_sent:
                node.sent(rid, held[rid])
            else:
                node.finished(rid)
        out.append(node.surviving(held[r.id].chain, _view(stream, r, slack_s).hashes()) * eb)
    return out


def _view(stream: EventStream, r: Served, slack_s: float) -> Any:
    """The replayed index the node predicted from (the latest window point giving P)."""
    lo = stream.position(r.t_sent - slack_s)
    hi = stream.position(r.t_headers + slack_s)
    values = stream.matches(r.prompt, hi, lo)
    at = next((lo + i for i in range(len(values) - 1, -1, -1) if values[i] == r.predicted),
              stream.position(r.t_headers))
    index = stream.fresh_index()
    for ev in stream.events[:at]:
        index.apply_event(ev)
    assert exact_match(index, r.prompt) == r.predicted or at == stream.position(r.t_headers)
    return index


def judge(r: Served, p2: int) -> str:
    """``P'``'s class: the run's when unchanged, else ``match``, ``evicted`` (still above
    ``A``) or ``over`` (below ``A``)."""
    if p2 == r.predicted:
        return r.kind
    return "match" if p2 == r.actual else "evicted" if p2 > r.actual else "over"


def load(path: Path) -> list[tuple[EventStream, list[Served]]]:
    import msgpack

    doc = msgpack.unpackb(path.read_bytes(), raw=False)
    frames = doc.get("engines_frames") or [doc["frames"]]
    out = []
    for e, fr in enumerate(frames):
        stream = stream_of([(t, f) for t, f in fr], doc["block_size"], doc["engine_block_size"])
        served = [Served(q["id"], tuple(q["prompt"]), q["predicted"], q["actual"], q["t_sent"],
                         q["t_headers"], q["t_first"], q["class"])
                  for q in doc["requests"] if q.get("engine", 0) == e]
        out.append((stream, sorted(served, key=lambda s: s.t_headers)))
    return out


def check(path: Path, num_blocks: int, discount_only: bool = True) -> dict[str, Any]:
    before: Counter[str] = Counter()
    after: Counter[str] = Counter()
    err = [0, 0]
    for stream, served in load(path):
        for r, est in zip(served, estimates(stream, served, num_blocks - 1), strict=True):
            p2 = min(r.predicted, est) if discount_only else est
            before[r.kind] += 1
            after[judge(r, p2)] += 1
            err[0] += abs(r.predicted - r.actual)
            err[1] += abs(p2 - r.actual)
    return {"file": path.name, "discount_only": discount_only,
            "before": {k: before[k] for k in CLASSES}, "after": {k: after[k] for k in AFTER},
            "abs_error_tokens": {"before": err[0], "after": err[1]}}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m radixmesh.bench.evict_check",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("captures", nargs="+", type=Path)
    ap.add_argument("--num-blocks", type=int, default=48, help="the engine's num_gpu_blocks")
    ap.add_argument("--raise", dest="raise_", action="store_true",
                    help="also raise P to the estimate (blocks the requests ahead will store)")
    args = ap.parse_args(argv)
    for p in args.captures:
        print(json.dumps(check(p, args.num_blocks, not args.raise_)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
