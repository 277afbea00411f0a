#!/usr/bin/env python3
"""Why did a benchmark's requests go where they went? Joins a `radixmesh bench` folder's
records (``requests.jsonl``) with the routing decisions its nodes kept
(``decisions/<run>.jsonl``, core/decisions.py) and prints, for the requests asked for, what
the entry node believed of every candidate when it chose (and, where the node reported them,
the queue wait and service the request then met where it ran: the prediction's error); for
a forwarded request, the serving node's verdict on the forward too (its predicted cost,
against what the entry node said it had to beat).

    scripts/why.py RUN_DIR [--run NAME] [--placement second_copy,unplaced] [--slowest 5]
                           [--seq 40] [--limit 20]

``--placement`` picks requests by their placement tag (``core.router.Tag``; default
``second_copy``), ``--slowest N`` the N slowest of each run, ``--seq`` requests by their
position in the run; ``--run`` a run by (a part of) its name (default: every run with
decisions). Each request's decisions are printed in order: its first ranking, then any
re-ranking after a refused or failed forward.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from radixmesh.core.decisions import Decision, describe, from_json


def _load_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _admission(kept: list[dict[str, Any]], decision: Decision, rec: dict[str, Any]
               ) -> dict[str, Any] | None:
    """The serving node's verdict on this forward: the first it made on a prompt of this
    length after the entry node's decision (the nodes of a bench cluster share one
    machine's monotonic clock), within 5 s."""
    for adm in kept:
        if (adm["prompt_tokens"] == rec.get("prompt_tokens") and adm["verdict"] == "accepted"
                and decision.at <= adm["at"] <= decision.at + 5.0):
            return adm
    return None


def _admission_line(adm: dict[str, Any], node: str) -> str:
    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f} s"
    return (f"  {node} admitted it at {adm['at']:.3f}: its cost {s(adm['cost_s'])} (queue wait "
            f"{s(adm['wait_s'])}) against the sender's {s(adm['beat_s'])}; {adm['queue_depth']} "
            f"queued or running there, {adm['cached_tokens']} tokens cached")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--run", default="", help="runs whose name contains this")
    parser.add_argument("--placement", default="second_copy",
                        help="comma-separated placement tags ('' for none)")
    parser.add_argument("--slowest", type=int, default=0, help="also the N slowest requests")
    parser.add_argument("--seq", default="", help="also these request positions, comma list")
    parser.add_argument("--limit", type=int, default=20, help="requests printed at most")
    args = parser.parse_args(argv)
    folder = args.run_dir / "decisions"
    if not folder.is_dir():
        parser.error(f"{folder} does not exist (runs before decision logs, or a gateway run)")
    records: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in _load_jsonl(args.run_dir / "requests.jsonl"):
        records[rec["run"]].append(rec)
    tags = {t for t in args.placement.split(",") if t}
    seqs = {int(s) for s in args.seq.split(",") if s}
    printed = 0
    for path in sorted(folder.glob("*.jsonl")):
        run = path.stem
        if args.run not in run:
            continue
        by_request: dict[tuple[str, int], list[Decision]] = defaultdict(list)
        admissions: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for obj in _load_jsonl(path):
            if obj.get("kind", "route") == "route":
                by_request[(obj["node"], obj["request"])].append(from_json(obj))
            else:
                admissions[obj["node"]].append(obj)
        recs = [r for r in records.get(run, []) if r.get("error") is None]
        slow = {r["seq"] for r in sorted(recs, key=lambda r: -r["latency_s"])[:args.slowest]}
        wanted = seqs | slow
        picked = [r for r in recs if r.get("placement") in tags or r["seq"] in wanted]
        print(f"=== {run}: {len(picked)} of {len(recs)} requests picked")
        for rec in picked:
            if printed >= args.limit:
                return 0
            printed += 1
            print(f"request seq {rec['seq']} ({rec['id']}): entered {rec['entry_node']}, served "
                  f"by {rec['served_by']} ({rec['route']}, {rec.get('placement')}), "
                  f"{rec['latency_s']:.3f} s, cached {rec.get('cached_tokens')} of "
                  f"{rec.get('prompt_tokens')} tokens")
            timing = rec.get("server_timing") or {}
            if "queue" in timing and "service" in timing:
                print(f"  met: queue {timing['queue']:.3f} s + service {timing['service']:.3f} s "
                      f"at {rec['served_by']}")
            found = by_request.get((rec["entry_node"], rec.get("request")), [])
            if not found:
                print("  (no decision kept: evicted from the node's ring, or not routed)")
            for d in found:
                print("\n".join(describe(d, rec["entry_node"])))
            if found and rec["served_by"] != rec["entry_node"]:
                adm = _admission(admissions[rec["served_by"]], found[-1], rec)
                if adm is not None:
                    print(_admission_line(adm, rec["served_by"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
