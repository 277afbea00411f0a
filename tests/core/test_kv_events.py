"""Engine KV events: golden payloads of both encodings, frames, hostile bytes, seq tracking."""

from __future__ import annotations

import contextlib
import random
import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixmesh.core.codec import RemoteProtocolError
from radixmesh.core.kv_events import (
    EngineAllCleared,
    EngineBlockRemoved,
    EngineBlockStored,
    KvBatch,
    KvLimits,
    UnknownEngineEvent,
    decode_batch,
    is_device_medium,
    is_full_attention,
)
from radixmesh.core.kv_order import (
    Apply,
    Drop,
    LiveMessage,
    OrderStep,
    ReplayEnd,
    ReplayMessage,
    RequestReplay,
    Reset,
    SequenceTracker,
    decode_live_frames,
    decode_replay_frames,
    encode_replay_request,
)

U64 = 2**64 - 1


# ------------------------------------------------------------------- hand-built msgpack bytes
def s(text: str) -> bytes:
    """fixstr (< 32 bytes)."""
    raw = text.encode()
    assert len(raw) < 32
    return bytes([0xA0 | len(raw)]) + raw


def arr(n: int) -> bytes:
    return bytes([0x90 | n])


def fmap(n: int) -> bytes:
    return bytes([0x80 | n])


def f64(x: float) -> bytes:
    return b"\xcb" + struct.pack(">d", x)


NIL = b"\xc0"

# older vLLM: [ts, [tagged events], dp_rank]
GOLDEN_TAGGED = b"".join(
    [
        arr(3),
        f64(1.5),
        arr(3),
        arr(6), s("BlockStored"), arr(1), b"\x07", NIL, arr(2), b"\x01\x02", b"\x02", NIL,
        arr(2), s("BlockRemoved"), arr(1), b"\x07",
        arr(1), s("AllBlocksCleared"),
        b"\x00",
    ]
)  # fmt: skip

# SGLang: [ts, [map events], attn_dp_rank], hash = first 8 bytes of SHA-256 as signed int64
GOLDEN_SGLANG = b"".join(
    [
        arr(3),
        f64(2.0),
        arr(1),
        fmap(6),
        s("type"), s("BlockStored"),
        s("block_hashes"), arr(1), b"\xd3" + (-2).to_bytes(8, "big", signed=True),
        s("parent_block_hash"), NIL,
        s("token_ids"), arr(1), b"\x05",
        s("block_size"), b"\x01",
        s("medium"), s("GPU"),
        b"\x01",
    ]
)  # fmt: skip

# a batch as a map, unsigned 64-bit and bytes hashes, offload medium, a second KV group
GOLDEN_MAP_BATCH = b"".join(
    [
        fmap(3),
        s("ts"), b"\x03",
        s("events"), arr(1),
        fmap(4),
        s("type"), s("BlockRemoved"),
        s("block_hashes"), arr(2),
        b"\xcf" + (U64 - 1).to_bytes(8, "big"), b"\xc4\x04\xde\xad\xbe\xef",
        s("medium"), s("CPU"),
        s("group_idx"), b"\x01",
        s("data_parallel_rank"), b"\x02",
    ]
)  # fmt: skip


def test_golden_tagged_arrays_of_older_vllm() -> None:
    batch = decode_batch(GOLDEN_TAGGED)
    assert batch == KvBatch(
        1.5,
        (
            EngineBlockStored((7,), None, (1, 2), 2),
            EngineBlockRemoved((7,)),
            EngineAllCleared(),
        ),
        0,
    )
    ev = [["BlockStored", [7], None, [1, 2], 2, None], ["BlockRemoved", [7]], ["AllBlocksCleared"]]
    assert msgpack.packb([1.5, ev, 0]) == GOLDEN_TAGGED  # the hand bytes are plain msgpack


def test_golden_sglang_maps_with_a_signed_hash() -> None:
    batch = decode_batch(GOLDEN_SGLANG)
    assert batch.dp_rank == 1 and batch.ts == 2.0
    assert batch.events == (EngineBlockStored((U64 - 1,), None, (5,), 1, medium="GPU"),)


def test_golden_map_batch_with_unsigned_and_bytes_hashes() -> None:
    batch = decode_batch(GOLDEN_MAP_BATCH)
    assert batch == KvBatch(
        3.0, (EngineBlockRemoved((U64 - 1, b"\xde\xad\xbe\xef"), "CPU", 1),), 2
    )


def test_signed_and_unsigned_spellings_of_a_hash_are_one_key() -> None:
    a = decode_batch(msgpack.packb([0, [["BlockRemoved", [-1, 2**63]]]]))
    b = decode_batch(msgpack.packb([0, [["BlockRemoved", [U64, -(2**63)]]]]))
    assert a.events == b.events == (EngineBlockRemoved((U64, 2**63)),)
    assert a.dp_rank is None


def test_new_vllm_maps_ignore_unknown_fields_and_keep_the_known() -> None:
    stored = {
        "type": "BlockStored",
        "block_hashes": [b"\x01" * 32, b"\x02" * 32],
        "parent_block_hash": b"\x00" * 32,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lora_id": 3,
        "lora_name": "adapter",
        "medium": "GPU",
        "extra_keys": [None, ["img-hash"]],
        "group_idx": 1,
        "some_future_field": {"nested": [1, 2]},
    }
    (ev,) = decode_batch(msgpack.packb([0.0, [stored], None])).events
    assert ev == EngineBlockStored(
        (b"\x01" * 32, b"\x02" * 32), b"\x00" * 32, (1, 2, 3, 4), 2,
        medium="GPU", group_idx=1, lora_id=3, lora_name="adapter", keyed=(False, True),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "keyed"),
    [(None, ()), ([], ()), ([None, []], ()), ([[1], None], (True, False)), ("odd", (True, True))],
)
def test_extra_keys_become_per_block_flags(extra: Any, keyed: tuple[bool, ...]) -> None:
    ev = {"type": "BlockStored", "block_hashes": [1, 2], "token_ids": [1, 2], "block_size": 1}
    if extra is not None:
        ev["extra_keys"] = extra
    (out,) = decode_batch(msgpack.packb([0, [ev]])).events
    assert isinstance(out, EngineBlockStored) and out.keyed == keyed


def test_tagged_arrays_with_medium_and_trailing_fields() -> None:
    events = [
        ["BlockStored", [1, 2], 9, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "CPU", "x", [None], 0],
        ["BlockRemoved", [1], "GPU", "future"],
        ["BlockStored", [3], None, [1]],  # block_size omitted: inferred
    ]
    out = decode_batch(msgpack.packb([5, events, 3])).events
    assert out == (
        EngineBlockStored((1, 2), 9, (1, 2, 3, 4, 5, 6, 7, 8), 4, medium="CPU"),
        EngineBlockRemoved((1,), "GPU"),
        EngineBlockStored((3,), None, (1,), 1),
    )


def test_unknown_event_types_decode_to_unknown_events() -> None:
    events = [["BlockPinned", 1, 2], {"type": "Telemetry", "x": 1}, ["AllBlocksCleared"]]
    out = decode_batch(msgpack.packb([0, events])).events
    assert out == (UnknownEngineEvent("BlockPinned"), UnknownEngineEvent("Telemetry"),
                   EngineAllCleared())  # fmt: skip


def test_dp_rank_spellings() -> None:
    for key in ("data_parallel_rank", "attn_dp_rank", "dp_rank"):
        assert decode_batch(msgpack.packb({"ts": 1, "events": [], key: 4})).dp_rank == 4
    assert decode_batch(msgpack.packb({"ts": 1, "events": []})).dp_rank is None


def test_device_medium() -> None:
    assert is_device_medium(None) and is_device_medium("GPU") and is_device_medium("gpu")
    assert not is_device_medium("CPU") and not is_device_medium("DISK")


# ------------------------------------------------------------------------------- hostile
def _ev(**over: Any) -> dict[str, Any]:
    ev: dict[str, Any] = {"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2],
                          "block_size": 2}  # fmt: skip
    ev.update(over)
    return ev


BAD_TREES: list[tuple[Any, str]] = [
    (1, "malformed"),
    ([1], "malformed"),
    (["x", []], "malformed"),
    ([float("nan"), []], "malformed"),
    ([True, []], "malformed"),
    ([0, {}], "malformed"),
    ([0, [], -1], "malformed"),
    ([0, [], True], "malformed"),
    ([0, [1]], "malformed"),
    ([0, [[]]], "malformed"),
    ([0, [{"type": 3}]], "malformed"),
    ([0, [{"block_hashes": [1]}]], "malformed"),
    ([0, [_ev(block_size=True)]], "malformed"),
    ([0, [_ev(block_size=0)]], "malformed"),
    ([0, [_ev(block_size=3)]], "malformed"),
    ([0, [_ev(token_ids=[1, "2"])]], "malformed"),
    ([0, [_ev(token_ids=[1, -2])]], "malformed"),
    ([0, [_ev(token_ids=[1, 2**32])]], "malformed"),
    ([0, [_ev(token_ids="ab")]], "malformed"),
    ([0, [_ev(block_hashes=[1.5])]], "malformed"),
    ([0, [_ev(block_hashes=[b""])]], "malformed"),
    ([0, [_ev(block_hashes=[b"x" * 65])]], "malformed"),
    ([0, [_ev(block_hashes=[True])]], "malformed"),
    ([0, [_ev(block_hashes=7)]], "malformed"),
    ([0, [_ev(parent_block_hash="p")]], "malformed"),
    ([0, [_ev(medium=3)]], "malformed"),
    ([0, [_ev(group_idx=-1)]], "malformed"),
    ([0, [_ev(lora_id="x")]], "malformed"),
    ([0, [_ev(block_size=None, token_ids=[1, 2, 3], block_hashes=[1, 2])]], "malformed"),
    ([0, [["BlockStored", [1], None, [1], 1, None, 5]]], "malformed"),
    ([0, [["BlockRemoved"]]], "malformed"),
]


@pytest.mark.parametrize(("tree", "reason"), BAD_TREES)
def test_wrong_types_are_typed_errors(tree: Any, reason: str) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        decode_batch(msgpack.packb(tree))
    assert info.value.reason == reason


def test_not_bytes_oversized_undecodable() -> None:
    with pytest.raises(RemoteProtocolError) as info:
        decode_batch("text")  # type: ignore[arg-type]
    assert info.value.reason == "frames"
    with pytest.raises(RemoteProtocolError) as info:
        decode_batch(b"\x00" * 200, KvLimits(max_payload_bytes=100))
    assert info.value.reason == "size"
    for junk in (b"", b"\xc1", b"\x93\x01", b"\xd4\x01\x02", b"\x92\x00\x91\xa2\xff\xfe"):
        with pytest.raises(RemoteProtocolError) as info:
            decode_batch(junk)
        assert info.value.reason == "decode"


def test_huge_lists_are_refused_before_or_at_the_budget() -> None:
    claim = b"\x92\x00\xdd\xff\xff\xff\xff"  # an events array claiming 2**32-1 items
    with pytest.raises(RemoteProtocolError):
        decode_batch(claim)
    lim = KvLimits(max_tokens=100, max_hashes=10, max_events=5)
    many_tokens = [0, [_ev(block_hashes=[1], token_ids=list(range(60)), block_size=60)] * 2]
    many_hashes = [0, [["BlockRemoved", list(range(6))]] * 2]
    many_events = [0, [["AllBlocksCleared"]] * 6]
    for tree in (many_tokens, many_hashes, many_events):
        with pytest.raises(RemoteProtocolError) as info:
            decode_batch(msgpack.packb(tree), lim)
        assert info.value.reason == "limit"
    with pytest.raises(RemoteProtocolError):  # deeper than msgpack's stack
        decode_batch(b"\x91" * 100_000 + b"\x00")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=256))
def test_random_bytes_decode_or_raise_the_typed_error(data: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        assert isinstance(decode_batch(data), KvBatch)


_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**64), 2**64 + 5), st.floats(allow_nan=True),
    st.text(max_size=12), st.binary(max_size=70),
    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU"]),
)  # fmt: skip
_KEYS = st.sampled_from(
    ["type", "block_hashes", "token_ids", "block_size", "parent_block_hash", "medium",
     "group_idx", "lora_id", "extra_keys", "ts", "events"]
)  # fmt: skip
_tree = st.recursive(
    _leaf,
    lambda kids: st.one_of(
        st.lists(kids, max_size=8), st.dictionaries(_KEYS, kids, max_size=8)
    ),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ts=_leaf, events=st.lists(_tree, max_size=6), rank=_leaf)
def test_random_trees_in_the_batch_shape_raise_only_the_typed_error(
    ts: Any, events: list[Any], rank: Any
) -> None:
    for tree in ([ts, events, rank], {"ts": ts, "events": events, "dp_rank": rank}):
        try:
            payload = msgpack.packb(tree)
        except (OverflowError, ValueError):
            continue  # not representable in msgpack
        with contextlib.suppress(RemoteProtocolError):
            decode_batch(payload)


# -------------------------------------------------------------------------------- frames
def seqb(n: int) -> bytes:
    return n.to_bytes(8, "big", signed=True)


def test_live_frames() -> None:
    assert decode_live_frames([b"kv", seqb(5), b"p"]) == LiveMessage(b"kv", 5, b"p")
    assert decode_live_frames([b"", seqb(0), b""]) == LiveMessage(b"", 0, b"")
    for bad in ([b"kv", seqb(5)], [b"kv", b"\x00" * 7, b"p"], [b"kv", seqb(-1), b"p"],
                [b"kv", 5, b"p"], ["kv", seqb(1), b"p"]):  # fmt: skip
        with pytest.raises(RemoteProtocolError) as info:
            decode_live_frames(bad)
        assert info.value.reason == "frames"


def test_replay_frames_old_and_new_framing() -> None:
    assert decode_replay_frames([seqb(3), b"p"]) == ReplayMessage(3, b"p")  # older vLLM
    assert decode_replay_frames([b"kv", seqb(3), b"p"]) == ReplayMessage(3, b"p")  # 0.32+
    assert decode_replay_frames([b"", b"kv", seqb(3), b"p"]) == ReplayMessage(3, b"p")
    assert decode_replay_frames([b"", seqb(3), b"p"]) == ReplayMessage(3, b"p")
    assert decode_replay_frames([b"", seqb(-1), b""]) == ReplayEnd()
    assert decode_replay_frames([seqb(-1), b""]) == ReplayEnd()
    assert decode_replay_frames([b"", b"kv", seqb(-1), b""]) == ReplayEnd()
    for bad in ([seqb(3)], [b"", b"", b"", seqb(1), b"p"], [seqb(-2), b"p"],
                [b"x", b"kv", seqb(1), b"p"], [b"12345", b"p"]):  # fmt: skip
        with pytest.raises(RemoteProtocolError):
            decode_replay_frames(bad)


def test_replay_request() -> None:
    assert encode_replay_request(258) == (b"", b"\x00\x00\x00\x00\x00\x00\x01\x02")
    with pytest.raises(ValueError):
        encode_replay_request(-1)


# ---------------------------------------------------------------------------- sequencing
def test_in_order_batches_apply() -> None:
    t: SequenceTracker[str] = SequenceTracker()
    assert t.on_live(0, "a") == [Apply(0, "a")]
    assert t.on_live(1, "b") == [Apply(1, "b")]
    assert t.next_seq == 2 and not t.replaying


def test_a_gap_is_replayed_and_held_batches_follow() -> None:
    t: SequenceTracker[str] = SequenceTracker()
    t.on_live(0, "a")
    assert t.on_live(3, "d") == [RequestReplay(1)]
    assert t.on_live(4, "e") == [] and t.replaying
    assert t.on_replay(0, "a") == [Drop(0, "duplicate")]
    assert t.on_replay(1, "b") == [Apply(1, "b")]
    assert t.on_replay(2, "c") == [Apply(2, "c")]
    assert t.on_replay(3, "d") == [Apply(3, "d")]
    assert t.on_replay_end() == [Drop(3, "duplicate"), Apply(4, "e")]
    assert t.counts["gaps"] == 1 and t.counts["duplicates"] == 2
    assert t.on_replay(5, "x") == [Drop(5, "unexpected_replay")]


def test_a_replay_that_cannot_cover_the_gap_resets() -> None:
    t: SequenceTracker[str] = SequenceTracker()
    t.on_live(0, "a")
    assert t.on_live(10, "k") == [RequestReplay(1)]
    assert t.on_replay(5, "f") == [Reset("replay_incomplete"), Apply(5, "f")]
    # it ended without 6..9: they are gone, the index restarts from what we have
    assert t.on_replay_end() == [Reset("replay_incomplete"), Apply(10, "k")]
    assert t.counts["replay_incomplete"] == 2


def test_a_live_gap_during_a_replay_is_replayed_next() -> None:
    t: SequenceTracker[str] = SequenceTracker()
    t.on_live(0, "a")
    assert t.on_live(2, "c") == [RequestReplay(1)]
    assert t.on_live(4, "e") == []  # 3 lost on the live stream while replaying
    assert t.on_replay(1, "b") == [Apply(1, "b")]
    assert t.on_replay_end() == [Apply(2, "c"), RequestReplay(3)]
    assert t.on_replay(3, "d") == [Apply(3, "d")]
    assert t.on_replay_end() == [Apply(4, "e")]


def test_a_failed_replay_resets_and_applies_what_is_held() -> None:
    t: SequenceTracker[str] = SequenceTracker()
    t.on_live(0, "a")
    t.on_live(2, "c")
    t.on_live(3, "d")
    assert t.on_replay_failed() == [Reset("replay_failed"), Apply(2, "c"), Apply(3, "d")]
    assert t.on_replay_failed() == []


def test_joining_mid_stream_replays_from_zero_without_a_reset() -> None:
    t: SequenceTracker[str] = SequenceTracker()
    assert t.on_live(500, "x") == [RequestReplay(0)]
    assert t.on_replay(400, "w") == [Apply(400, "w")]  # nothing applied yet: nothing to drop


def test_seq_going_backwards_is_a_restart() -> None:
    t: SequenceTracker[str] = SequenceTracker()
    t.on_live(0, "a")
    t.on_live(1, "b")
    assert t.on_live(0, "A") == [Reset("restarted"), Apply(0, "A")]
    t.on_live(1, "B")
    assert t.on_live(1, "again") == [Reset("restarted"), RequestReplay(0)]
    assert t.counts["restarted"] == 2


def test_a_restart_during_a_replay_abandons_it() -> None:
    t: SequenceTracker[str] = SequenceTracker()
    t.on_live(0, "a")
    t.on_live(5, "f")
    assert t.on_live(0, "A") == [Reset("restarted"), Apply(0, "A")]
    assert not t.replaying and t.on_replay_end() == []


def test_too_many_held_batches_give_up_the_replay() -> None:
    t: SequenceTracker[int] = SequenceTracker(max_pending=2)
    t.on_live(0, 0)
    t.on_live(5, 5)
    t.on_live(6, 6)
    assert t.on_live(7, 7) == [Reset("overflow"), Apply(5, 5), Apply(6, 6), Apply(7, 7)]
    with pytest.raises(ValueError):
        SequenceTracker(max_pending=0)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 60),
    lost=st.sets(st.integers(0, 59)),
    keep=st.integers(1, 40),
    fail=st.booleans(),
)
def test_tracker_applies_each_seq_once_in_order_and_resets_when_it_cannot(
    n: int, lost: set[int], keep: int, fail: bool
) -> None:
    """A publisher of n batches, a lossy live stream, a replay buffer of the last `keep`."""
    t: SequenceTracker[int] = SequenceTracker()
    applied: list[int] = []
    resets = 0

    def run(steps: list[OrderStep[int]], published: int) -> None:
        nonlocal resets
        for step in steps:
            if isinstance(step, Apply):
                applied.append(step.seq)
            elif isinstance(step, Reset):
                resets += 1
                applied.append(-1)
            elif isinstance(step, RequestReplay):
                if fail:
                    run(t.on_replay_failed(), published)
                    continue
                start = max(step.start_seq, published - keep)
                for seq in range(start, published):
                    run(t.on_replay(seq, seq), published)
                run(t.on_replay_end(), published)

    for seq in range(n):
        if seq not in lost:
            run(t.on_live(seq, seq), seq + 1)
    run(t.on_replay_end(), n)
    epochs: list[list[int]] = [[]]
    for seq in applied:
        if seq < 0:
            epochs.append([])
        else:
            epochs[-1].append(seq)
    for epoch in epochs:
        assert epoch == sorted(set(epoch))  # within an epoch: increasing, never twice
    delivered_last = max((s for s in range(n) if s not in lost), default=-1)
    if resets == 0 and applied:
        assert applied == list(range(applied[0], delivered_last + 1))
    if keep >= n and not fail:
        assert resets == 0 and applied == list(range(delivered_last + 1))


def test_random_streams_drive_tracker_and_decoder_together() -> None:
    rng = random.Random(7)
    t: SequenceTracker[KvBatch] = SequenceTracker()
    for seq in range(50):
        payload = msgpack.packb([float(seq), [["BlockRemoved", [rng.getrandbits(64)]]], 0])
        msg = decode_live_frames([b"kv", seqb(seq), payload])
        (step,) = t.on_live(msg.seq, decode_batch(msg.payload))
        assert isinstance(step, Apply) and step.item.ts == float(seq)


# ------------------------------------------------------------------- real vLLM 0.32 (captured)
VLLM_FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm_0_32"


def _captured(name: str) -> list[list[bytes]]:
    frames = msgpack.unpackb((VLLM_FIXTURES / name).read_bytes(), raw=False)
    assert frames and all(isinstance(f, list) for f in frames)
    return frames


def test_real_vllm_live_messages_decode_to_map_events() -> None:
    """What vLLM 0.32 (CPU) published: [topic, seq, payload]; a batch [ts, events, rank 0];
    each event a map with "type", None fields present as nil, kv_cache_spec_kind set."""
    frames = _captured("live.msgpack")
    kinds: set[type] = set()
    seqs = []
    for frame in frames:
        msg = decode_live_frames(frame)
        seqs.append(msg.seq)
        raw = msgpack.unpackb(msg.payload, raw=False)
        assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0
        assert all(isinstance(e, dict) and "type" in e for e in raw[1])
        batch = decode_batch(msg.payload)
        assert batch.dp_rank == 0
        for ev in batch.events:
            kinds.add(type(ev))
            if isinstance(ev, EngineBlockStored):
                assert ev.block_size == 128 and ev.medium == "GPU"
                assert ev.spec_kind == "full_attention" and ev.keyed == ()
                assert ev.lora_id is None and ev.group_idx == 0
                assert len(ev.token_ids) == 128 * len(ev.block_hashes)
            elif isinstance(ev, EngineBlockRemoved):
                assert ev.medium == "GPU" and ev.block_hashes
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # one publisher, in order
    assert EngineBlockStored in kinds and EngineBlockRemoved in kinds
    assert UnknownEngineEvent not in kinds


def test_real_vllm_replay_answer_decodes_with_its_end_marker() -> None:
    decoded = [decode_replay_frames(m) for m in _captured("replay.msgpack")]
    assert isinstance(decoded[-1], ReplayEnd)
    body = [d for d in decoded[:-1] if isinstance(d, ReplayMessage)]
    assert len(body) == len(decoded) - 1 and body[0].seq == 0
    assert all(decode_batch(d.payload).dp_rank == 0 for d in body)


def test_spec_kind_is_decoded_and_full_attention_kinds_are_known() -> None:
    ev = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
          "token_ids": [1, 2], "block_size": 2, "kv_cache_spec_kind": "sliding_window"}
    (got,) = decode_batch(msgpack.packb([0.0, [ev], 0])).events
    assert isinstance(got, EngineBlockStored) and got.spec_kind == "sliding_window"
    assert not is_full_attention("sliding_window") and not is_full_attention("mamba")
    assert is_full_attention(None) and is_full_attention("full_attention")
    with pytest.raises(RemoteProtocolError):
        decode_batch(msgpack.packb([0.0, [{**ev, "kv_cache_spec_kind": 3}], 0]))
