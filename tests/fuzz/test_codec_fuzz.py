"""Fuzz of the peer-message decoder: hostile bytes only ever raise ``RemoteProtocolError``.

Three generators, from shallow to deep:
1. arbitrary bytes, and arbitrary msgpack documents (right container, wrong everything else);
2. valid messages mutated at the byte level (flips, truncation, insertion, splicing);
3. valid messages mutated at the *structure* level: decode the msgpack tree, replace one node
   anywhere in it with a hostile value (huge/negative ints, NaN, bools, deep nesting, oversized
   strings and binaries, wrong-type containers), re-encode. This reaches the field checks that
   byte-level mutation almost never gets past msgpack to.

Whenever a decode *succeeds*, the result must satisfy the codec's documented invariants
(bounded ids, finite numbers, at most ``max_hashes`` hashes) — a decoder that accepts garbage
is as bad as one that crashes.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
from typing import Any

import msgpack
import pytest
from gossip_strategies import finite, gossip_strategy, ident, small
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from radixmesh.core.blocks import Fingerprint
from radixmesh.core.codec import Codec, Limits, RemoteProtocolError
from radixmesh.core.estimators import SpeedReport
from radixmesh.core.forward_codec import (
    ForwardLimits,
    ReplyDecoder,
    decode_forward_request,
    encode_forward_request,
    encode_reply,
)
from radixmesh.core.messages import (
    Ack,
    Change,
    Delta,
    DigestEntry,
    Echo,
    ForwardAdmitted,
    ForwardBusy,
    ForwardError,
    ForwardHeartbeat,
    ForwardRequest,
    ForwardResult,
    ForwardTokens,
    Gossip,
    Load,
    NodeState,
    PeerAddress,
    Snapshot,
)

SMALL = Limits(max_message_bytes=64 * 1024, max_hashes=2_000, max_peers=64, max_changes=64)
# RADIXMESH_FUZZ_EXAMPLES=20000 runs a long campaign; CI keeps the default.
EXAMPLES = int(os.environ.get("RADIXMESH_FUZZ_EXAMPLES", "250"))
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

gossip = gossip_strategy()


def _hash_count(msg: Gossip) -> int:
    def count(s: Snapshot | Delta | None) -> int:
        if s is None:
            return 0
        if isinstance(s, Snapshot):
            return len(s.hashes)
        return sum(len(c.added) + len(c.removed) for c in s.changes)

    return count(msg.summary) + sum(count(r.summary) for r in msg.relays)


def _finite_load(load_: Load | None) -> bool:
    if load_ is None:
        return True
    s = load_.speed  # None: "unchanged since the last speed I sent you"
    numbers = [load_.pushback_s or 0.0]
    if s is not None:
        numbers += [s.prefill_overhead_s, s.prefill_s_per_token, s.decode_s_per_token,
                    s.mean_service_s]
    return all(math.isfinite(x) and x >= 0 for x in numbers)


def check_invariants(msg: Gossip, limits: Limits) -> None:
    """What any successfully decoded message must satisfy."""
    assert isinstance(msg, Gossip)
    assert 1 <= len(msg.sender) <= limits.max_id_len
    assert msg.address is None or 1 <= len(msg.address) <= limits.max_address_len
    assert min(msg.incarnation, msg.version, msg.heartbeat, msg.fingerprint or 0) >= 0
    assert math.isfinite(msg.stamp)
    assert _finite_load(msg.load) and all(_finite_load(r.load) for r in msg.relays)
    assert _hash_count(msg) <= limits.max_hashes
    assert max(len(msg.peers), len(msg.digest), len(msg.relays)) <= limits.max_peers
    for r in msg.relays:
        assert 1 <= len(r.node_id) <= limits.max_id_len and math.isfinite(r.stamp)


def decode_or_reject(codec: Codec, data: bytes) -> Gossip | None:
    """Decode; only :class:`RemoteProtocolError` may escape, and it is swallowed here."""
    try:
        msg = codec.decode(data)
    except RemoteProtocolError as exc:
        assert isinstance(exc.reason, str) and exc.reason
        return None
    check_invariants(msg, codec.limits)
    return msg


# ------------------------------------------------------------------------------- tests


@FUZZ
@given(data=st.binary(max_size=2048))
def test_arbitrary_bytes(data: bytes) -> None:
    decode_or_reject(Codec(SMALL), data)


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(width=64)
    | st.text(max_size=40)
    | st.binary(max_size=64),
    lambda children: st.lists(children, max_size=20),
    max_leaves=60,
)


@settings(max_examples=max(1, EXAMPLES // 2), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(doc=st.lists(msgpack_values, min_size=0, max_size=20))
def test_arbitrary_msgpack_documents(doc: list[Any]) -> None:
    decode_or_reject(Codec(SMALL), msgpack.packb(doc, use_bin_type=True))


shallow_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.binary(max_size=9),
    lambda children: st.lists(children, max_size=4),
    max_leaves=4,
)


@settings(max_examples=150, deadline=None)
@given(tail=st.lists(shallow_values, min_size=16, max_size=16))
def test_right_header_wrong_fields(tail: list[Any]) -> None:
    # Version and kind are right, so decoding reaches every field check.
    decode_or_reject(Codec(SMALL), msgpack.packb([1, 1, *tail], use_bin_type=True))


@FUZZ
@given(msg=gossip)
def test_valid_messages_roundtrip(msg: Gossip) -> None:
    codec = Codec(SMALL)
    got = codec.decode(codec.encode(msg))
    check_invariants(got, SMALL)
    assert got.sender == msg.sender and got.summary == msg.summary
    assert got.relays == tuple(
        NodeState(r.node_id, r.address, r.incarnation, r.heartbeat, r.stamp, r.load, r.summary)
        for r in msg.relays
    )


@FUZZ
@given(msg=gossip, seed=st.integers(0, 2**32), ops=st.integers(1, 8))
def test_byte_mutations(msg: Gossip, seed: int, ops: int) -> None:
    codec = Codec(SMALL)
    data = bytearray(codec.encode(msg))
    rng = random.Random(seed)
    for _ in range(ops):
        op = rng.randrange(5)
        i = rng.randrange(len(data) + 1)
        if op == 0 and data:
            data[min(i, len(data) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:
            del data[i:]
        elif op == 2:
            data[i:i] = rng.randbytes(rng.randint(1, 8))
        elif op == 3 and data:
            data[min(i, len(data) - 1)] = rng.choice([0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xFF, 0xDD])
        else:
            j = rng.randrange(len(data) + 1)
            data[i:i] = data[min(i, j) : max(i, j)]  # splice a copy of itself
    decode_or_reject(codec, bytes(data))


HOSTILE: list[Any] = [
    None, True, False, -1, -(2**63), 2**63, 2**64 - 1, 0.5, float("nan"), float("inf"),
    -0.0, "", "x" * 300, "\u0000", b"", b"\x00", b"\xff" * 16, [], [[]], [None] * 7,
    [0, 0, b""], [1, 0, [[b"\x02", b"\x02"]]], [0] * 18, {}, [[[[[[[[[[]]]]]]]]]],
]  # fmt: skip


def _paths(tree: Any, prefix: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    out = [prefix]
    if isinstance(tree, list):
        for i, child in enumerate(tree):
            out.extend(_paths(child, (*prefix, i)))
    return out


def _replace(tree: Any, path: tuple[int, ...], value: Any) -> Any:
    if not path:
        return value
    copy = list(tree)
    copy[path[0]] = _replace(tree[path[0]], path[1:], value)
    return copy


@FUZZ
@given(
    msg=gossip,
    seed=st.integers(0, 2**32),
    value=st.sampled_from(HOSTILE) | msgpack_values,
    edits=st.integers(1, 3),
)
def test_structure_mutations(msg: Gossip, seed: int, value: Any, edits: int) -> None:
    codec = Codec(SMALL)
    tree = msgpack.unpackb(codec.encode(msg), raw=False)
    rng = random.Random(seed)
    for _ in range(edits):
        path = rng.choice(_paths(tree)[1:])
        tree = _replace(tree, path, value if rng.random() < 0.7 else rng.choice(HOSTILE))
    try:
        data = msgpack.packb(tree, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        assume(False)  # e.g. a map key msgpack itself refuses to write
        return
    decode_or_reject(codec, data)


@FUZZ
@given(msg=gossip, hash_block=st.binary(max_size=300), kind=st.sampled_from([0, 1, 2, 3, 255]))
def test_hostile_hash_blocks(msg: Gossip, hash_block: bytes, kind: int) -> None:
    """Hash blocks are a second, binary format inside msgpack: fuzz them directly."""
    tree = msgpack.unpackb(Codec(SMALL).encode(msg), raw=False)
    tree[10] = [0, 7, bytes([kind]) + hash_block]  # summary := snapshot with this block
    decode_or_reject(Codec(SMALL), msgpack.packb(tree, use_bin_type=True))


def test_every_field_position_with_every_hostile_value() -> None:
    """Exhaustive: each node of a rich valid message, replaced by each hostile value."""
    msg = Gossip(
        sender="a", address="127.0.0.1:1", incarnation=3, version=9, heartbeat=4,
        fingerprint=77, stamp=1.5, load=Load(1, 1, 10, 100, SpeedReport(0.1, 0.2, 0.3, 0.4), 0.5),
        summary=Delta(7, (Change(8, (1, 5), (2,)), Change(9, (), (5,)))),
        fingerprint_detail=Fingerprint("m", "t", 16), ack=Ack(2, 3), echo=Echo(1.0, 0.1),
        peers=(PeerAddress("b", "h:2"),), digest=(DigestEntry("b", 1, None, 2),),
        relays=(NodeState("b", "h:2", 1, 2, 0.5, None, Snapshot(1, (3, 4))),), reply=True,
    )
    codec = Codec(SMALL)
    tree = msgpack.unpackb(codec.encode(msg), raw=False)
    tried = 0
    for path in _paths(tree)[1:]:
        for value in HOSTILE:
            try:
                data = msgpack.packb(_replace(tree, path, value), use_bin_type=True)
            except (TypeError, ValueError):
                continue
            decode_or_reject(codec, data)
            tried += 1
    assert tried > 1_000


# ------------------------------------------------------------------ limits are enforced


def _base_tree() -> list[Any]:
    msg = Gossip(
        sender="a", address="127.0.0.1:1", incarnation=1, version=1, heartbeat=1,
        fingerprint=1, stamp=0.0, load=Load(0, 0, 0, 1, SpeedReport(0.0, 0.0, 0.0, 0.0)),
    )
    tree: list[Any] = msgpack.unpackb(Codec(SMALL).encode(msg), raw=False)
    return tree


def _raw_block(values: list[int]) -> bytes:
    return bytes([2]) + b"".join(v.to_bytes(8, "little") for v in values)


def test_hash_budget_spans_summary_and_relays() -> None:
    tree = _base_tree()
    half = SMALL.max_hashes // 2 + 1
    tree[10] = [0, 1, _raw_block(list(range(half)))]
    relay = ["r", "h:1", 1, 1, 0.0, None, [0, 1, _raw_block(list(range(half)))]]
    tree[16] = [relay]
    with pytest.raises(RemoteProtocolError):
        Codec(SMALL).decode(msgpack.packb(tree, use_bin_type=True))
    tree[16] = []
    assert len(Codec(SMALL).decode(msgpack.packb(tree, use_bin_type=True)).summary.hashes) == half


def test_zlib_bomb_is_refused() -> None:
    import zlib

    tree = _base_tree()
    bomb = zlib.compress(b"\x01" * (SMALL.max_hashes * 10 + 10), 9)  # expands past the limit
    tree[10] = [0, 1, bytes([1]) + bomb]
    with pytest.raises(RemoteProtocolError):
        Codec(SMALL).decode(msgpack.packb(tree, use_bin_type=True))


def test_oversized_message_is_refused_before_parsing() -> None:
    data = msgpack.packb([1, 1, "x" * (SMALL.max_message_bytes + 10)], use_bin_type=True)
    with pytest.raises(RemoteProtocolError) as info:
        Codec(SMALL).decode(data)
    assert info.value.reason == "size"


def test_deep_nesting_is_refused() -> None:
    deep = b"\x91" * 100_000 + b"\xc0"  # 100k nested one-element arrays
    framed = b"\x93\x01\x01" + deep  # inside a message with the right version and kind
    for payload in (deep, framed):
        with pytest.raises(RemoteProtocolError):
            Codec(SMALL).decode(payload)


def test_many_peers_and_changes_are_bounded() -> None:
    tree = _base_tree()
    tree[14] = [["p", "h:1"]] * (SMALL.max_peers + 1)
    with pytest.raises(RemoteProtocolError):
        Codec(SMALL).decode(msgpack.packb(tree, use_bin_type=True))
    tree = _base_tree()
    tree[10] = [1, 5, [[b"\x02", b"\x02"]] * (SMALL.max_changes + 1)]
    with pytest.raises(RemoteProtocolError):
        Codec(SMALL).decode(msgpack.packb(tree, use_bin_type=True))


# ------------------------------------------------------------------ forward messages

FWD_SMALL = ForwardLimits(max_prompt_tokens=64, max_stop_tokens=8, max_frame_bytes=16 * 1024)
FORWARD_FUZZ = settings(
    max_examples=int(os.environ.get("RADIXMESH_FUZZ_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
_fwd_ids = st.lists(st.integers(0, 2**32 - 1), max_size=8).map(tuple)
forward_messages: st.SearchStrategy[Any] = st.one_of(
    st.builds(ForwardRequest, _fwd_ids.filter(bool), st.integers(1, 64), stream=st.booleans(),
              beat_s=st.none() | st.floats(-3600, 3600)),
    st.builds(ForwardBusy, ident, finite, st.none() | finite),
    st.builds(ForwardAdmitted, ident, small),
    st.just(ForwardHeartbeat()),
    st.builds(ForwardTokens, _fwd_ids),
    st.builds(ForwardResult, _fwd_ids, st.sampled_from(["stop", "length"]), small, small,
              finite, finite, finite),
    st.builds(ForwardError, st.text(max_size=40)),
)


def _forward_ok(msg: Any) -> None:
    """What any successfully decoded forward message must satisfy."""
    ids = [*getattr(msg, "prompt", ()), *getattr(msg, "ids", ()), *getattr(msg, "output_ids", ())]
    assert all(type(t) is int and 0 <= t < 2**32 for t in ids)
    assert len(ids) <= 2 * FWD_SMALL.max_prompt_tokens
    for name in ("temperature", "top_p", "heartbeat_s", "retry_after_s", "queue_s", "handler_s"):
        value = getattr(msg, name, 0.0)
        if value is None and name == "queue_s":  # optional: a refusal by state has none
            continue
        assert type(value) is float or value == 0.0
        assert math.isfinite(value)


def decode_forward_or_reject(data: bytes, chunk: int) -> None:
    """Both forward decoders on ``data``; only :class:`RemoteProtocolError` may escape them."""
    with contextlib.suppress(RemoteProtocolError):
        _forward_ok(decode_forward_request(data, FWD_SMALL))
    dec = ReplyDecoder(FWD_SMALL)
    with contextlib.suppress(RemoteProtocolError):
        for i in range(0, len(data), chunk):
            for msg in dec.feed(data[i : i + chunk]):
                _forward_ok(msg)


@FORWARD_FUZZ
@given(data=st.binary(max_size=2048), chunk=st.integers(1, 2048))
def test_forward_arbitrary_bytes(data: bytes, chunk: int) -> None:
    decode_forward_or_reject(data, chunk)
    decode_forward_or_reject(len(data).to_bytes(4, "big") + data, chunk)  # as one frame


def _forward_payload(msg: Any) -> bytes:
    if isinstance(msg, ForwardRequest):
        return encode_forward_request(msg)
    return encode_reply(msg)[4:]


@FORWARD_FUZZ
@given(
    msg=forward_messages,
    seed=st.integers(0, 2**32),
    value=st.sampled_from(HOSTILE) | msgpack_values,
    chunk=st.integers(1, 64),
)
def test_forward_structure_mutations(msg: Any, seed: int, value: Any, chunk: int) -> None:
    tree = msgpack.unpackb(_forward_payload(msg), raw=False)
    path = random.Random(seed).choice(_paths(tree)[1:])
    try:
        payload = msgpack.packb(_replace(tree, path, value), use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        assume(False)
        return
    decode_forward_or_reject(payload, chunk)
    decode_forward_or_reject(len(payload).to_bytes(4, "big") + payload, chunk)
