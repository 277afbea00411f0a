"""This node's own cache summary (block-hash set, version, bounded change log) and its encoding.

Theory of operation
-------------------
The node is the single writer of its summary. Every effective cache change (a ``CacheChanged``
event that adds an absent hash or removes a present one) bumps ``version`` by one and appends
one :class:`Change` to a bounded log::

    version:   0 ── 1 ── 2 ── 3 ── 4 ── 5            (current = 5)
    log:                 [3]  [4]  [5]               (oldest entries trimmed past the limit)
    delta_since(2) = Delta(base=2, changes=[3,4,5])  delta_since(1) = None -> send a snapshot

Encoding of a hash set (snapshots and each change): sorted ascending, the first hash absolute
and the rest as gaps, each as an LEB128 varint, then zlib if that is smaller; tiny sets go as raw
little-endian uint64 when that is smaller. For ``n`` uniformly random 64-bit hashes the mean gap
is ``2**64 / n``: at 100k blocks about 2**47.4, i.e. ~7.0 bytes per block. All of it is
vectorised with numpy; the decoder validates everything and raises ``ValueError``.
"""

from __future__ import annotations

import struct
import zlib
from array import array
from collections.abc import Iterable, Sequence
from itertools import pairwise

import numpy as np
import numpy.typing as npt

from radixmesh.core.load_estimates import QueuedBlocks
from radixmesh.core.messages import Change, Delta, Snapshot

_VARINT = 0
_VARINT_ZLIB = 1
_RAW = 2
_U64_MAX = 2**64 - 1
SMALL = 256  # sets up to this size go raw (varint gains nothing on few random hashes)
_SHIFTS = np.arange(10, dtype=np.uint64) * np.uint64(7)
_U64 = npt.NDArray[np.uint64]


# ------------------------------------------------------------------------------- encoding
def pack_hashes(hashes: Iterable[int]) -> bytes:
    """Encode a set of 64-bit hashes compactly (order and duplicates are not kept)."""
    if isinstance(hashes, tuple | list | set | frozenset) and len(hashes) <= SMALL:
        small = sorted(set(hashes))
        return bytes([_RAW]) + struct.pack(f"<{len(small)}Q", *small)
    values = np.sort(np.frombuffer(array("Q", hashes), dtype=np.uint64))
    if values.size == 0:
        return bytes([_RAW])
    if values.size > 1:
        values = values[np.concatenate(([True], values[1:] != values[:-1]))]
    gaps = values.copy()
    gaps[1:] -= values[:-1]
    varint = _varint_encode(gaps)
    candidates = [bytes([_VARINT]) + varint, bytes([_RAW]) + values.astype("<u8").tobytes()]
    if len(varint) > 64:
        candidates.append(bytes([_VARINT_ZLIB]) + zlib.compress(varint, 6))
    return min(candidates, key=len)


def unpack_hashes(data: bytes, limit: int) -> tuple[int, ...]:
    """Decode :func:`pack_hashes` output holding at most ``limit`` hashes; ``ValueError`` if bad."""
    if not data:
        raise ValueError("empty hash block")
    kind, body = data[0], data[1:]
    if kind == _RAW:
        return _unpack_raw(body, limit)
    if kind == _VARINT_ZLIB:
        body = _inflate(body, limit * 10)
    elif kind != _VARINT:
        raise ValueError(f"unknown hash encoding {kind}")
    return _from_gaps(_varint_decode(body, limit))


def _unpack_raw(body: bytes, limit: int) -> tuple[int, ...]:
    if len(body) % 8:
        raise ValueError("raw hash block is not a multiple of 8 bytes")
    if len(body) // 8 > limit:
        raise ValueError("too many hashes")
    if len(body) <= 8 * SMALL:
        small = struct.unpack(f"<{len(body) // 8}Q", body)
        if any(a >= b for a, b in pairwise(small)):
            raise ValueError("raw hashes not strictly ascending")
        return small
    values = np.frombuffer(body, dtype="<u8")
    if values.size > 1 and not bool(np.all(values[1:] > values[:-1])):
        raise ValueError("raw hashes not strictly ascending")
    return tuple(int(v) for v in values.tolist())


def _inflate(body: bytes, max_out: int) -> bytes:
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(body, max_out + 1)
    except zlib.error as exc:
        raise ValueError(f"bad zlib stream: {exc}") from None
    if len(out) > max_out or inflater.unconsumed_tail:
        raise ValueError("compressed hash block too large")
    if not inflater.eof or inflater.unused_data:
        raise ValueError("truncated or trailing zlib data")
    return out


def _from_gaps(gaps: _U64) -> tuple[int, ...]:
    if gaps.size == 0:
        return ()
    if gaps.size > 1 and not bool(np.all(gaps[1:] > 0)):
        raise ValueError("repeated hash in a hash block")
    values = np.cumsum(gaps, dtype=np.uint64)
    if values.size > 1 and not bool(np.all(values[1:] > values[:-1])):
        raise ValueError("hash block overflows 64 bits")
    return tuple(values.tolist())


def _varint_encode(values: _U64) -> bytes:
    if values.size == 0:
        return b""
    nbytes = np.ones(values.size, dtype=np.int64)
    for i in range(1, 10):
        nbytes += (values >> _SHIFTS[i]) != 0
    groups = (values[:, None] >> _SHIFTS[None, :]) & np.uint64(0x7F)
    column = np.arange(10)[None, :]
    more = (column < (nbytes - 1)[:, None]).astype(np.uint64) << np.uint64(7)
    keep = column < nbytes[:, None]
    return (groups | more).astype(np.uint8)[keep].tobytes()


def _varint_decode(body: bytes, limit: int) -> _U64:
    raw = np.frombuffer(body, dtype=np.uint8)
    if raw.size == 0:
        return np.zeros(0, dtype=np.uint64)
    if raw[-1] & 0x80:
        raise ValueError("truncated varint")
    ends = np.flatnonzero((raw & 0x80) == 0)
    if ends.size > limit:
        raise ValueError("too many hashes")
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts + 1
    if int(lengths.max()) > 10:
        raise ValueError("varint longer than 10 bytes")
    tenth = starts[lengths == 10] + 9
    if tenth.size and int(raw[tenth].max()) > 1:
        raise ValueError("varint overflows 64 bits")
    position = np.arange(raw.size) - np.repeat(starts, lengths)
    parts = (raw & 0x7F).astype(np.uint64) << (position.astype(np.uint64) * np.uint64(7))
    return np.bitwise_or.reduceat(parts, starts)


# --------------------------------------------------------------------------- local summary
class LocalSummary:
    """The set of block hashes this node caches, its version and a bounded change log."""

    def __init__(self, log_limit: int) -> None:
        if log_limit < 1:
            raise ValueError("log_limit must be >= 1")
        self._limit = log_limit  # hashes (added + removed) kept in the log, at most
        self._hashes: set[int] = set()
        self._version = 0
        self._log: list[Change] = []
        self._head = 0  # index of the oldest live entry in _log
        self._log_hashes = 0
        self._snapshot: Snapshot | None = None

    @property
    def version(self) -> int:
        return self._version

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, item: object) -> bool:
        return item in self._hashes

    def hashes(self) -> frozenset[int]:
        return frozenset(self._hashes)

    def apply(self, added: Iterable[int], removed: Iterable[int]) -> Change | None:
        """Record a cache change (removed first); ``None`` if nothing actually changed."""
        gone = {h for h in removed if h in self._hashes}
        self._hashes -= gone
        new = {h for h in added if h not in self._hashes}
        self._hashes |= new
        if not gone and not new:
            return None
        self._version += 1
        change = Change(self._version, tuple(sorted(new)), tuple(sorted(gone)))
        self._append(change)
        self._snapshot = None
        return change

    def snapshot(self) -> Snapshot:
        """The whole set at the current version (cached until the next change)."""
        if self._snapshot is None:
            self._snapshot = Snapshot(self._version, tuple(sorted(self._hashes)))
        return self._snapshot

    def delta_since(self, version: int) -> Delta | None:
        """Changes after ``version``, or ``None`` if the log no longer reaches back that far."""
        if version == self._version:
            return Delta(version, ())
        if version > self._version or version < self.log_start - 1:
            return None
        first = self._head + (version - (self.log_start - 1))
        return Delta(version, tuple(self._log[first:]))

    @property
    def log_start(self) -> int:
        """Oldest version still in the log (``version + 1`` when the log is empty)."""
        return self._log[self._head].version if self._head < len(self._log) else self._version + 1

    def _append(self, change: Change) -> None:
        self._log.append(change)
        self._log_hashes += len(change.added) + len(change.removed)
        while self._log_hashes > self._limit and self._head < len(self._log):
            old = self._log[self._head]
            self._log_hashes -= len(old.added) + len(old.removed)
            self._head += 1
        if self._head > 1024 and self._head * 2 > len(self._log):
            del self._log[: self._head]
            self._head = 0


class Holdings:
    """What this node advertises in its ``LocalSummary``: the blocks its engine caches
    (``CacheChanged``) and the blocks of the requests in its engine queue (``QueueChanged``).

    The queue is first come, first served, so a request queued behind one that computes a
    prefix finds it cached when it runs: for routing, a queued prefix is held. Advertising
    it as soon as it is queued lets a peer send the next request of that prefix here rather
    than compute it a second time while the first still waits (under load, where queues are
    seconds long, most cold prefills of a prefix requested before were made that way: 37 of
    66 in the simulator, 4 nodes, Poisson at 60 % of a cached mesh's capacity). A block
    leaves the summary when neither holds it: the engine evicted it and no queued request
    has it, or its request left without the engine caching it (cancelled, failed). Peers
    get queued blocks with the next gossip round (no round is brought forward for them:
    with one client that round would report the queue the request is in, and it would be
    stale by the time the answer is back).
    """

    __slots__ = ("_queued", "_queued_only", "summary")

    def __init__(self, summary: LocalSummary) -> None:
        self.summary = summary
        self._queued = QueuedBlocks(1)  # the queued requests' blocks, counted per request
        self._queued_only: set[int] = set()  # advertised for the queue alone

    def cache_changed(self, added: Iterable[int], removed: Iterable[int]) -> bool:
        """The engine's cache changed; whether the peers should hear of it soon: the summary
        changed, or the engine now caches blocks advertised for the queue (a queued request
        was answered: before queued blocks were advertised, the round its cache change
        brought forward also told the peers that the queue was shorter again)."""
        queued, only = self._queued, self._queued_only
        added = list(added)
        new = [h for h in added if h not in only]
        answered = len(new) < len(added)
        only.difference_update(added)  # the engine holds them now
        gone = []
        for h in removed:
            if h in queued:
                only.add(h)  # evicted, but a queued request computes it again
            else:
                gone.append(h)
        return self.summary.apply(new, gone) is not None or answered

    def queue_changed(self, hashes: Sequence[int], joined: bool) -> bool:
        """A request with these blocks joined or left the queue; whether the summary changed."""
        queued, only = self._queued, self._queued_only
        if joined:
            queued.add(hashes)
            new = [h for h in dict.fromkeys(hashes) if h not in self.summary]
            only.update(new)
            gone: list[int] = []
        else:
            queued.remove(hashes)
            new = []
            gone = [h for h in dict.fromkeys(hashes) if h in only and h not in queued]
            only.difference_update(gone)
        return bool(new or gone) and self.summary.apply(new, gone) is not None

    def queued_only(self) -> frozenset[int]:
        """Blocks advertised only because a queued request will compute them."""
        return frozenset(self._queued_only)
