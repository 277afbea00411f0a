"""A fault-injecting ZMQ proxy between an engine's KV-event publisher and a node.

Theory of operation
-------------------
::

    engine PUB (binds tcp://*:P) ── SUB ── KvProxy ── PUB (binds tcp://*:Q) ── node's SUB

The node's ``--kv-events`` names the proxy (``tcp://*:Q``: the node connects), its
``--kv-replay`` the engine's own replay socket, so a gap is filled from the engine as it would
be without the proxy. One thread moves the messages; per live message the fault plan
(:func:`choose`, a seeded ``random.Random`` and the :class:`ProxyFaults` probabilities) picks one
action::

    pass       forwarded as is
    drop       never forwarded: a seq gap the node can only see at its next message
    duplicate  forwarded twice, back to back (a byte-identical repeat)
    reorder    held back and forwarded after the next message (or after ``hold_s`` alone)
    stale      forwarded now and again ``stale_after`` messages later (a delayed duplicate,
               older than the node's next seq: it must not read it as an engine restart)

Commands from other threads: ``set_faults``, ``burst(n)`` (drop the next ``n`` messages: a gap
beyond the engine's replay buffer when ``n`` exceeds its ``buffer_steps``) and
``restart(pause_s)`` (close the PUB socket, drop what arrives during the pause, bind again: the
node's SUB reconnects by itself). Every action is logged with the message's seq and the
``time.monotonic`` instant, and ``received`` / ``forwarded`` keep the highest seq each way over
time: a run can then tell a prediction made while the node could not yet know of a loss (the
engine's newest batch not forwarded) from an index error.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq

ACTIONS = ("pass", "drop", "duplicate", "reorder", "stale")
POLL_MS = 20
SUBSCRIBE_GRACE_S = 0.1  # after a subscriber's handshake, for its subscription to arrive


@dataclass(frozen=True, slots=True)
class ProxyFaults:
    """Per-message probabilities of each fault (the rest pass)."""

    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    stale: float = 0.0
    stale_after: int = 3  # a stale copy goes out after this many further messages
    hold_s: float = 0.5  # a reordered message alone goes out after this long

    def __post_init__(self) -> None:
        probs = (self.drop, self.duplicate, self.reorder, self.stale)
        if any(not 0.0 <= p <= 1.0 for p in probs) or sum(probs) > 1.0:
            raise ValueError(f"fault probabilities must be in [0, 1] and sum to <= 1: {probs}")
        if self.stale_after < 1 or self.hold_s <= 0:
            raise ValueError("stale_after must be >= 1 and hold_s positive")


def choose(rng: random.Random, faults: ProxyFaults) -> str:
    """The action for one message (pure but for ``rng``)."""
    x = rng.random()
    for name, p in (("drop", faults.drop), ("duplicate", faults.duplicate),
                    ("reorder", faults.reorder), ("stale", faults.stale)):
        if x < p:
            return name
        x -= p
    return "pass"


def seq_of(frames: Sequence[bytes]) -> int:
    """The seq of a ``[topic, seq, payload]`` message (-1 if it has none)."""
    return int.from_bytes(frames[1], "big") if len(frames) == 3 else -1


@dataclass(slots=True)
class ProxyLog:
    """What the proxy did, for the run's classification."""

    actions: list[tuple[float, int, str]] = field(default_factory=list)  # (t, seq, action)
    received: list[tuple[float, int]] = field(default_factory=list)  # (t, seq) from the engine
    forwarded: list[tuple[float, int]] = field(default_factory=list)  # (t, seq) to the node

    def counts(self, since: float = 0.0) -> dict[str, int]:
        out = dict.fromkeys((*ACTIONS, "burst", "restart_drop"), 0)
        for t, _, a in self.actions:
            if t >= since:
                out[a] = out.get(a, 0) + 1
        return out

    def hidden_at(self, t: float) -> bool:
        """At instant ``t``, had the engine published a batch newer than any forwarded (a loss
        or hold the node could not yet see)?"""
        high_in = max((s for u, s in self.received if u <= t), default=-1)
        high_out = max((s for u, s in self.forwarded if u <= t), default=-1)
        return high_in > high_out


class KvProxy:
    """The proxy thread: ``start`` / ``close``; faults set while it runs."""

    def __init__(self, upstream: str, port: int, seed: int = 0) -> None:
        self.upstream, self.port = upstream, port
        self.log = ProxyLog()
        self._rng = random.Random(seed)
        self._faults = ProxyFaults()
        self._commands: queue.Queue[tuple[str, ProxyFaults | float]] = queue.Queue()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-proxy")
        self._burst = 0
        self._held: tuple[float, list[bytes]] | None = None
        self._stale: list[tuple[int, list[bytes]]] = []  # (messages left, frames)

    # ------------------------------------------------------------------------- control
    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._ctx.term()

    def set_faults(self, faults: ProxyFaults) -> None:
        self._commands.put(("faults", faults))

    def burst(self, n: int) -> None:
        self._commands.put(("burst", float(n)))

    def restart(self, pause_s: float) -> None:
        self._commands.put(("restart", pause_s))

    # ------------------------------------------------------------------------- thread
    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.upstream)
        pub = self._bind()
        try:
            while not self._stop.is_set():
                pub = self._command(sub, pub)
                if sub.poll(POLL_MS):
                    self._on_message(pub, list(sub.recv_multipart()))
                elif self._held is not None and time.monotonic() - self._held[0] > \
                        self._faults.hold_s:
                    held, self._held = self._held[1], None
                    self._send(pub, held, "late")
        finally:
            sub.close(0)
            pub.close(0)

    def _bind(self, sub: zmq.Socket[bytes] | None = None) -> zmq.Socket[bytes]:
        """The PUB socket; with ``sub``, what the engine publishes is dropped until a
        subscriber has connected (a message sent before would be lost without a trace)."""
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        mon = pub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED) if sub else None
        pub.bind(f"tcp://127.0.0.1:{self.port}")
        if sub is not None and mon is not None:
            self._drain(sub, time.monotonic() + 30.0, mon)
            pub.disable_monitor()
            mon.close(0)
            self._drain(sub, time.monotonic() + SUBSCRIBE_GRACE_S, None)  # its subscription
        return pub

    def _command(self, sub: zmq.Socket[bytes], pub: zmq.Socket[bytes]) -> zmq.Socket[bytes]:
        try:
            kind, value = self._commands.get_nowait()
        except queue.Empty:
            return pub
        if isinstance(value, ProxyFaults):
            self._faults = value
        elif kind == "burst":
            self._burst = int(value)
        elif kind == "restart":
            pub.close(0)
            self._drain(sub, time.monotonic() + value, None)  # the engine goes on publishing
            pub = self._bind(sub)
        return pub

    def _drain(self, sub: zmq.Socket[bytes], end: float, mon: zmq.Socket[bytes] | None) -> None:
        """Drop what the engine publishes until ``end`` or, with ``mon``, a subscriber's
        handshake (a message sent before it would be lost without a trace)."""
        while time.monotonic() < end:
            if mon is not None and mon.poll(0):
                return
            if sub.poll(POLL_MS):
                frames = list(sub.recv_multipart())
                self._note_in(frames)
                self.log.actions.append((time.monotonic(), seq_of(frames), "restart_drop"))

    def _note_in(self, frames: Sequence[bytes]) -> None:
        self.log.received.append((time.monotonic(), seq_of(frames)))

    def _on_message(self, pub: zmq.Socket[bytes], frames: list[bytes]) -> None:
        self._note_in(frames)
        if self._burst > 0:
            self._burst -= 1
            self.log.actions.append((time.monotonic(), seq_of(frames), "burst"))
            return
        action = choose(self._rng, self._faults)
        if action == "reorder" and self._held is None:
            self.log.actions.append((time.monotonic(), seq_of(frames), action))
            self._held = (time.monotonic(), frames)
            return
        action = "pass" if action == "reorder" else action
        if action == "drop":
            self.log.actions.append((time.monotonic(), seq_of(frames), action))
            return
        self._send(pub, frames, action)
        if action == "duplicate":
            self._send(pub, frames, "copy")
        if action == "stale":
            self._stale.append((self._faults.stale_after, frames))
        if self._held is not None:
            held, self._held = self._held[1], None
            self._send(pub, held, "late")
        self._due_stale(pub)

    def _due_stale(self, pub: zmq.Socket[bytes]) -> None:
        counted = [(n - 1, frames) for n, frames in self._stale]
        self._stale = [(n, frames) for n, frames in counted if n > 0]
        for _, frames in [(n, frames) for n, frames in counted if n <= 0]:
            self._send(pub, frames, "stale_copy")

    def _send(self, pub: zmq.Socket[bytes], frames: list[bytes], action: str) -> None:
        pub.send_multipart(frames)
        now = time.monotonic()
        if action != "pass":
            self.log.actions.append((now, seq_of(frames), action))
        self.log.forwarded.append((now, seq_of(frames)))
