"""``radixmesh serve``: run one node (OpenAI-compatible API + peer endpoints) with uvicorn.

With no engine flags the node runs the built-in ``mini`` preset (BPE, 32k context), so
``radixmesh serve --port 8001`` just works. ``--config node.toml`` takes the same keys as the
flags; flags win.

SIGTERM drains: uvicorn handles SIGTERM itself (it stops listening at once and cancels what
runs after ``timeout_graceful_shutdown``), so :class:`DrainingServer` takes the first SIGTERM
over: the node leaves (``NodeService.leave``: no new work, peers told at once through gossip,
``/health`` answers 503 "leaving") while the socket stays open — requests still arriving are
sent to peers — and only once nothing runs and ``--drain-linger`` (default 2 s: load balancers
and readiness probes that poll ``/health`` see the 503 before the port closes) has passed, or
``--drain-grace`` has passed, is uvicorn told to exit; the process then exits 0 at once
(``os._exit`` after flushing the logs: the interpreter's teardown with torch loaded took 9 s).
A second SIGTERM, or SIGINT, exits at once as before.

``--peer-tls-cert/--peer-tls-key/--peer-tls-ca``: the same port serves HTTPS (uvicorn gets the
node's SSL context and a protocol class that exposes the client certificate to the app, see
runtime/peer_tls.py); unusable files are a start-up error (exit 2), before the engine is built.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time
import urllib.request
from types import FrameType
from typing import TYPE_CHECKING, Any

from radixmesh.runtime.config import ServeConfig, add_serve_arguments, config_from_args

if TYPE_CHECKING:
    import uvicorn

    _NodeServer = Any  # runtime/app.node_server_class(), a class made when uvicorn is imported
else:
    _NodeServer = object

log = logging.getLogger("radixmesh.serve")
SWITCH_INTERVAL_S = 0.0005
MODEL_PROBE_TIMEOUT_S = 5.0  # external engine: GET /v1/models at start
DEFAULT_MAX_CONTEXT = 32_768  # external engine that does not say its max_model_len


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="TOML", help="TOML file: same keys as the flags")
    add_serve_arguments(parser)


def build_service(config: ServeConfig):  # type: ignore[no-untyped-def]
    """Engine + NodeService for ``config`` (slow: builds or loads the model)."""
    if config.engine != "builtin":
        return build_external_service(config)
    from radixmesh.engine.factory import adapter_folders, build_engine
    from radixmesh.runtime.node import NodeService

    if config.gpu_memory_fraction and config.device.startswith("cuda"):
        import torch

        dev = torch.device(config.device)
        torch.cuda.set_per_process_memory_fraction(config.gpu_memory_fraction, dev)
    engine = build_engine(
        None if config.model else config.preset,
        model_path=config.model or None,
        cache_tokens=config.cache_tokens,
        device=config.device,
        dtype=config.dtype,
        seed=config.seed,
        threads=config.threads or None,
        adapters=adapter_folders(config.adapters),  # (tenants) PEFT LoRA folders
    )
    from radixmesh.runtime.debug import DelayedEngine

    return NodeService(config, DelayedEngine(engine, config.debug_engine_delay))


def build_external_service(config: ServeConfig, tokenizer: Any = None) -> Any:
    """NodeService in front of an external engine (``--engine vllm|sglang|openai``): an
    HttpEngine, and for vllm / sglang with ``--kv-events`` the subscriber that keeps its index
    exact, started and stopped with the service. ``tokenizer`` overrides ``--tokenizer``."""
    from radixmesh.engine.http_engine import HttpEngine
    from radixmesh.runtime.node import NodeService

    if tokenizer is None:
        tokenizer = _external_tokenizer(config)
    launched = _launch_engine(config)
    try:
        name, max_context = _engine_model(config)
    except BaseException:
        if launched is not None:
            launched.terminate()
        raise
    engine = HttpEngine(config.engine, config.engine_url, tokenizer, model_name=name,
                        cache_tokens=config.cache_tokens, max_context=max_context,
                        engine_block_size=config.engine_block_size or None,
                        kv_blocks=config.engine_kv_blocks,
                        slots=_llamacpp_slots(config) if config.engine == "llamacpp" else 1)
    service = NodeService(config, engine)
    _attach(service, config, engine, launched)
    return service


def _external_tokenizer(config: ServeConfig) -> Any:
    """``--tokenizer``: the engine's own tokenizer files, or ``bytes``."""
    from radixmesh.engine.tokenizers import ByteTokenizer, HFTokenizer

    if not config.tokenizer:
        raise ValueError(f"--engine {config.engine} needs --tokenizer DIR: the engine's own "
                         "tokenizer files (radixmesh sends token ids), or `bytes`")
    return ByteTokenizer() if config.tokenizer == "bytes" else HFTokenizer(config.tokenizer)


def _attach(service: Any, config: ServeConfig, engine: Any, launched: Any) -> None:
    """What starts and stops with a node in front of an external engine: the launched
    engine, the KV-event subscriber (or a warning without one), the engine's health
    check and, with a shadow, its metrics."""
    from radixmesh.runtime.kv_subscriber import KvSubscriber, plan_endpoints

    if launched is not None:
        service.attachments.append(launched)  # stopped with the node
    if config.kv_events:
        pubs, replays = plan_endpoints(config.kv_events, config.kv_replay, config.engine_url)
        service.attachments.append(KvSubscriber(engine.index, pubs, replays,
                                                on_change=service.push_cache_and_load))
    else:
        log.warning("no --kv-events: the cache view of %s is approximate (what this node "
                    "sent, LRU)", config.engine_url)
    from radixmesh.runtime.engine_health import EngineHealth  # (wave 3, real engines)

    service.attachments.append(EngineHealth(service, config.engine_url, launched=launched))
    if service.shadow is not None and config.engine_metrics_interval > 0:
        from radixmesh.runtime.engine_metrics import EngineMetrics  # the shadow's view of
        service.attachments.append(EngineMetrics(  # load others send the engine
            service, config.engine_url, interval_s=config.engine_metrics_interval))


def _launch_engine(config: ServeConfig) -> Any:
    """``--launch``: the engine as a child process, answering before the node is built."""
    if not config.launch:
        return None
    from radixmesh.runtime.launch import EngineProcess

    launched = EngineProcess(config.launch, config.engine_url)
    log.warning("launching the engine: %s", config.launch)
    launched.start_and_wait()
    return launched


def _engine_model(config: ServeConfig) -> tuple[str, int]:
    """(served model name, context length): ``--model`` (the context length then defaults),
    else the engine's ``/v1/models``."""
    if config.model:
        return config.model, DEFAULT_MAX_CONTEXT
    url = config.engine_url.rstrip("/") + "/v1/models"
    try:
        with urllib.request.urlopen(url, timeout=MODEL_PROBE_TIMEOUT_S) as resp:
            card = json.load(resp)["data"][0]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"cannot ask {url} for the model name ({exc}); pass --model") from exc
    length = card.get("max_model_len")
    return str(card["id"]), length if isinstance(length, int) else DEFAULT_MAX_CONTEXT


def _llamacpp_slots(config: ServeConfig) -> int:
    """llama.cpp's slot count (``-np``): ``total_slots`` of its ``/props``; 1 if it says
    nothing (the node's slot model then assumes one)."""
    url = config.engine_url.rstrip("/") + "/props"
    try:
        with urllib.request.urlopen(url, timeout=MODEL_PROBE_TIMEOUT_S) as resp:
            slots = json.load(resp).get("total_slots")
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("cannot read %s (%s): assuming one llama.cpp slot", url, exc)
        return 1
    return slots if isinstance(slots, int) and slots >= 1 else 1


class _DrainOnSigterm(_NodeServer):  # type: ignore[misc]
    """The first SIGTERM drains the node before the server exits: mixed into the node's
    server class (``node_server_class()``) by :func:`_draining_server_class`, which imports
    uvicorn only when a node serves."""

    def __init__(self, config: uvicorn.Config, service: Any) -> None:
        super().__init__(config, service)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self.drained = False  # the SIGTERM drain ran to its end: run() exits at once

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self._draining or self.should_exit or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self._draining = True  # not re-raised at exit: a drained node exits 0
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        t0 = time.perf_counter()
        await super().shutdown(sockets)  # connections, then the app's lifespan (engine)
        if self._draining:
            log.warning("server shut down in %.2f s after the drain",
                        time.perf_counter() - t0)

    def _requests_open(self) -> int:
        """Open HTTP requests, less the links peers hold open here (their forwards count
        in the node's own work)."""
        return max(len(self.server_state.tasks) - len(self.service.links), 0)

    async def _drain(self) -> None:
        t0 = time.perf_counter()
        try:
            await self.service.leave(busy=self._requests_open,
                                     linger_s=self.service.config.drain_linger)
        except Exception:  # a bug: exit anyway, the grace is the operator's limit
            log.exception("drain failed")
        finally:
            log.warning("drained in %.2f s; exiting", time.perf_counter() - t0)
            self.drained = True
            self.should_exit = True


def _draining_server_class() -> type[Any]:
    from radixmesh.runtime.app import node_server_class

    class DrainingServer(_DrainOnSigterm, node_server_class()):  # type: ignore[misc]
        """The node's server, except that the first SIGTERM drains the node before it exits."""

    return DrainingServer


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    try:
        config = config_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"radixmesh serve: {exc}", file=sys.stderr)
        return 2
    _setup_process(config)
    from radixmesh.runtime.peer_tls import PeerTls

    try:
        PeerTls.from_config(config)  # fail fast: before the (slow) engine is built
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        print(f"radixmesh serve: cannot load the peer TLS files: {exc}", file=sys.stderr)
        return 2
    try:
        service = build_service(config)
    except (ValueError, OSError) as exc:
        print(f"radixmesh serve: cannot build the engine: {exc}", file=sys.stderr)
        return 2
    log.info("engine %s built in %.2fs", service.engine.model_name, time.perf_counter() - t0)
    server = _server(config, service)
    server.run()
    if server.started and getattr(server, "drained", False):
        _exit_now()  # drained and shut down (the engine too): skip the interpreter's teardown
    return 0 if server.started else 1


def _exit_now() -> None:
    """Exit 0 at once after a SIGTERM drain. With torch loaded, the interpreter's own
    teardown took 9 s on a loaded 2-core box (only the main thread left, no Python frame):
    9 s more of every rolling restart step, and past a short kill timeout. Everything that
    matters is closed by now; logs and stdio are flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _setup_process(config: ServeConfig) -> None:
    """Logging and the GIL switch interval of a node process."""
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s {config.name} %(levelname)s %(name)s: %(message)s",
    )
    # The engine computes on a worker thread; with CPython's default 5 ms GIL switch interval
    # the event loop (peer messages, first bytes, gossip) waits up to 5 ms behind it.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    for noisy in ("httpx", "httpcore"):  # one INFO line per gossip message otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _server(config: ServeConfig, service: Any) -> Any:
    """uvicorn serving the node's app, draining on SIGTERM."""
    import uvicorn

    from radixmesh.runtime.app import KEEP_ALIVE_S, create_app
    from radixmesh.runtime.peer_tls import uvicorn_options

    app = create_app(service)
    return _draining_server_class()(uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level="warning" if config.log_level == "info" else config.log_level,
        access_log=False,
        timeout_graceful_shutdown=3,
        timeout_keep_alive=KEEP_ALIVE_S,  # longer than clients keep an idle connection
        lifespan="on",
        **uvicorn_options(app),  # --peer-tls-*: HTTPS, client certificates for /peer/*
    ), service)
