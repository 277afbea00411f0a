"""The emulated link between a centralized gateway and its workers: a delaying TCP relay.

A mesh node pays the emulated one-way delay (``--net-delay``) on every message to a peer, each
way (``runtime/netem.py``). A gateway in front of the same nodes is one network hop from them
too, so, for the comparison to be fair, its hop must cross the same link. The benchmark starts
this relay as a process of its own between the gateway and each worker::

    client ──▶ gateway ──▶ relay ──(delay)──▶ worker        (and back, delayed again)

    python -m radixmesh.bench.linkproxy --delay 0.002 --to 127.0.0.1:8001 --to 127.0.0.1:8002

A target may carry its own one-way delays, ``--to HOST:PORT=OUT[/BACK]`` (seconds or units as
``40ms``; BACK defaults to OUT): a gateway in one region reaching workers in others
(bench/regions.py). ``--delay`` is then the default of the targets without one.

It listens on one free port of 127.0.0.1 per ``--to`` and prints ``READY port port ...`` (in
``--to`` order) once listening. Each connection is relayed byte for byte in both directions;
every chunk is released one emulated one-way delay after it arrived, in order (the runtime's
:meth:`Netem.delayed`, the one link model), so a request and its response each cross the link
once, and a streamed response keeps its pacing. A half-closed side is passed on as EOF. The
relay stops on SIGTERM or when its standard input closes (its parent is gone).

``--hold``: the link is not emulated yet: bytes pass undelayed until a line ``GO`` on standard
input, then every chunk read from then on, on every connection (pooled ones too), is delayed.
A gateway registers its workers through it before the run: SMG 1.13's registration steps
(``detect_backend``: a ``GET /v1/models``) time out after a fixed 10 s, shorter than one round
trip between regions 40 ms apart at time scale 300 (24 s). Setup is not part of the run; its
requests, and the gateway's load polls, cross the link once it is armed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import threading
from collections.abc import AsyncIterator, Sequence

from radixmesh.core.link import LinkConfig
from radixmesh.runtime.netem import Netem, parse_peer_delays

CHUNK = 65536


async def _chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while data := await reader.read(CHUNK):
        yield data


async def _then(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for chunk in rest:
        yield chunk


async def _undelayed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     armed: asyncio.Event) -> bytes:
    """Pass chunks on as they come while the link is held; the first chunk read once it is
    armed (``b""`` at EOF), which the delayed pipe takes from there."""
    while True:
        data = await reader.read(CHUNK)
        if armed.is_set() or not data:
            return data
        writer.write(data)
        await writer.drain()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Netem,
                armed: asyncio.Event | None = None) -> None:
    """One direction of a connection: every chunk delayed (once ``armed`` is set, when
    given), then EOF passed on."""
    try:
        chunks = _chunks(reader)
        if armed is not None and not armed.is_set():
            first = await _undelayed(reader, writer, armed)
            if first:  # at EOF the unstarted ``chunks`` ends at once
                chunks = _then(first, chunks)
        async for chunk in link.delayed(chunks):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


Target = tuple[str, int, tuple[float, float] | None]  # host, port, own (out, back) delays


class LinkRelay:
    """Listens for one worker; every accepted connection gets its own pair of delayed pipes."""

    def __init__(self, target: Target, config: LinkConfig, seed: int,
                 armed: asyncio.Event | None = None) -> None:
        host, port, own = target
        self.armed = armed  # None: delayed from the start
        self.target = (host, port)
        out, back = own if own is not None else (config.delay_s, config.delay_s)
        self.config = config.with_delay(out)
        self.back = config.with_delay(back)
        self._seed = seed
        self._connections = 0

    async def handle(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        self._connections += 1
        base = self._seed * 1_000_003 + 2 * self._connections
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            down_w.close()
            return
        clock = asyncio.get_running_loop().time  # asyncio's own loop (``main``): exact timers
        try:
            await asyncio.gather(
                _pipe(down_r, up_w, Netem(self.config, base, clock=clock), self.armed),
                _pipe(up_r, down_w, Netem(self.back, base + 1, clock=clock), self.armed),
            )
        finally:
            for w in (up_w, down_w):
                w.close()
                with contextlib.suppress(ConnectionError, OSError):
                    await w.wait_closed()


def parse_target(text: str) -> Target:
    """``HOST:PORT`` or ``HOST:PORT=OUT[/BACK]``."""
    address, sep, _ = text.partition("=")
    try:
        own = parse_peer_delays(text)[address] if sep else None
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT[=OUT[/BACK]], got {text!r}")
    return host, int(port), own


async def serve(targets: Sequence[Target], config: LinkConfig, hold: bool = False) -> None:
    armed = asyncio.Event() if hold else None
    servers = []
    for i, target in enumerate(targets):
        relay = LinkRelay(target, config, seed=i, armed=armed)
        servers.append(await asyncio.start_server(relay.handle, "127.0.0.1", 0))
    ports = [s.sockets[0].getsockname()[1] for s in servers]
    print("READY", *ports, flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)

    def parent_gone() -> None:  # the parent holds our stdin: EOF there means it is gone
        for line in sys.stdin.buffer:
            if line.strip() == b"GO" and armed is not None:
                loop.call_soon_threadsafe(armed.set)
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=parent_gone, daemon=True).start()
    await stop.wait()
    for s in servers:
        s.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m radixmesh.bench.linkproxy",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--delay", type=float, required=True,
                        help="emulated one-way delay, seconds")  # fmt: skip
    parser.add_argument("--to", type=parse_target, action="append", required=True,
                        help="a worker HOST:PORT[=OUT[/BACK]] (repeatable)")  # fmt: skip
    parser.add_argument("--hold", action="store_true",
                        help="pass bytes undelayed until a line GO on standard input")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.to, LinkConfig(delay_s=args.delay), hold=args.hold))
    return 0


if __name__ == "__main__":
    sys.exit(main())
