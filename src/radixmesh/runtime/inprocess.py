"""A node served inside this process: uvicorn serving ``create_app`` on 127.0.0.1.

For tests that need real HTTP (client disconnects, streaming, TLS, the official SDK) but not a
separate process: ``async with serving(service, port) as address: ...`` starts the server,
waits (bounded) until it listens, and always stops it. ``app_options``: a function of the app
returning more uvicorn options (e.g. ``peer_tls.uvicorn_options``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

START_POLLS = 200  # x 50 ms: a server that does not listen within 10 s fails the test
STOP_WAIT_S = 10.0


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def serving(service: Any, port: int, **uvicorn_options: Any) -> AsyncIterator[str]:
    """Serve ``service`` (a ``NodeService`` configured for ``port``); yields ``host:port``."""
    import uvicorn

    from radixmesh.runtime.app import create_app

    app = create_app(service)
    options = {"log_level": "warning", "lifespan": "on", **uvicorn_options}
    if callable(options.get("app_options")):
        options.update(options.pop("app_options")(app))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, **options))
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
        await asyncio.wait_for(task, STOP_WAIT_S)
