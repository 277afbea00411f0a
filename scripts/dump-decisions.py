#!/usr/bin/env python3
"""Print the `cost` router's inputs for the decisions you want to understand, while a
simulation (or any other radixmesh command run in this process) makes them.

    scripts/dump-decisions.py [--tag unplaced,second_copy] [--limit 20] -- sim --nodes 4 ...

Everything after ``--`` is a `radixmesh` command line. Each decision whose chosen candidate
carries one of the placement tags asked for (``first``, ``hit``, ``replica``,
``second_copy``, ``unplaced``, ``local_copy``; ``all`` for every decision) is printed with
what the deciding node believed: per candidate its rank, estimated cached tokens, expected
queue, utilization, mesh cost (``core.router.mesh_cost``) and predicted latency, the error of
its queue predictions and its prefill speed as reported (before the robust-speed rule), the
prefix's owners and the tokens that count as holding it, and the chosen node: the node's
decision record (``core/decisions.py``), printed as a real cluster's are by
``scripts/why.py``. At the end, how many decisions chose each tag. Placement (owners, tags)
exists for the `cost` policy only; other policies' decisions are counted under ``None``.

The decision log is wrapped, not the router: the command's own output and results are the
same as without this script. Reading these dumps for the decisions that went wrong found the causes
behind the one-client losses of `0072f90` (docs/design.md and docs/ideas-tried.md; "Before that
(`0072f90`)").
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import Any

from radixmesh.core import decisions as dl
from radixmesh.core.router import Tag

TAGS = {t.value for t in Tag}


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
    opts = parser.parse_args(argv[:cut])
    wanted = None if opts.tag == "all" else set(opts.tag.split(","))
    if wanted is not None and not wanted <= TAGS:
        parser.error(f"unknown tag(s) {sorted(wanted - TAGS)}; known: {sorted(TAGS)}")
    tally: Counter[str | None] = Counter()
    printed = 0
    original = dl.DecisionLog.record

    def record(self: dl.DecisionLog, *args: Any, **kwargs: Any) -> None:
        nonlocal printed
        original(self, *args, **kwargs)
        probe = dl.DecisionLog(1)  # the node's own log may keep none (the simulator's)
        original(probe, *args, **kwargs)
        if not len(probe):
            return
        decision = probe.recent()[0]
        tag = decision.placement
        tally[tag] += 1
        if printed < opts.limit and (wanted is None or tag in wanted):
            printed += 1
            print("\n".join(dl.describe(decision)), file=sys.stderr)

    dl.DecisionLog.record = record  # type: ignore[method-assign]
    from radixmesh.cli import main as radixmesh

    try:
        return radixmesh(argv[cut + 1:]) or 0
    finally:
        print("decisions by placement tag:",
              ", ".join(f"{k}: {v}" for k, v in tally.most_common()), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
