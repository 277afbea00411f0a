"""``radixmesh serve``: run one node (OpenAI-compatible API + peer endpoints) with uvicorn.

With no engine flags the node runs the built-in ``tiny`` preset, so
``radixmesh serve --port 8001`` just works. ``--config node.toml`` takes the same keys as the
flags; flags win.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from radixmesh.runtime.config import ServeConfig, add_serve_arguments, config_from_args

log = logging.getLogger("radixmesh.serve")
SWITCH_INTERVAL_S = 0.0005


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="TOML", help="TOML file: same keys as the flags")
    add_serve_arguments(parser)


def build_service(config: ServeConfig):  # type: ignore[no-untyped-def]
    """Engine + NodeService for ``config`` (slow: builds or loads the model)."""
    from radixmesh.engine.factory import build_engine
    from radixmesh.runtime.node import NodeService

    engine = build_engine(
        None if config.model else config.preset,
        model_path=config.model or None,
        cache_tokens=config.cache_tokens,
        device=config.device,
        seed=config.seed,
        threads=config.threads or None,
    )
    from radixmesh.runtime.debug import DelayedEngine

    return NodeService(config, DelayedEngine(engine, config.debug_engine_delay))


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    try:
        config = config_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"radixmesh serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s {config.name} %(levelname)s %(name)s: %(message)s",
    )
    # The engine computes on a worker thread; with CPython's default 5 ms GIL switch interval
    # the event loop (peer messages, first bytes, gossip) waits up to 5 ms behind it.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    for noisy in ("httpx", "httpcore"):  # one INFO line per gossip message otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    import uvicorn

    from radixmesh.runtime.app import create_app

    try:
        service = build_service(config)
    except (ValueError, OSError) as exc:
        print(f"radixmesh serve: cannot build the engine: {exc}", file=sys.stderr)
        return 2
    log.info("engine %s built in %.2fs", service.engine.model_name, time.perf_counter() - t0)
    server = uvicorn.Server(uvicorn.Config(
        create_app(service),
        host=config.host,
        port=config.port,
        log_level="warning" if config.log_level == "info" else config.log_level,
        access_log=False,
        timeout_graceful_shutdown=3,
        lifespan="on",
    ))
    server.run()
    return 0 if server.started else 1
