"""The bench's own subscriber to real vLLM's KV-event publishers, and the golden fixtures it
saves from them.

Theory of operation
-------------------
``Capture`` subscribes to each engine's PUB socket in a thread and keeps every message with its
arrival time (the mismatch classifier replays them); ``replay`` asks a replay ROUTER for its
buffered batches once. ``pick_fixture_frames`` / ``save_fixtures`` keep a run of consecutive
live batches (up to one with a removal) and a replay answer as the decoder tests' fixtures;
``save_run_fixture`` keeps a concurrent run's batches and requests with their verdicts as the
classifier's fixture.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from radixmesh.bench.vllm_replay import Agreement


class Capture:
    """Subscribes to the engines' publishers itself and keeps their raw frames (fixtures)."""

    def __init__(self, endpoints: Sequence[str]) -> None:
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        # per publisher: (arrival on the perf_counter clock, [topic, seq, payload])
        self.timed: list[list[tuple[float, list[bytes]]]] = [[] for _ in endpoints]
        self._stop = threading.Event()
        self._socks = []
        for ep in endpoints:
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.setsockopt(zmq.RCVTIMEO, 200)
            sock.connect(ep)
            self._socks.append(sock)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = self._zmq.Poller()
        for s in self._socks:
            poller.register(s, self._zmq.POLLIN)
        which = {id(s): i for i, s in enumerate(self._socks)}
        while not self._stop.is_set():
            for sock, _ in poller.poll(200):
                frames = list(sock.recv_multipart())
                self.timed[which[id(sock)]].append((time.perf_counter(), frames))

    @property
    def frames(self) -> list[list[bytes]]:
        """The first publisher's messages, in arrival order (the fixtures' source)."""
        return [f for _, f in self.timed[0]]

    def replay(self, endpoint: str, start_seq: int = 0) -> list[list[bytes]]:
        """One replay answer (DEALER): every buffered batch from ``start_seq``, end marker."""
        sock = self._ctx.socket(self._zmq.DEALER)
        sock.setsockopt(self._zmq.RCVTIMEO, 3000)
        sock.connect(endpoint)
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out: list[list[bytes]] = []
        try:
            while True:
                msg = list(sock.recv_multipart())
                out.append(msg)
                if len(msg) >= 2 and msg[-2] == (-1).to_bytes(8, "big", signed=True):
                    break
        finally:
            sock.close(0)
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        for s in self._socks:
            s.close(0)
        self._ctx.term()


def pick_fixture_frames(frames: Sequence[list[bytes]], max_bytes: int = 256 * 1024
                        ) -> list[list[bytes]]:
    """Live messages of one publisher, in order, from the first one until a batch with a
    removal has been taken (at least 3), within ``max_bytes``: a run of consecutive seqs a
    test can apply to an index as a node would."""
    import msgpack

    def kinds(payload: bytes) -> set[str]:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        return {str(e.get("type") if isinstance(e, dict) else e[0]) for e in batch[1]}

    chosen: list[list[bytes]] = []
    size = 0
    wanted = {"BlockRemoved", "AllBlocksCleared"}
    for f in frames:
        if size + len(f[2]) > max_bytes and chosen:
            break
        chosen.append(f)
        size += len(f[2])
        wanted -= kinds(f[2])
        if "BlockRemoved" not in wanted and len(chosen) >= 3:
            break
    return chosen


def save_run_fixture(path: Path, timed: Sequence[tuple[float, list[bytes]]],
                     agreement: Agreement, block_size: int, engine_block_size: int,
                     max_bytes: int = 384 * 1024) -> int:
    """Engine 0's batches from the start of a concurrent run up to its first requests that
    include 3 classified mismatches (at most 24 requests, ``max_bytes`` of batches), with
    those requests and their verdicts (a match re-judged with the replay: it must agree with
    its stream too): the classifier's test fixture at ``path``."""
    import msgpack

    picked: list[dict[str, Any]] = []
    for (idx, s), kind in zip(agreement.seen, agreement.verdicts, strict=True):
        if idx != 0:
            continue
        picked.append({"id": s.id, "prompt": list(s.prompt), "predicted": s.predicted,
                       "actual": s.actual, "t_sent": s.t_sent, "t_headers": s.t_headers,
                       "t_first": s.t_first, "class": kind})
        if sum(p["class"] != "match" for p in picked) >= 3 or len(picked) >= 24:
            break
    end = max((p["t_first"] for p in picked), default=0.0) + 1.0
    frames: list[list[Any]] = []
    size, cut = 0, False
    for t, f in timed:
        if t > end:
            break
        if size > max_bytes:
            cut = True
            break
        frames.append([t, list(f)])
        size += len(f[-1])
    if cut:  # keep the requests whose whole window the kept batches cover
        picked = [p for p in picked if p["t_first"] + 1.0 <= frames[-1][0]]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgpack.packb(
        {"frames": frames, "requests": picked, "block_size": block_size,
         "engine_block_size": engine_block_size}))
    return len(picked)


def save_whole_run(path: Path, timed: Sequence[Sequence[tuple[float, list[bytes]]]],
                   agreement: Agreement, block_size: int, engine_block_size: int) -> int:
    """Every engine's batches of a run (``engines_frames``) and every request with its
    ``engine``: what ``bench/evict_check.py`` replays (``--capture-whole``; megabytes, so
    not a CI fixture)."""
    import msgpack

    picked = [{"engine": idx, "id": s.id, "prompt": list(s.prompt), "predicted": s.predicted,
               "actual": s.actual, "t_sent": s.t_sent, "t_headers": s.t_headers,
               "t_first": s.t_first, "class": kind}
              for (idx, s), kind in zip(agreement.seen, agreement.verdicts, strict=True)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgpack.packb(
        {"engines_frames": [[[t, list(f)] for t, f in frames] for frames in timed],
         "requests": picked, "block_size": block_size, "engine_block_size": engine_block_size}))
    return len(picked)


def save_fixtures(directory: Path, live: Sequence[list[bytes]],
                  replay: Sequence[list[bytes]], meta: dict[str, Any]) -> None:
    import msgpack

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "live.msgpack").write_bytes(msgpack.packb([list(f) for f in live]))
    (directory / "replay.msgpack").write_bytes(msgpack.packb([list(f) for f in replay]))
    (directory / "README.md").write_text(
        "Raw ZMQ messages captured from a real vLLM by `make vllm-check` "
        "(`radixmesh.bench.vllm_check --capture`).\n\n"
        "- `live.msgpack`: a msgpack array of PUB messages, each `[topic, seq, payload]` "
        "(bytes, as received).\n"
        "- `replay.msgpack`: one replay answer to `[b\"\", seq 0]` as a DEALER received it, "
        "each `[b\"\", topic, seq, payload]`, the last the end marker.\n\n"
        f"```json\n{json.dumps(meta, indent=2)}\n```\n", encoding="utf-8")
