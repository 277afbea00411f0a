"""vLLM-format KV events of the emulated engine: a ZMQ PUB stream and a ROUTER replay socket.

Theory of operation
-------------------
The engine loop hands this publisher its scheduler's cache journal after each change
(``publish_delta(added, removed, sequences)``: block hashes, plus the token sequences that may
hold the added blocks). It becomes one event batch, as vLLM 0.32 publishes them
(``vllm/distributed/kv_events.py``): frames ``[topic, seq (8-byte big-endian), payload]``, the
payload a msgpack batch ``[ts, events, data_parallel_rank]`` whose events are maps
``BlockRemoved {block_hashes, medium}`` first, then multi-block ``BlockStored {block_hashes,
parent_block_hash, token_ids, block_size, medium}`` (one per run of consecutive new blocks of a
sequence), or ``AllBlocksCleared``. The publisher binds (the subscriber connects) or, given
``connect``, connects (the subscriber binds). The shape is the one a real vLLM 0.32 sent
(``tests/fixtures/vllm_0_32/live.msgpack``): the batch an array ``[ts, events, 0]``, the topic
empty, every event with ``group_idx`` 0, ``BlockStored`` with ``lora_id`` / ``lora_name`` nil,
one nil ``extra_keys`` entry per block and ``kv_cache_spec_kind: "full_attention"``.
A request with a ``cache_salt`` is cached behind its salt's virtual block
(``core/blocks.namespace_block``); as vLLM, whose first block of a salted request carries the
salt among its extra keys (``generate_block_hash_extra_keys`` in
vllm/v1/core/kv_cache_utils.py), that block is published with ``parent_block_hash`` nil and
``extra_keys[0] = [salt]``, and the virtual block itself never.

The ROUTER replay socket keeps the last ``replay_keep`` batches. A request ``[identity, b"",
start seq (8 bytes)]`` is answered with every kept batch from ``start`` in vLLM 0.32's
framing ``[identity, b"", topic, seq, payload]`` (``faults.replay_topic = False``: the older
``[identity, b"", seq, payload]``), then the end marker (seq ``-1``, empty payload).

``blocks`` maps every hash ever stored to (parent hash, its tokens), so ``block_prefixes``
can spell out the full token prefix of every block the cache holds — the ground truth tests
compare an index rebuilt from the events with. Engine hashes use the engine's own seed; they
are never mesh keys.

Fault knobs (``Faults``, shared with the HTTP side): ``skip_live`` batches not published live
(kept for replay unless ``skip_replay``), ``duplicate_next`` batches sent twice,
``replay_enabled``, ``replay_topic``; ``publish_malformed()`` sends a batch that is not one,
``reset()`` starts a new incarnation (seq from 0, nothing replayable, no event).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from radixmesh.core.blocks import NAMESPACE_TOKEN_BASE, block_hashes

TOPIC = b""  # vLLM's default KVEventsConfig.topic (what 0.32 sends, tests/fixtures/vllm_0_32)
MEDIUM = "GPU"


@dataclass(slots=True)
class Faults:
    """Fault-injection knobs of the emulated engine (tests and chaos runs set them)."""

    skip_live: int = 0          # the next N batches are not published live
    skip_replay: bool = False   # ... nor kept for replay (lost for good)
    duplicate_next: int = 0     # the next N batches are sent twice
    replay_enabled: bool = True  # False: the replay socket never answers
    replay_topic: bool = True   # vLLM 0.32 replay framing [topic, seq, payload]; False: older
    fail_status: int | None = None  # every generation request answers this HTTP status
    report_cached: bool = True  # usage carries prompt_tokens_details.cached_tokens
    token_delay_s: float = 0.0  # extra seconds added to every engine step
    barrier: int = 0  # hold the engine until this many requests are in flight (once, <= 5 s)
    stalled: bool = False  # SIGSTOP'd: no step runs and /health does not answer until False


def bind_endpoint(sock: Any, endpoint: str) -> str:
    """Bind ``sock`` to ``endpoint`` (port 0: any free port); the endpoint as a peer names it
    (``tcp://*:PORT`` when bound to all interfaces or loopback, so the subscriber resolves
    the engine's host)."""
    head, _, port = endpoint.rpartition(":")
    if not head.startswith("tcp://") or not port.isdigit():
        sock.bind(endpoint)
        return endpoint
    if int(port) == 0:
        host = head[len("tcp://"):]
        bound = int(sock.bind_to_random_port(f"tcp://{host}"))
    else:
        sock.bind(endpoint)
        bound = int(port)
    return f"tcp://*:{bound}"


class KvEventPublisher:
    """See the module docstring. ``open()`` binds / connects; ``serve_replay()`` is a task."""

    def __init__(self, *, block_size: int, seed: int, faults: Faults,
                 replay_keep: int = 64) -> None:
        self.block_size = block_size
        self.seed = seed
        self.faults = faults
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # hash -> parent, toks
        self._replay: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=replay_keep)
        self._pub: Any = None
        self._router: Any = None
        self.seq = 0  # the next batch's sequence number
        self.published = 0
        self.unresolved = 0  # added hashes no candidate sequence spelled (never expected)
        # a namespace's virtual block -> its (salt, LoRA adapter)
        self._salts: dict[tuple[int, ...], tuple[str | None, str | None]] = {}
        self.kv_endpoint = self.replay_endpoint = ""

    def open(self, ctx: zmq.asyncio.Context, publish: str, replay: str, *,
             connect: bool = False) -> None:
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        if connect:
            self._pub.connect(publish)
            self.kv_endpoint = publish
        else:
            self.kv_endpoint = bind_endpoint(self._pub, publish)
        self._router = ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self.replay_endpoint = bind_endpoint(self._router, replay)

    def close(self) -> None:
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(0)

    # ------------------------------------------------------------------------- faults
    def reset(self) -> None:
        """A new engine incarnation: seq from 0, nothing replayable, no event."""
        self.blocks.clear()
        self._replay.clear()
        self.seq = 0

    def publish_malformed(self) -> None:
        """One batch (next seq) whose payload is not a valid event batch."""
        self._send(msgpack.packb({"ts": "not a number", "events": 7}))

    def publish_cleared(self) -> None:
        self._publish([{"type": "AllBlocksCleared"}])

    # ------------------------------------------------------------------------- the truth
    def block_prefixes(self, cached: Iterable[int]) -> list[tuple[int, ...]]:
        """The full token prefix ending at each of the ``cached`` block hashes."""
        out = []
        for h in cached:
            chain: list[tuple[int, ...]] = []
            key: int | None = h
            while key is not None:
                parent, tokens = self.blocks[key]
                chain.append(tokens)
                key = parent
            out.append(tuple(t for toks in reversed(chain) for t in toks))
        return out

    # ------------------------------------------------------------------------- events
    def note_salt(self, salt: str | None, head: tuple[int, ...], lora: str | None = None
                  ) -> None:
        """``head`` is the virtual block of ``salt`` and ``lora`` (bounded: forgotten past
        65,536 of them)."""
        if len(self._salts) >= 65_536:
            self._salts.clear()
        self._salts[head] = (salt, lora)

    def publish_delta(self, added: Collection[int], removed: Collection[int],
                      sequences: Iterable[Sequence[int]]) -> None:
        """One batch: ``removed`` blocks, then ``added`` ones spelled from ``sequences``."""
        events: list[dict[str, Any]] = []
        if removed:
            events.append({"type": "BlockRemoved", "block_hashes": list(removed),
                           "medium": MEDIUM, "group_idx": 0})
        if added:
            events += self._stored_events(set(added), sequences)
        if events:
            self._publish(events)

    def _stored_events(self, added: set[int], sequences: Iterable[Sequence[int]]
                       ) -> list[dict[str, Any]]:
        """Multi-block BlockStored events: one per run of consecutive new blocks of a
        sequence, parents before children."""
        bs = self.block_size
        events: list[dict[str, Any]] = []
        left = set(added)
        for seq in sequences:
            if not left:
                break
            hashes = block_hashes(seq, bs, self.seed)
            keys = (self._salts.get(tuple(seq[:bs])) if seq and seq[0] >= NAMESPACE_TOKEN_BASE
                    else None)
            salt, lora = keys or (None, None)
            first = 0 if keys is None else 1  # a virtual block is never published
            run: dict[str, Any] | None = None
            for i, h in enumerate(hashes[first:], first):
                if h not in left:
                    run = None
                    continue
                left.discard(h)
                parent = hashes[i - 1] if i > first else None
                tokens = list(seq[i * bs:(i + 1) * bs])
                self.blocks[h] = (parent, tuple(tokens))
                extra = [*([lora] if lora else []), *([salt] if salt and i == first else [])]
                if run is not None:
                    run["block_hashes"].append(h)
                    run["token_ids"].extend(tokens)
                    run["extra_keys"].append(extra or None)
                    continue
                run = {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent,
                       "token_ids": tokens, "block_size": bs, "lora_id": None,
                       "medium": MEDIUM, "lora_name": lora, "extra_keys": [extra or None],
                       "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
                events.append(run)
        self.unresolved += len(left)
        return events

    def _publish(self, events: list[dict[str, Any]]) -> None:
        self._send(msgpack.packb([time.time(), events, 0]))

    def _send(self, payload: bytes) -> None:
        seq, self.seq = self.seq, self.seq + 1
        frames = [TOPIC, seq.to_bytes(8, "big"), payload]
        f = self.faults
        if f.skip_live > 0:
            f.skip_live -= 1
            if not f.skip_replay:
                self._replay.append((seq, payload))
            return
        self._replay.append((seq, payload))
        copies = 2 if f.duplicate_next > 0 else 1
        f.duplicate_next = max(f.duplicate_next - 1, 0)
        for _ in range(copies):
            self._pub.send_multipart(frames, flags=zmq.NOBLOCK)
        self.published += 1

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled."""
        while True:
            frames = await self._router.recv_multipart()
            if not self.faults.replay_enabled or len(frames) != 3:
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            topic = [TOPIC] if self.faults.replay_topic else []
            for seq, payload in list(self._replay):
                if seq >= start:
                    await self._router.send_multipart([ident, b"", *topic,
                                                       seq.to_bytes(8, "big"), payload])
            end = (-1).to_bytes(8, "big", signed=True)
            # vLLM 0.32's end marker: [b"", b"", -1, b""] (an empty topic); older: [b"", -1, b""]
            await self._router.send_multipart([ident, b"", *([b""] if topic else []), end, b""])


async def cancel(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and wait for it to end."""
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
