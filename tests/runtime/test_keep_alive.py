"""A node keeps an idle HTTP connection open longer than its clients do.

uvicorn closes a connection idle for ``timeout_keep_alive``; a request a client sends on it at
that instant is lost (the server's kernel answers the unread bytes with a reset: httpx raises
``ReadError`` before any header; reproduced with uvicorn 0.55 + httpx 0.29, 6 of 200 requests
sent within 4 ms of a 0.2 s keep-alive). The client's pool only avoids it when it drops idle
connections first, so the node's keep-alive must exceed the common clients' idle expiry."""

from __future__ import annotations

import inspect
from typing import Any

import aiohttp
import httpx

from radixmesh.bench import vllm_replay
from radixmesh.runtime import serve_cli
from radixmesh.runtime.app import KEEP_ALIVE_S
from radixmesh.runtime.config import ServeConfig
from radixmesh.runtime.inprocess import free_port
from radixmesh.runtime.node import NodeService

GO_IDLE_CONN_TIMEOUT_S = 90.0  # net/http DefaultTransport.IdleConnTimeout
AIOHTTP_KEEPALIVE_S = 15.0  # aiohttp TCPConnector: keepalive_timeout when not given


def test_keep_alive_exceeds_the_clients_idle_expiry() -> None:
    assert inspect.signature(aiohttp.TCPConnector).parameters["keepalive_timeout"].default \
        is not None  # aiohttp's default is a sentinel meaning AIOHTTP_KEEPALIVE_S
    httpx_expiry = httpx.Limits(max_connections=None).keepalive_expiry
    assert httpx_expiry is not None
    for client_s in (httpx_expiry, AIOHTTP_KEEPALIVE_S, GO_IDLE_CONN_TIMEOUT_S):
        assert client_s < KEEP_ALIVE_S


def test_bench_client_drops_idle_connections_before_servers_default() -> None:
    # vLLM's own server (warm-up requests go straight to it) closes idle ones at 5 s
    assert vllm_replay.CLIENT_KEEPALIVE_S < 5.0


def test_serve_gives_uvicorn_the_keep_alive(engine: Any) -> None:
    config = ServeConfig(node_id="n0", port=free_port())
    server = serve_cli._server(config, NodeService(config, engine))  # built, not started
    assert server.config.timeout_keep_alive == KEEP_ALIVE_S
