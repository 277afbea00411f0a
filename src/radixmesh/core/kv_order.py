"""KV-cache events of external engines: their frames on the ZMQ sockets, and their order.

Theory of operation
-------------------
An engine publishes one message of three frames per scheduler step on its PUB socket:
``[topic, seq, payload]`` (:func:`decode_live_frames`). ``seq`` is an 8-byte big-endian
counter that restarts at 0 with the engine; ``payload`` is a batch of events, decoded by
:func:`radixmesh.core.kv_events.decode_batch`. Every frame is hostile input: a frame of the
wrong type or length raises :class:`~radixmesh.core.codec.RemoteProtocolError` (``frames``).

Order: missed batches can be re-read from the engine's replay ROUTER socket (request
``[b"", start_seq]``, :func:`encode_replay_request`; answers of ``[seq, payload]`` (older vLLM)
or ``[topic, seq, payload]``, then an end marker with seq -1), which holds only the last few
batches and no snapshot. :class:`SequenceTracker` is the pure state machine over one
publisher's seq numbers: fed live and replayed batches, it returns steps for the shell to carry
out in order — apply a batch, drop a duplicate, request a replay from the first missing seq, or
reset (drop the index: the engine restarted, seq went backwards, or the replay could not cover
the gap). Live batches that arrive while a replay is outstanding are held (bounded) and applied
after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from radixmesh.core.checked import RemoteProtocolError

_SEQ_BYTES = 8
_END_SEQ = -1
_T = TypeVar("_T")


# ------------------------------------------------------------------------------------ frames
@dataclass(frozen=True, slots=True)
class LiveMessage:
    """One message of the PUB stream."""

    topic: bytes
    seq: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class ReplayMessage:
    """One replayed batch."""

    seq: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class ReplayEnd:
    """The replay socket's end marker: everything it still had has been sent."""


def _frame(v: Any, what: str) -> bytes:
    if not isinstance(v, bytes | bytearray | memoryview):
        raise RemoteProtocolError(f"{what} frame is not bytes", "frames")
    return bytes(v)


def _seq(v: Any) -> int:
    raw = _frame(v, "seq")
    if len(raw) != _SEQ_BYTES:
        raise RemoteProtocolError(f"seq frame of {len(raw)} bytes, expected 8", "frames")
    return int.from_bytes(raw, "big", signed=True)


def decode_live_frames(frames: Sequence[Any]) -> LiveMessage:
    """``[topic, seq, payload]`` of the PUB stream."""
    if len(frames) != 3:
        raise RemoteProtocolError(f"live message of {len(frames)} frames, expected 3", "frames")
    seq = _seq(frames[1])
    if seq < 0:
        raise RemoteProtocolError("negative seq on the live stream", "frames")
    return LiveMessage(_frame(frames[0], "topic"), seq, _frame(frames[2], "payload"))


def decode_replay_frames(frames: Sequence[Any]) -> ReplayMessage | ReplayEnd:
    """A replay answer: ``[seq, payload]`` or ``[topic, seq, payload]``, either after an
    optional empty delimiter frame; seq -1 is the end marker."""
    parts = list(frames)
    if len(parts) == 4 and _frame(parts[0], "delimiter") == b"":
        parts = parts[1:]
    if len(parts) not in (2, 3):
        raise RemoteProtocolError(f"replay answer of {len(frames)} frames", "frames")
    seq = _seq(parts[-2])
    payload = _frame(parts[-1], "payload")
    if seq == _END_SEQ:
        return ReplayEnd()
    if seq < 0:
        raise RemoteProtocolError(f"replay seq {seq} is negative", "frames")
    return ReplayMessage(seq, payload)


def encode_replay_request(start_seq: int) -> tuple[bytes, bytes]:
    """The frames a DEALER sends to the replay ROUTER: ``[b"", start_seq]``."""
    if not 0 <= start_seq < 2**63:
        raise ValueError(f"start_seq must be in [0, 2**63), got {start_seq}")
    return b"", start_seq.to_bytes(_SEQ_BYTES, "big")


# -------------------------------------------------------------------------------- sequencing
@dataclass(frozen=True, slots=True)
class Apply(Generic[_T]):
    """Apply this batch to the index now."""

    seq: int
    item: _T


@dataclass(frozen=True, slots=True)
class Drop:
    """This seq was already applied (a replay overlapping what we have); ignore it."""

    seq: int
    reason: str


@dataclass(frozen=True, slots=True)
class RequestReplay:
    """Ask the replay socket for every batch with seq >= ``start_seq``."""

    start_seq: int


@dataclass(frozen=True, slots=True)
class Reset:
    """Drop this engine's index (count it by ``reason``); later batches rebuild it."""

    reason: str  # restarted | replay_incomplete | replay_failed | overflow


OrderStep = Apply[_T] | Drop | RequestReplay | Reset
_TRACKER_COUNTS = (
    "applied",
    "duplicates",
    "gaps",
    "restarted",
    "replay_incomplete",
    "replay_failed",
    "overflow",
    "unexpected_replay",
)


class SequenceTracker(Generic[_T]):
    """Seq numbers of one publisher (one engine / DP rank): what to do with each batch."""

    def __init__(self, max_pending: int = 1024) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be positive")
        self.max_pending = max_pending
        self._next = 0  # the seq we can apply next
        self._dirty = False  # something was applied since the last reset
        self._replaying = False
        self._pending: dict[int, _T] = {}  # live batches held while a replay is outstanding
        self._live_high = -1  # the highest live seq held during the current replay
        self.counts: dict[str, int] = dict.fromkeys(_TRACKER_COUNTS, 0)

    @property
    def next_seq(self) -> int:
        return self._next

    @property
    def replaying(self) -> bool:
        return self._replaying

    def on_live(self, seq: int, item: _T) -> list[OrderStep[_T]]:
        """A batch from the PUB stream."""
        if self._replaying:
            return self._hold(seq, item)
        if seq == self._next:
            return [self._apply(seq, item)]
        if seq > self._next:
            self.counts["gaps"] += 1
            self._replaying, self._pending, self._live_high = True, {seq: item}, seq
            return [RequestReplay(self._next)]
        return self._restart(seq, item)

    def on_replay(self, seq: int, item: _T) -> list[OrderStep[_T]]:
        """A batch from the replay socket."""
        if not self._replaying:
            self.counts["unexpected_replay"] += 1
            return [Drop(seq, "unexpected_replay")]
        if seq < self._next:
            self.counts["duplicates"] += 1
            return [Drop(seq, "duplicate")]
        steps: list[OrderStep[_T]] = []
        if seq > self._next:  # the replay buffer no longer holds the first missing batch
            steps += self._reset("replay_incomplete")
        return [*steps, self._apply(seq, item)]

    def on_replay_end(self) -> list[OrderStep[_T]]:
        """The replay's end marker arrived."""
        return self._finish_replay("replay_incomplete")

    def on_replay_failed(self) -> list[OrderStep[_T]]:
        """The replay could not be had (no replay socket, timeout): give up on the gap."""
        return self._finish_replay("replay_failed")

    # ------------------------------------------------------------------------------ internal
    def _apply(self, seq: int, item: _T) -> Apply[_T]:
        self._next, self._dirty = seq + 1, True
        self.counts["applied"] += 1
        return Apply(seq, item)

    def _reset(self, reason: str) -> list[OrderStep[_T]]:
        self.counts[reason] += 1
        if not self._dirty:
            return []
        self._dirty = False
        return [Reset(reason)]

    def _restart(self, seq: int, item: _T) -> list[OrderStep[_T]]:
        """seq went backwards: a new engine incarnation; start over from its seq 0."""
        self._replaying, self._pending, self._live_high = False, {}, -1
        steps = self._reset("restarted")
        self._next = 0
        return [*steps, *self.on_live(seq, item)]

    def _hold(self, seq: int, item: _T) -> list[OrderStep[_T]]:
        if seq <= self._live_high:
            return self._restart(seq, item)
        self._pending[seq], self._live_high = item, seq
        if len(self._pending) > self.max_pending:
            return self._finish_replay("overflow")
        return []

    def _finish_replay(self, reason: str) -> list[OrderStep[_T]]:
        if not self._replaying:
            return []
        pending, self._pending, self._replaying = self._pending, {}, False
        steps: list[OrderStep[_T]] = []
        if pending and min(pending) > self._next:
            steps += self._reset(reason)
            self._next = min(pending)
        for seq in sorted(pending):
            if seq < self._next:
                self.counts["duplicates"] += 1
                steps.append(Drop(seq, "duplicate"))
            else:
                steps += self.on_live(seq, pending[seq])
        return steps
