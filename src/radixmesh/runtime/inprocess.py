"""A node served inside this process: uvicorn serving ``create_app`` on 127.0.0.1.

For tests that need real HTTP (client disconnects, streaming, TLS, the official SDK) but not a
separate process: ``async with serving(service, port) as address: ...`` starts the server,
waits (bounded) until it listens, and always stops it. ``app_options``: a function of the app
returning more uvicorn options (e.g. ``peer_tls.uvicorn_options``). For synchronous callers
(a blocking SDK client, a module-scoped fixture), :class:`ServedInThread` runs the same on an
event loop of its own thread. ``serving_node(engine, name, **config)`` builds the node too, on
a free port, with what tests want by default (gossip every 5 s: nothing gossips unless a test
asks; forward timeout 2 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

from radixmesh.runtime.cluster import free_port as free_port  # the one implementation

START_POLLS = 200  # x 50 ms: a server that does not listen within 10 s fails the test
STOP_WAIT_S = 10.0


@contextlib.asynccontextmanager
async def serving(service: Any, port: int, **uvicorn_options: Any) -> AsyncIterator[str]:
    """Serve ``service`` (a ``NodeService`` configured for ``port``); yields ``host:port``."""
    import uvicorn

    from radixmesh.runtime.app import KEEP_ALIVE_S, create_app, node_server

    app = create_app(service)
    options = {"log_level": "warning", "lifespan": "on", "timeout_keep_alive": KEEP_ALIVE_S,
               **uvicorn_options}
    if callable(options.get("app_options")):
        options.update(options.pop("app_options")(app))
    server = node_server(uvicorn.Config(app, host="127.0.0.1", port=port, **options), service)
    task = asyncio.create_task(server.serve())
    for _ in range(START_POLLS):
        if server.started or task.done():
            break
        await asyncio.sleep(0.05)
    if not server.started:
        raise RuntimeError(f"the node on port {port} did not start")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.should_exit = True
        async with asyncio.timeout(STOP_WAIT_S):
            await task


@contextlib.asynccontextmanager
async def serving_node(engine: Any, name: str, **config: Any) -> AsyncIterator[tuple[Any, str]]:
    """A ``NodeService`` named ``name`` for ``engine`` on a free port, served; yields it and
    its ``host:port``. ``config``: ``ServeConfig`` fields over the test defaults."""
    from radixmesh.runtime.config import ServeConfig
    from radixmesh.runtime.node import NodeService

    port = free_port()
    cfg = ServeConfig(**{"node_id": name, "port": port, "gossip_interval": 5.0,
                         "forward_timeout": 2.0, **config})
    service = NodeService(cfg, engine)
    async with serving(service, port) as address:
        yield service, address


class ServedInThread:
    """``serving(service, port)`` on an event loop in a daemon thread, until ``close()``."""

    def __init__(self, service: Any, port: int, start_timeout_s: float = 60.0) -> None:
        self.service, self.port = service, port
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(start_timeout_s):
            raise RuntimeError("the node did not start")

    def _run(self) -> None:
        async def main() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            async with serving(self.service, self.port):
                self._ready.set()
                await self._stop.wait()

        asyncio.run(main())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

