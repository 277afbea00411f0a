"""``radixmesh microbench``: micro-benchmarks that print figures (never timed assertions).

Sections live in their own modules, each exposing ``run(quick: bool) -> dict[str, object]``:
core (hashing, radix tree, routing), gossip (encoding sizes, delta bandwidth), engine
(prefill with and without cached prefixes).
"""

from __future__ import annotations

import argparse
import importlib
import json
from typing import Any

SECTIONS = {
    "core": "radixmesh.bench.micro_core",
    "gossip": "radixmesh.bench.micro_gossip",
    "engine": "radixmesh.bench.micro_engine",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--engine", action="store_true", help="also run the engine section")
    parser.add_argument("--only", choices=sorted(SECTIONS), help="run one section only")
    parser.add_argument("--quick", action="store_true", help="fewer iterations (for tests)")


def run(args: argparse.Namespace) -> int:
    default = ["core", "gossip", *(["engine"] if args.engine else [])]
    names = [args.only] if args.only else default
    results: dict[str, Any] = {}
    for name in names:
        module = importlib.import_module(SECTIONS[name])
        results.update(module.run(quick=args.quick))
    if args.json:
        print(json.dumps(results, indent=2, sort_keys=True))
    else:
        for key, value in sorted(results.items()):
            print(f"{key:<32} {value}")
    return 0
