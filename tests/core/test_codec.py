"""The peer-message codec: round trips, compact hash sets, hard limits, hostile bytes."""

from __future__ import annotations

import contextlib
import math
import random

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixmesh.core.blocks import Fingerprint
from radixmesh.core.cache_summary import pack_hashes, unpack_hashes
from radixmesh.core.codec import Codec, Limits, RemoteProtocolError
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
)

SPEED = SpeedReport(0.004, 8e-5, 0.007, 0.25)  # exactly representable enough as float32
U64 = st.integers(min_value=0, max_value=2**64 - 1)


def _f32(x: float) -> float:
    import struct

    return float(struct.unpack("<f", struct.pack("<f", x))[0])


def _speed32(s: SpeedReport) -> SpeedReport:
    return SpeedReport(
        *(
            _f32(x)
            for x in (
                s.prefill_overhead_s,
                s.prefill_s_per_token,
                s.decode_s_per_token,
                s.mean_service_s,
            )
        )
    )


def full_message(rng: random.Random) -> Gossip:
    hashes = tuple(sorted({rng.getrandbits(64) for _ in range(50)}))
    load = Load(3, 1, 4096, 65536, _speed32(SPEED), 0.75, 0.5, 1200.25)
    relay = NodeState("n7", "mem://n7", 4, 9, 12.5, load, Delta(3, (Change(4, (5, 9), (1,)),)))
    return Gossip(
        sender="n1",
        address="127.0.0.1:9001",
        incarnation=1_700_000_000,
        version=42,
        heartbeat=17,
        fingerprint=Fingerprint("m", "bytes", 16).digest,
        stamp=1234.5,
        load=load,
        summary=Snapshot(42, hashes),
        fingerprint_detail=Fingerprint("m", "bytes", 16),
        ack=Ack(2, 7),
        echo=Echo(99.25, 0.003),
        peers=(PeerAddress("n2", "127.0.0.1:9002"), PeerAddress("n3", "127.0.0.1:9003")),
        digest=(DigestEntry("n2", 1, None, 3), DigestEntry("n3", 2, 8, 11)),
        relays=(
            relay,
            NodeState("n8", "mem://n8", 1, 2, 0.0, None, None),
            NodeState("n9", "mem://n9", 1, 2, 3.0, Load(0, 0, 0, 0, None, None), None),
        ),
        reply=True,
    )


def test_round_trip_of_every_field() -> None:
    codec = Codec()
    msg = full_message(random.Random(1))
    assert codec.decode(codec.encode(msg)) == msg


def test_delta_round_trip_and_versions_are_implied() -> None:
    codec = Codec()
    msg = full_message(random.Random(2))
    delta = Delta(10, (Change(11, (3, 2**64 - 1), ()), Change(12, (), (3,))))
    back = codec.decode(codec.encode(Gossip(**{**_fields(msg), "summary": delta})))
    assert back.summary == delta
    assert isinstance(back.summary, Delta) and back.summary.version == 12


def _fields(msg: Gossip) -> dict[str, object]:
    return {name: getattr(msg, name) for name in msg.__slots__}  # type: ignore[attr-defined]


@given(st.sets(U64, max_size=300))
@settings(max_examples=60, deadline=None)
def test_hash_sets_round_trip(hashes: set[int]) -> None:
    assert unpack_hashes(pack_hashes(hashes), len(hashes)) == tuple(sorted(hashes))


def test_snapshot_is_under_8_bytes_per_block_at_100k() -> None:
    rng = random.Random(3)
    hashes = {rng.getrandbits(64) for _ in range(100_000)}
    packed = pack_hashes(hashes)
    assert len(packed) / len(hashes) <= 8.0
    assert unpack_hashes(packed, 100_000) == tuple(sorted(hashes))
    with pytest.raises(ValueError):
        unpack_hashes(packed, 99_999)  # the limit is enforced before allocating


def test_hash_limit_spans_the_whole_message() -> None:
    rng = random.Random(4)
    codec = Codec(Limits(max_hashes=60))
    msg = full_message(rng)  # 50 snapshot hashes + 3 relayed
    codec.decode(Codec().encode(msg))
    small = Gossip(**{**_fields(msg), "relays": (msg.relays[0],) * 5})  # 50 + 15 > 60
    with pytest.raises(RemoteProtocolError):
        codec.decode(Codec().encode(small))


def test_oversize_message_rejected_with_reason() -> None:
    codec = Codec(Limits(max_message_bytes=1024))
    with pytest.raises(RemoteProtocolError) as err:
        codec.decode(b"\x00" * 2000)
    assert err.value.reason == "size"


def test_protocol_version_mismatch_has_its_own_reason() -> None:
    codec = Codec()
    raw = msgpack.unpackb(codec.encode(full_message(random.Random(5))))
    raw[0] = PROTOCOL_VERSION + 1
    with pytest.raises(RemoteProtocolError) as err:
        codec.decode(msgpack.packb(raw))
    assert err.value.reason == "version"


@pytest.mark.parametrize(
    ("index", "value"),
    [
        (2, ""),  # empty sender
        (2, "x" * 129),  # sender too long
        (4, True),  # bool is not an int
        (4, -1),  # negative incarnation
        (8, math.nan),  # stamp must be finite
        (8, math.inf),
        (7, 1.5),  # fingerprint must be an integer
        (17, 1),  # reply must be a bool
        (14, [["n2"]]),  # malformed peer entry
        (12, [1]),  # ack with one field
    ],
)
def test_bad_fields_rejected(index: int, value: object) -> None:
    codec = Codec()
    raw = msgpack.unpackb(codec.encode(full_message(random.Random(6))))
    raw[index] = value
    with pytest.raises(RemoteProtocolError):
        codec.decode(msgpack.packb(raw))


def test_bad_speed_and_pushback_rejected() -> None:
    codec = Codec()
    raw = msgpack.unpackb(codec.encode(full_message(random.Random(7))))
    raw[9][4] = b"\x00\x00\xc0\x7f" * 4  # float32 NaNs
    with pytest.raises(RemoteProtocolError):
        codec.decode(msgpack.packb(raw))
    raw = msgpack.unpackb(codec.encode(full_message(random.Random(7))))
    raw[9][5] = -1.0  # negative push-back
    with pytest.raises(RemoteProtocolError):
        codec.decode(msgpack.packb(raw))


@pytest.mark.parametrize(
    "block",
    [
        b"",  # no kind byte
        b"\x09abc",  # unknown kind
        b"\x02" + b"\x01" * 7,  # raw, not a multiple of 8
        b"\x02" + (2).to_bytes(8, "little") + (1).to_bytes(8, "little"),  # raw descending
        b"\x00\x81",  # truncated varint
        b"\x00" + b"\xff" * 10 + b"\x01",  # varint longer than 10 bytes
        b"\x00" + b"\xff" * 9 + b"\x02",  # varint beyond 64 bits
        b"\x00\x05\x00",  # repeated hash (gap 0)
        b"\x00" + b"\xff" * 9 + b"\x01" + b"\x01",  # sum overflows 64 bits
        b"\x01not zlib",
    ],
)
def test_bad_hash_blocks(block: bytes) -> None:
    with pytest.raises(ValueError):
        unpack_hashes(block, 1000)


def test_zlib_bomb_is_bounded() -> None:
    import zlib

    bomb = b"\x01" + zlib.compress(b"\x01" * 10_000_000)
    with pytest.raises(ValueError):
        unpack_hashes(bomb, 1000)


# ------------------------------------------------------------------------------- fuzzing
@given(st.binary(max_size=512))
@settings(max_examples=400, deadline=None)
def test_arbitrary_bytes_raise_only_remote_protocol_error(data: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        Codec().decode(data)


_VALID = Codec().encode(full_message(random.Random(8)))


@given(
    st.lists(
        st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), min_size=1, max_size=8
    ),
    st.integers(0, len(_VALID)),
)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_mutated_valid_messages_raise_only_remote_protocol_error(
    edits: list[tuple[int, int]], cut: int
) -> None:
    data = bytearray(_VALID)
    for pos, byte in edits:
        data[pos] = byte
    for candidate in (bytes(data), bytes(data[:cut])):
        with contextlib.suppress(RemoteProtocolError):
            Codec().decode(candidate)


_JSONISH = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.binary(max_size=8)
    | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=4),
    max_leaves=8,
)


def _replace_at(tree: list[object], path: list[int], value: object) -> None:
    """Replace the element reached by following ``path`` (indices modulo list sizes)."""
    node: list[object] = tree
    for step in path[:-1]:
        child = node[step % len(node)]
        if not isinstance(child, list) or not child:
            break
        node = child
    node[path[-1] % len(node)] = value


@given(st.lists(st.integers(0, 63), min_size=1, max_size=4), _JSONISH)
@settings(max_examples=300, deadline=None)
def test_wrong_shaped_fields_raise_only_remote_protocol_error(
    path: list[int], value: object
) -> None:
    tree = msgpack.unpackb(_VALID)
    path[0] = 2 + path[0] % 16  # keep the protocol version and kind valid
    _replace_at(tree, path, value)
    with contextlib.suppress(RemoteProtocolError):
        Codec().decode(msgpack.packb(tree, use_bin_type=True))
