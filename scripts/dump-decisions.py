#!/usr/bin/env python3
"""Print the `cost` router's inputs for the decisions you want to understand, while a
simulation (or any other radixmesh command run in this process) makes them.

    scripts/dump-decisions.py [--tag unplaced,second_copy] [--limit 20] -- sim --nodes 4 ...

Everything after ``--`` is a `radixmesh` command line. Each decision whose chosen candidate
carries one of the placement tags asked for (``first``, ``hit``, ``replica``,
``second_copy``, ``unplaced``, ``local_copy``; ``all`` for every decision) is printed with
what the deciding node believed: per candidate its estimated cached tokens, expected queue,
utilization, mesh cost (``core.router.mesh_cost``), the error of its queue predictions and
its prefill speed as the router used it (after the robust-speed rule),
the prefix's owners and the tokens that count as holding it, and the chosen node. At the
end, how many decisions chose each tag. Placement (owners, tags) exists for the `cost`
policy only; other policies' decisions are counted under ``None``.

The router is wrapped, not changed: the command's own output and results are the same as
without this script. Reading these dumps for the decisions that went wrong found the causes
behind the one-client losses of `0072f90` (docs/benchmarks.md, "Router" -> "Before that
(`0072f90`)").
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import Any

from radixmesh.core import router as r

TAGS = {t.value for t in r.Tag}


def main() -> int:
    argv = sys.argv[1:]
    if "--" not in argv:
        print(__doc__)
        return 2
    cut = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default="unplaced,second_copy",
                        help="comma-separated placement tags to print, or 'all'")
    parser.add_argument("--limit", type=int, default=20, help="decisions printed at most")
    args = parser.parse_args(argv[:cut])
    wanted = None if args.tag == "all" else set(args.tag.split(","))
    if wanted is not None and not wanted <= TAGS:
        parser.error(f"unknown tag(s) {sorted(wanted - TAGS)}; known: {sorted(TAGS)}")
    tally: Counter[str | None] = Counter()
    printed = 0
    original = r.Router._rank_cost

    def rank_cost(self: r.Router, req: r.RouteInput, nodes: Any, avail: list[r.NodeInfo],
                  rng: Any, placement: r.Placement | None) -> list[r.Candidate]:
        nonlocal printed
        out = original(self, req, nodes, avail, rng, placement)
        tag = out[0].placement.value if out and out[0].placement is not None else None
        tally[tag] += 1
        if printed < args.limit and (wanted is None or tag in wanted):
            printed += 1
            _show(self, req, avail, placement, out[0], tag)
        return out

    r.Router._rank_cost = rank_cost  # type: ignore[method-assign]
    from radixmesh.cli import main as radixmesh

    try:
        return radixmesh(argv[cut + 1:]) or 0
    finally:
        print("decisions by placement tag:",
              ", ".join(f"{k}: {v}" for k, v in tally.most_common()), file=sys.stderr)


def _show(router: r.Router, req: r.RouteInput, avail: list[r.NodeInfo],
          placement: r.Placement | None, chosen: r.Candidate, tag: str | None) -> None:
    me = next(n for n in avail if n.is_self)
    costs = r.mesh_cost(req, avail, router.config.context_scale)
    owners = "-" if placement is None else ",".join(placement.owners)
    held = "-" if placement is None else placement.held_tokens
    print(f"--- at {me.node_id}: {req.prompt_tokens} prompt tokens, owners {owners}, "
          f"held at {held} tokens -> {chosen.node_id} ({tag})", file=sys.stderr)
    for n, cost in sorted(zip(avail, costs, strict=True), key=lambda p: p[1]):
        mark = "*" if n.is_self else " "
        sp = n.speed
        print(f"    {n.node_id}{mark} cached {n.cached_tokens:6d}  queue {n.queue_depth:5.2f}  "
              f"util {n.utilization:4.2f}  cost {cost:7.3f} s  wait error {n.wait_error_s:.3f} s  "
              f"speed {sp.prefill_overhead_s * 1e3:.1f} ms + {sp.prefill_s_per_token * 1e6:.0f} "
              f"us/unit", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
