"""The one codec for peer messages: msgpack arrays, a protocol version, hard limits.

Theory of operation
-------------------
A message is a msgpack array ``[PROTOCOL_VERSION, KIND, field, field, ...]`` with fields in
declaration order (positional: no field names on the wire). Hash sets travel as opaque ``bin``
blocks packed by :func:`summary.pack_hashes` (~7 bytes per hash at 100k hashes); the speed
report as four little-endian float32; utilization in whole percent (the node rounds it to
0.01); the sender's address and fingerprint digest as nil once the receiver knows them.

Decoding treats every byte as hostile: msgpack's own limits bound strings, arrays and binaries
before anything is allocated; then each field is type- and range-checked by hand (bools are not
ints, floats must be finite, strings have maximum lengths, a message holds at most
``max_hashes`` hashes in total). Anything wrong raises :class:`RemoteProtocolError` — and only
that: the node counts it and drops the message, it never crashes and never touches a view.

This module holds gossip; the checked low-level readers (``check_int``, ``check_float``,
``check_text``, ...) and :class:`RemoteProtocolError` are :mod:`radixmesh.core.checked`'s, and
:mod:`forward_codec` encodes forwarded requests and their replies with the same readers.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from radixmesh.core.adapters import MAX_ADAPTERS, Adapter, adapters_from_wire
from radixmesh.core.blocks import Fingerprint
from radixmesh.core.cache_summary import pack_hashes, unpack_hashes
from radixmesh.core.checked import (
    INT_MAX,
    U32_MAX,
    RemoteProtocolError,
    check_array,
    check_bool,
    check_float,
    check_int,
    check_text,
    checked,
    unpack_checked,
)
from radixmesh.core.estimators import SpeedReport
from radixmesh.core.messages import (
    PROTOCOL_VERSION,
    Ack,
    Change,
    Delta,
    DigestEntry,
    Echo,
    Gossip,
    Load,
    NodeState,
    PeerAddress,
    Snapshot,
    Summary,
)
from radixmesh.core.sessions import MAX_GOSSIP_SESSIONS
from radixmesh.core.shadow_state import PACKED_SIZE, BatchState

KIND_GOSSIP = 1  # kinds 2.. are forward messages (forward_codec)
_EMPTY = pack_hashes(())
_PACK_CACHE = 4096  # packed hash sets remembered by the encoder
_SPEED = struct.Struct("<4f")
_U64_MAX = 2**64 - 1


@dataclass(frozen=True, slots=True)
class Limits:
    """Hard limits on what a peer may send us."""

    max_message_bytes: int = 8 * 1024 * 1024
    max_hashes: int = 1_000_000  # over all summaries in one message
    max_id_len: int = 128
    max_address_len: int = 256
    max_text_len: int = 512  # fingerprint model / tokenizer identities
    max_peers: int = 4096  # peer list, digest and relays, each
    max_changes: int = 65_536  # change entries in one delta

    def __post_init__(self) -> None:
        if min(self.max_message_bytes, self.max_hashes, self.max_peers, self.max_changes) < 1:
            raise ValueError("limits must be positive")


class Codec:
    """Encodes and decodes :class:`Gossip`; remembers the last packed snapshot (it repeats)."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        # Packed hash sets by identity of the (immutable) tuple: snapshots and relayed change
        # entries are sent to many peers; the tuple is kept so its id cannot be reused.
        self._packed: dict[int, tuple[tuple[int, ...], bytes]] = {}

    # ------------------------------------------------------------------------------ encode
    def encode(self, msg: Gossip) -> bytes:
        fields: list[Any] = [
            PROTOCOL_VERSION,
            KIND_GOSSIP,
            msg.sender,
            msg.address,
            msg.incarnation,
            msg.version,
            msg.heartbeat,
            msg.fingerprint,
            msg.stamp,
            _enc_load(msg.load),
            self._enc_summary(msg.summary),
            _enc_fingerprint(msg.fingerprint_detail),
            None if msg.ack is None else [msg.ack.incarnation, msg.ack.version],
            None if msg.echo is None else [msg.echo.stamp, msg.echo.held_s],
            [[p.node_id, p.address] for p in msg.peers],
            [[d.node_id, d.incarnation, d.version, d.heartbeat] for d in msg.digest],
            [self._enc_state(s) for s in msg.relays],
            msg.reply,
            pack_hashes(msg.sessions) if msg.sessions else None,
            pack_hashes(msg.adapters) if msg.adapters else None,
            [[a.name, a.digest] for a in msg.adapter_names] or None,
        ]
        return bytes(msgpack.packb(fields, use_bin_type=True))

    def _enc_summary(self, summary: Summary | None) -> list[Any] | None:
        if summary is None:
            return None
        if isinstance(summary, Snapshot):
            return [0, summary.version, self._pack(summary.hashes)]
        entries = [[self._pack(c.added), self._pack(c.removed)] for c in summary.changes]
        return [1, summary.base, entries]

    def _pack(self, hashes: tuple[int, ...]) -> bytes:
        if not hashes:
            return _EMPTY
        hit = self._packed.get(id(hashes))
        if hit is not None and hit[0] is hashes:
            return hit[1]
        if len(self._packed) >= _PACK_CACHE:
            self._packed.clear()
        packed = pack_hashes(hashes)
        self._packed[id(hashes)] = (hashes, packed)
        return packed

    def _enc_state(self, s: NodeState) -> list[Any]:
        load = None if s.load is None else _enc_load(s.load)
        summary = self._enc_summary(s.summary)
        return [s.node_id, s.address, s.incarnation, s.heartbeat, s.stamp, load, summary]

    # ------------------------------------------------------------------------------ decode
    def decode(self, data: bytes) -> Gossip:
        """Parse ``data``; raises :class:`RemoteProtocolError` (only) if it is not valid."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise RemoteProtocolError("message is not bytes")
        if len(data) > self.limits.max_message_bytes:
            raise RemoteProtocolError(f"message of {len(data)} bytes exceeds the limit", "size")
        lim = self.limits
        raw = unpack_checked(
            bytes(data),
            max_str=max(lim.max_text_len, lim.max_address_len, lim.max_id_len),
            max_bin=lim.max_message_bytes,
            max_array=max(lim.max_peers, lim.max_changes, 32),
        )
        return checked(_Parser(self.limits).gossip, raw)


# ---------------------------------------------------------------------------- encode helpers
def _enc_load(load: Load) -> list[Any]:
    s = load.speed
    speed = None
    if s is not None:
        speed = _SPEED.pack(
            s.prefill_overhead_s, s.prefill_s_per_token, s.decode_s_per_token, s.mean_service_s
        )
    return [
        load.queue_depth,
        load.inflight,
        load.cache_tokens,
        load.cache_budget,
        speed,
        load.pushback_s,
        round(load.utilization * 100),  # whole percent: 1 byte, not a float64's 9
        load.speed_measured_at,
        None if load.batch is None else load.batch.pack(),
    ]


def _enc_fingerprint(fp: Fingerprint | None) -> list[Any] | None:
    return None if fp is None else [fp.model, fp.tokenizer, fp.block_size]


# ---------------------------------------------------------------------------------- parsing
class _Parser:
    """Checks one decoded msgpack tree field by field; holds the message's hash budget."""

    def __init__(self, limits: Limits) -> None:
        self.lim = limits
        self.hash_budget = limits.max_hashes

    def gossip(self, raw: Any) -> Gossip:
        f = check_array(raw, 21, "message")
        if check_int(f[0], "protocol version") != PROTOCOL_VERSION:
            raise RemoteProtocolError(f"unsupported protocol version {f[0]}", "version")
        if check_int(f[1], "kind") != KIND_GOSSIP:
            raise RemoteProtocolError(f"unknown message kind {f[1]}")
        return Gossip(
            sender=self.text(f[2], self.lim.max_id_len, "sender"),
            address=None if f[3] is None else self.text(f[3], self.lim.max_address_len,
                                                        "address"),
            incarnation=check_int(f[4], "incarnation"),
            version=check_int(f[5], "version"),
            heartbeat=check_int(f[6], "heartbeat"),
            fingerprint=None if f[7] is None else check_int(f[7], "fingerprint", _U64_MAX),
            stamp=check_float(f[8], "stamp"),
            load=self.load(f[9]),
            summary=self.summary(f[10]),
            fingerprint_detail=self.fingerprint(f[11]),
            ack=None if f[12] is None else self.ack(f[12]),
            echo=None if f[13] is None else self.echo(f[13]),
            peers=tuple(self.peer(p) for p in self.items(f[14], "peers")),
            digest=tuple(self.digest_entry(d) for d in self.items(f[15], "digest")),
            relays=tuple(self.state(s) for s in self.items(f[16], "relays")),
            reply=check_bool(f[17], "reply"),
            sessions=() if f[18] is None else self.keys(f[18], MAX_GOSSIP_SESSIONS, "sessions"),
            adapters=() if f[19] is None else self.keys(f[19], MAX_ADAPTERS, "adapters"),
            adapter_names=() if f[20] is None else self.adapter_names(f[20]),
        )

    def adapter_names(self, raw: Any) -> tuple[Adapter, ...]:
        try:
            return adapters_from_wire(raw)
        except ValueError as exc:
            raise RemoteProtocolError(f"adapter_names: {exc}") from None

    def keys(self, raw: Any, limit: int, what: str) -> tuple[int, ...]:
        """A packed set of at most ``limit`` 64-bit keys (session ids, adapter keys)."""
        if not isinstance(raw, bytes):
            raise RemoteProtocolError(f"{what} must be binary")
        try:
            return unpack_hashes(raw, limit)
        except ValueError as exc:
            raise RemoteProtocolError(f"{what}: {exc}") from None

    def text(self, v: Any, limit: int, what: str) -> str:
        return check_text(v, limit, what)

    def items(self, v: Any, what: str) -> list[Any]:
        if not isinstance(v, list) or len(v) > self.lim.max_peers:
            raise RemoteProtocolError(f"{what}: expected a list of at most {self.lim.max_peers}")
        return v

    def load(self, raw: Any) -> Load:
        f = check_array(raw, 9, "load")
        pushback = None if f[5] is None else check_float(f[5], "pushback", minimum=0.0)
        measured = None if f[7] is None else check_float(f[7], "speed_measured_at")
        return Load(
            queue_depth=check_int(f[0], "queue_depth", U32_MAX),
            inflight=check_int(f[1], "inflight", U32_MAX),
            cache_tokens=check_int(f[2], "cache_tokens"),
            cache_budget=check_int(f[3], "cache_budget"),
            speed=None if f[4] is None else _speed(f[4]),
            pushback_s=pushback,
            utilization=min(100, check_int(f[6], "utilization")) / 100,
            speed_measured_at=measured,
            batch=None if f[8] is None else _batch(f[8]),
        )

    def summary(self, raw: Any) -> Summary | None:
        if raw is None:
            return None
        f = check_array(raw, 3, "summary")
        kind, version = check_int(f[0], "summary kind"), check_int(f[1], "summary version")
        if kind == 0:
            return Snapshot(version, self.hashes(f[2]))
        if kind != 1:
            raise RemoteProtocolError(f"unknown summary kind {kind}")
        entries = f[2]
        if not isinstance(entries, list) or len(entries) > self.lim.max_changes:
            raise RemoteProtocolError("delta: bad change list")
        if version + len(entries) > INT_MAX:
            raise RemoteProtocolError("delta: version overflow")
        changes = tuple(self.change(version + 1 + i, e) for i, e in enumerate(entries))
        return Delta(version, changes)

    def change(self, version: int, raw: Any) -> Change:
        f = check_array(raw, 2, "change")
        return Change(version, self.hashes(f[0]), self.hashes(f[1]))

    def hashes(self, raw: Any) -> tuple[int, ...]:
        if not isinstance(raw, bytes):
            raise RemoteProtocolError("hash block must be binary")
        try:
            out = unpack_hashes(raw, self.hash_budget)
        except ValueError as exc:
            raise RemoteProtocolError(f"hash block: {exc}") from None
        self.hash_budget -= len(out)
        return out

    def fingerprint(self, raw: Any) -> Fingerprint | None:
        if raw is None:
            return None
        f = check_array(raw, 3, "fingerprint")
        model = self.text(f[0], self.lim.max_text_len, "fingerprint model")
        tokenizer = self.text(f[1], self.lim.max_text_len, "fingerprint tokenizer")
        block_size = check_int(f[2], "block size")
        if block_size < 1:
            raise RemoteProtocolError("block size must be positive")
        return Fingerprint(model, tokenizer, block_size)

    def ack(self, raw: Any) -> Ack:
        f = check_array(raw, 2, "ack")
        return Ack(check_int(f[0], "ack incarnation"), check_int(f[1], "ack version"))

    def echo(self, raw: Any) -> Echo:
        f = check_array(raw, 2, "echo")
        return Echo(check_float(f[0], "echo stamp"), check_float(f[1], "echo held", minimum=0.0))

    def peer(self, raw: Any) -> PeerAddress:
        f = check_array(raw, 2, "peer")
        node_id = self.text(f[0], self.lim.max_id_len, "peer id")
        return PeerAddress(node_id, self.text(f[1], self.lim.max_address_len, "peer address"))

    def digest_entry(self, raw: Any) -> DigestEntry:
        f = check_array(raw, 4, "digest entry")
        version = None if f[2] is None else check_int(f[2], "digest version")
        node_id = self.text(f[0], self.lim.max_id_len, "digest id")
        incarnation = check_int(f[1], "digest incarnation")
        return DigestEntry(node_id, incarnation, version, check_int(f[3], "hb"))

    def state(self, raw: Any) -> NodeState:
        f = check_array(raw, 7, "relay")
        return NodeState(
            node_id=self.text(f[0], self.lim.max_id_len, "relay id"),
            address=self.text(f[1], self.lim.max_address_len, "relay address"),
            incarnation=check_int(f[2], "relay incarnation"),
            heartbeat=check_int(f[3], "relay heartbeat"),
            stamp=check_float(f[4], "relay stamp"),
            load=None if f[5] is None else self.load(f[5]),
            summary=self.summary(f[6]),
        )


def _speed(raw: Any) -> SpeedReport:
    if not isinstance(raw, bytes) or len(raw) != _SPEED.size:
        raise RemoteProtocolError("load: bad speed report")
    speeds = _SPEED.unpack(raw)
    if not all(math.isfinite(x) and x >= 0 for x in speeds):
        raise RemoteProtocolError("load: speed figures must be finite and >= 0")
    return SpeedReport(*speeds)


def _batch(raw: Any) -> BatchState:
    if not isinstance(raw, bytes) or len(raw) != PACKED_SIZE:
        raise RemoteProtocolError("load: bad batch report")
    try:
        return BatchState.unpack(raw)
    except ValueError as exc:
        raise RemoteProtocolError(f"load: {exc}") from None


__all__ = ["KIND_GOSSIP", "Codec", "Limits", "RemoteProtocolError", "unpack_checked"]
