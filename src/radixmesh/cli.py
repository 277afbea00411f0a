"""The ``radixmesh`` command: one subcommand per module, imported only when used.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from radixmesh import __version__

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("radixmesh.runtime.serve_cli", "run one node (OpenAI-compatible API + peer mesh)"),
    "cluster": ("radixmesh.runtime.cluster", "start N nodes on 127.0.0.1 and keep them running"),
    "bench": ("radixmesh.bench.cli", "run benchmark sweeps against fresh local clusters"),
    "demo": ("radixmesh.bench.demo", "4 nodes, ~300 requests, none/paper/cost, with a report"),
    "emulate": ("radixmesh.emulate.cli", "an emulated vLLM engine: its API and KV events, a "
                "profile's speed, no model"),
    "sim": ("radixmesh.sim.cli", "discrete-event simulation of the same core at scale"),
    "profile": ("radixmesh.profiles.cli", "step-time profiles: list them, show what one predicts"),
    "calibrate": ("radixmesh.bench.calibrate", "measure the built-in engine into a cost model"),
    "chaos": ("radixmesh.chaos.cli", "fault injection and soak tests against real nodes"),
    "microbench": ("radixmesh.bench.microbench", "micro-benchmarks of the core and engine"),
}


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixmesh",
        description="Peer-to-peer LLM serving with prefix-cache-aware routing.",
        epilog="commands:\n"
        + "\n".join(f"  {name:<11} {help_}" for name, (_, help_) in COMMANDS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"radixmesh {__version__}")
    parser.add_argument("command", nargs="?", choices=sorted(COMMANDS), help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    if not args or args[0].startswith("-"):
        top.parse_args(args)  # handles --version / --help, or errors out
        top.print_help()
        return 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        top.error(f"unknown command {name!r}")
    module_name, help_ = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(f"radixmesh {name}: not available in this build", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=f"radixmesh {name}", description=help_)
    module.add_arguments(parser)
    code: int = module.run(parser.parse_args(rest))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
