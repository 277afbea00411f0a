"""``radixmesh emulate``: one emulated vLLM engine as its own process.

Theory of operation
-------------------
Parse the flags, resolve the profile (a shipped name or a TOML file, ``core/profile.py``),
load the tokenizer (``--tokenizer DIR``: a Hugging Face tokenizer directory; default the byte
tokenizer), start :class:`~radixmesh.emulate.server.EmulatedEngine` and run until SIGTERM /
SIGINT. The start-up line names the profile and says "emulated", so a log never passes for a
real GPU's. Bad flags are a usage error (exit 2) naming the flag.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from radixmesh.core.profile import Profile, resolve, shipped
from radixmesh.emulate.server import EmulatedEngine
from radixmesh.engine.base import Tokenizer
from radixmesh.engine.tokenizers import ByteTokenizer, HFTokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", required=True, metavar="NAME|FILE",
                        help=f"step-time profile: one of {', '.join(shipped())}, or a TOML file")
    parser.add_argument("--port", type=int, required=True, help="HTTP port (0: any free one)")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="Hugging Face tokenizer directory (default: the byte tokenizer)")
    parser.add_argument("--kv-events", metavar="ENDPOINT",
                        help="publish vLLM KV events on this ZMQ endpoint, e.g. tcp://*:5557")
    parser.add_argument("--kv-replay", metavar="ENDPOINT",
                        help="the replay ROUTER endpoint, e.g. tcp://*:5558 (with --kv-events)")
    parser.add_argument("--time-scale", type=float, default=1.0, metavar="S",
                        help="each step lasts profile step time x S (0: as fast as possible)")
    parser.add_argument("--served-model-name", metavar="N",
                        help="the model name clients send (default: the profile's model)")
    parser.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME",
                        help="LoRA adapters served by name, as vLLM's (their KV is their own)")


def build(args: argparse.Namespace) -> EmulatedEngine:
    """The engine the flags describe (not started); ValueError naming the bad flag."""
    try:
        profile: Profile = resolve(args.profile)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--profile {args.profile}: {exc}") from exc
    if args.kv_replay and not args.kv_events:
        raise ValueError("--kv-replay needs --kv-events")
    if not args.time_scale >= 0:
        raise ValueError(f"--time-scale must be >= 0, got {args.time_scale}")
    tokenizer: Tokenizer = ByteTokenizer()
    if args.tokenizer:
        try:
            tokenizer = HFTokenizer(args.tokenizer)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--tokenizer {args.tokenizer}: {exc}") from exc
    return EmulatedEngine(profile, model=args.served_model_name, tokenizer=tokenizer,
                          host=args.host, port=args.port, time_scale=args.time_scale,
                          kv_events=args.kv_events, kv_replay=args.kv_replay,
                          adapters=tuple(name.split("=", 1)[0] for name in args.lora_modules))


async def serve(engine: EmulatedEngine) -> None:
    """Start ``engine``, say so, run until SIGTERM / SIGINT, stop it."""
    await engine.start()
    p = engine.profile
    events = (f" kv-events {engine.kv_endpoint} replay {engine.replay_endpoint}"
              if engine.events else "")
    print(f"radixmesh emulate: EMULATED engine (no model runs), profile {p.name} "
          f"({p.hardware}, {p.model}{', derived' if p.derived else ''}), time scale "
          f"{engine.loop.time_scale}, model name {engine.model!r}, serving {engine.url}{events}",
          flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await engine.stop()


def run(args: argparse.Namespace) -> int:
    try:
        engine = build(args)
    except ValueError as exc:
        print(f"radixmesh emulate: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(engine))
    return 0
