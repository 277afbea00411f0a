"""The peer stream alone: today's link and POST (aiohttp -> uvicorn, HTTP/1.1) against HTTP/2.

    pip install hypercorn==0.18.0 h2==4.4.1 websockets==17.4   # not project dependencies
    python scripts/bench-peer-stream.py [--samples 1000] [--concurrency 32]

One peer process serves a forward whose work takes no time (replies: ForwardAdmitted, then a
ForwardResult of one token), so what is measured is the transport: the entry side encodes the
request, opens a stream, reads and decodes the replies. Three transports:

* ``link``  today's default: ``PeerClient`` (aiohttp) over one ``POST /peer/link`` served by
  ``serve_link`` under uvicorn (runtime/peer_link.py: our OPEN/REPLY/END frames, chunked);
* ``post``  ``PeerClient`` with one ``POST /peer/forward`` per forward, uvicorn;
* ``h2``    one HTTP/2 stream per forward on one connection (``httpx`` with ``h2``, prior
  knowledge) to the same ASGI handler served by hypercorn (uvicorn has no HTTP/2): the
  protocol's streams, RST_STREAM and END_STREAM in place of our frames;
* ``ws``    one WebSocket (aiohttp's client; uvicorn with ``websockets``), each message a 4-byte
  stream id and a request or reply: the multiplexing stays ours, only the framing changes.

Figures: median and p99 of one forward at a time (ms), forwards per second with
``--concurrency`` in flight, and CPU per forward on each side (ms: the entry is this process,
the peer the server process). Printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from radixmesh.core.forward_codec import (
    ReplyDecoder,
    decode_forward_request,
    decode_link_open,
    encode_forward_request,
    encode_reply,
)
from radixmesh.core.messages import ForwardAdmitted, ForwardRequest, ForwardResult
from radixmesh.runtime.cluster import free_port

REQUEST = encode_forward_request(ForwardRequest(tuple(range(1, 129)), 1, heartbeat_s=5.0))


# ------------------------------------------------------------------------------ the peer
async def _replies(req: ForwardRequest) -> AsyncIterator[bytes]:
    yield encode_reply(ForwardAdmitted("peer", 0))
    yield encode_reply(ForwardResult((7,), "length", len(req.prompt), 0, 0.0, 0.0, 0.0))


async def peer_app(scope: dict[str, Any], receive: Callable[[], Awaitable[Any]],
                   send: Callable[[Any], Awaitable[None]]) -> None:
    from starlette.requests import Request

    from radixmesh.runtime.app import _stream_frames
    from radixmesh.runtime.peer_link import LinkRegistry, serve_link

    if scope["type"] == "lifespan":
        while (await receive())["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["type"] == "websocket":
        await _serve_ws(receive, send)
        return
    if scope["path"] == "/peer/link":
        global _REGISTRY
        _REGISTRY = _REGISTRY or LinkRegistry()
        await serve_link(receive, send, _REGISTRY,
                         lambda body: decode_forward_request(decode_link_open(body)[1]),
                         _replies)
        return
    request = Request(scope, receive)
    req = decode_forward_request(await request.body())
    await _stream_frames(_replies(req), request, send)


_REGISTRY: Any = None


async def _serve_ws(receive: Callable[[], Awaitable[Any]],
                    send: Callable[[Any], Awaitable[None]]) -> None:
    """Each message: stream id (4 bytes) + a request; each reply goes back with its id."""
    await receive()  # websocket.connect
    await send({"type": "websocket.accept"})
    tasks: set[asyncio.Task[None]] = set()

    async def one(sid: bytes, req: ForwardRequest) -> None:
        async for frame in _replies(req):
            await send({"type": "websocket.send", "bytes": sid + frame})

    while (msg := await receive())["type"] == "websocket.receive":
        req = decode_forward_request(msg["bytes"][4:])
        task = asyncio.ensure_future(one(msg["bytes"][:4], req))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


def serve(kind: str, port: int) -> None:
    if kind == "h2":
        from hypercorn.asyncio import serve as hserve
        from hypercorn.config import Config

        config = Config()
        config.bind, config.loglevel = [f"127.0.0.1:{port}"], "WARNING"
        config.keep_alive_max_requests = 1 << 30  # (default 1,000 streams per connection)
        asyncio.run(hserve(peer_app, config))  # type: ignore[arg-type]
    else:
        import uvicorn

        uvicorn.run(peer_app, host="127.0.0.1", port=port, log_level="warning",
                    http="httptools", loop="asyncio", ws="websockets")


# ----------------------------------------------------------------------------- the entry
Forward = Callable[[], Awaitable[None]]


async def _drain(chunks: AsyncIterator[bytes]) -> None:
    decoder, replies = ReplyDecoder(), []
    async for chunk in chunks:
        replies.extend(decoder.feed(chunk))
    assert isinstance(replies[-1], ForwardResult), replies


def peer_client_forward(address: str, links: bool) -> tuple[Forward, Callable[[], Any]]:
    from radixmesh.runtime.netem import Netem, NetemConfig
    from radixmesh.runtime.peer_client import PeerClient

    client = PeerClient("entry", "127.0.0.1:1", Netem(NetemConfig()), 5.0, 5.0, use_links=links)

    async def one() -> None:
        stream = await client.open_forward(address, "peer", REQUEST)
        try:
            while not isinstance(await stream.next_reply(), ForwardResult):
                pass
        finally:
            await stream.aclose()

    return one, client.aclose


def h2_forward(address: str) -> tuple[Forward, Callable[[], Any]]:
    import httpx

    client = httpx.AsyncClient(http1=False, http2=True, timeout=5.0, trust_env=False,
                               limits=httpx.Limits(max_connections=1))

    async def one() -> None:
        async with client.stream("POST", f"http://{address}/peer/forward",
                                 content=REQUEST) as response:
            assert response.http_version == "HTTP/2", response.http_version
            await _drain(response.aiter_raw())

    return one, client.aclose


def ws_forward(address: str) -> tuple[Forward, Callable[[], Any]]:
    import aiohttp

    state: dict[str, Any] = {"ids": itertools.count(1), "waiting": {}}

    async def reader(ws: Any) -> None:
        async for msg in ws:
            decoder = state["waiting"][int.from_bytes(msg.data[:4], "big")]
            decoder[1].extend(decoder[0].feed(msg.data[4:]))
            if isinstance(decoder[1][-1], ForwardResult):
                decoder[2].set()

    async def one() -> None:
        if "ws" not in state:
            state["session"] = aiohttp.ClientSession()
            state["ws"] = await state["session"].ws_connect(f"http://{address}/peer/ws")
            state["reader"] = asyncio.ensure_future(reader(state["ws"]))
        sid = next(state["ids"])
        entry = state["waiting"][sid] = (ReplyDecoder(), [], asyncio.Event())
        await state["ws"].send_bytes(sid.to_bytes(4, "big") + REQUEST)
        await entry[2].wait()
        del state["waiting"][sid]

    async def close() -> None:
        await state["ws"].close()
        state["reader"].cancel()
        await state["session"].close()

    return one, close


async def measure(kind: str, address: str, samples: int, concurrency: int,
                  server_cpu: Callable[[], float]) -> dict[str, float]:
    one, close = (h2_forward(address) if kind == "h2" else ws_forward(address) if kind == "ws"
                  else peer_client_forward(address, links=kind == "link"))
    for _ in range(50):
        await one()
    latencies = []
    for _ in range(samples):
        t0 = time.perf_counter()
        await one()
        latencies.append(time.perf_counter() - t0)
    rounds = max(1, samples // concurrency)
    cpu0, srv0, t0 = time.process_time(), server_cpu(), time.perf_counter()
    for _ in range(rounds):
        await asyncio.gather(*(one() for _ in range(concurrency)))
    wall, n = time.perf_counter() - t0, rounds * concurrency
    cpu, srv = time.process_time() - cpu0, server_cpu() - srv0
    await close()
    latencies.sort()
    return {"median_ms": round(1e3 * statistics.median(latencies), 3),
            "p99_ms": round(1e3 * latencies[int(0.99 * len(latencies))], 3),
            "concurrent_per_s": round(n / wall), "entry_cpu_ms": round(1e3 * cpu / n, 3),
            "peer_cpu_ms": round(1e3 * srv / n, 3)}


def _proc_cpu(pid: int) -> Callable[[], float]:
    def cpu() -> float:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return cpu


def run(kind: str, samples: int, concurrency: int) -> dict[str, float]:
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port", str(port)])
    try:
        import httpx

        for _ in range(200):  # up to 10 s for the server to listen
            try:
                httpx.post(f"http://127.0.0.1:{port}/peer/forward", content=REQUEST, timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.05)  # a start-up wait of a child process, not a test
        return asyncio.run(measure(kind, f"127.0.0.1:{port}", samples, concurrency,
                                   _proc_cpu(server.pid)))
    finally:
        server.terminate()
        server.wait(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--only", default="link,post,h2,ws")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return 0
    out = {kind: run(kind, args.samples, args.concurrency) for kind in args.only.split(",")}
    out["load_average_1m"] = round(os.getloadavg()[0], 2)  # type: ignore[assignment]
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
