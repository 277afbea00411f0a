"""The forward codec: request and reply round trips, framing under any chunking, hostile bytes."""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixmesh.core.codec import Codec, RemoteProtocolError
from radixmesh.core.forward_codec import (
    KIND_ACCEPTED,
    KIND_BUSY,
    KIND_FORWARD_REQUEST,
    KIND_RESULT,
    KIND_TOKENS,
    LINK_FRAME_TYPES,
    LINK_OPEN,
    LINK_REFUSED,
    LINK_REPLY,
    MAX_LINK_STREAM,
    ForwardLimits,
    LinkDecoder,
    LinkFrame,
    ReplyDecoder,
    decode_forward_request,
    decode_link_open,
    decode_link_refused,
    encode_forward_request,
    encode_link_frame,
    encode_link_open,
    encode_link_refused,
    encode_reply,
)
from radixmesh.core.messages import (
    MAX_ERROR_CHARS,
    PROTOCOL_VERSION,
    TOKEN_ID_LIMIT,
    ForwardAdmitted,
    ForwardBusy,
    ForwardError,
    ForwardHeartbeat,
    ForwardReply,
    ForwardRequest,
    ForwardResult,
    ForwardTokens,
)

PROPS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SMALL = ForwardLimits(max_prompt_tokens=64, max_stop_tokens=8, max_frame_bytes=4096)

# ------------------------------------------------------------------------- strategies

token_ids = st.lists(st.integers(0, TOKEN_ID_LIMIT - 1), max_size=40).map(tuple)
node_ids = st.text(min_size=1, max_size=128)
seconds = st.floats(0.0, 1e6, allow_nan=False)
counts = st.integers(0, 2**63 - 1)

requests = st.builds(
    ForwardRequest,
    prompt=st.lists(st.integers(0, TOKEN_ID_LIMIT - 1), min_size=1, max_size=40).map(tuple),
    max_tokens=st.integers(1, 2**63 - 1),
    temperature=st.floats(0.0, 1e3, allow_nan=False),
    top_p=st.floats(0.0, 1.0, exclude_min=True),
    seed=st.none() | st.integers(-(2**63), 2**64 - 1),
    stop_token_ids=token_ids.map(lambda ids: ids[:8]),
    stream=st.booleans(),
    heartbeat_s=st.floats(0.01, 60.0),
    beat_s=st.none() | st.floats(-3600.0, 3600.0),
)
replies: st.SearchStrategy[ForwardReply] = st.one_of(
    st.builds(ForwardBusy, node_ids, seconds, st.none() | seconds),
    st.builds(ForwardAdmitted, node_ids, counts),
    st.just(ForwardHeartbeat()),
    st.builds(ForwardTokens, token_ids),
    st.builds(ForwardResult, token_ids, st.sampled_from(["stop", "length"]), counts, counts,
              seconds, seconds, seconds, st.none() | seconds),
    st.builds(ForwardError, st.text(max_size=MAX_ERROR_CHARS)),
)

REQ = ForwardRequest((1, 2, 3), 8, 0.7, 0.9, 42, (7,), True, 0.5, -0.25)
RESULT = ForwardResult((5, 6), "stop", 3, 2, 0.01, 0.02, 0.05)


def _pack(fields: list[Any]) -> bytes:
    return bytes(msgpack.packb(fields, use_bin_type=True))


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


def _req_fields(req: ForwardRequest = REQ) -> list[Any]:
    fields: list[Any] = msgpack.unpackb(encode_forward_request(req), raw=False)
    return fields


def _reply_fields(msg: ForwardReply) -> list[Any]:
    fields: list[Any] = msgpack.unpackb(encode_reply(msg)[4:], raw=False)
    return fields


def _decode_replies(data: bytes, limits: ForwardLimits | None = None) -> list[ForwardReply]:
    return ReplyDecoder(limits).feed(data)


# ------------------------------------------------------------------------- round trips


@PROPS
@given(req=requests)
def test_request_roundtrip(req: ForwardRequest) -> None:
    assert decode_forward_request(encode_forward_request(req)) == req


@PROPS
@given(msg=replies)
def test_reply_roundtrip(msg: ForwardReply) -> None:
    dec = ReplyDecoder()
    assert dec.feed(encode_reply(msg)) == [msg]
    assert dec.pending_bytes == 0


@PROPS
@given(msgs=st.lists(replies, max_size=8), data=st.data())
def test_any_chunking_decodes_the_same(msgs: list[ForwardReply], data: st.DataObject) -> None:
    stream = b"".join(encode_reply(m) for m in msgs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=12)))
    dec, got = ReplyDecoder(), []
    for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        got.extend(dec.feed(stream[a:b]))
    assert got == msgs
    assert dec.pending_bytes == 0


def test_byte_at_a_time_and_all_at_once() -> None:
    msgs: list[ForwardReply] = [ForwardAdmitted("b", 3), ForwardHeartbeat(),
                                ForwardTokens((5,)), ForwardTokens((6,)), RESULT]
    stream = b"".join(encode_reply(m) for m in msgs)
    dec = ReplyDecoder()
    assert [m for i in range(len(stream)) for m in dec.feed(stream[i : i + 1])] == msgs
    assert _decode_replies(stream) == msgs


@PROPS
@given(msgs=st.lists(replies, min_size=1, max_size=5), data=st.data())
def test_truncated_stream_leaves_pending_bytes(msgs: list[ForwardReply],
                                               data: st.DataObject) -> None:
    stream = b"".join(encode_reply(m) for m in msgs)
    cut = data.draw(st.integers(1, len(encode_reply(msgs[-1]))))
    dec = ReplyDecoder()
    assert dec.feed(stream[:-cut]) == msgs[:-1]
    assert dec.pending_bytes == len(encode_reply(msgs[-1])) - cut


def test_frame_layout_and_field_order() -> None:
    frame = encode_reply(ForwardBusy("n1", 1.5))
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    assert _reply_fields(ForwardBusy("n1", 1.5)) == [PROTOCOL_VERSION, KIND_BUSY, "n1", 1.5]
    # a refusal as slower carries the queue wait as a fifth field; without it, four
    slower = ForwardBusy("n1", 0.0, 0.25)
    assert _reply_fields(slower) == [PROTOCOL_VERSION, KIND_BUSY, "n1", 0.0, 0.25]
    assert ReplyDecoder().feed(encode_reply(slower)) == [slower]
    assert _req_fields()[:4] == [PROTOCOL_VERSION, KIND_FORWARD_REQUEST, [1, 2, 3], 8]


def test_a_result_without_its_first_token_time_is_an_older_peers() -> None:
    """``first_token_s`` is an optional tenth field: a result from a peer that does not
    send it (the old nine-field layout) decodes with None; one that does, with it."""
    old = _reply_fields(RESULT)
    assert len(old) == 9 and _decode_replies(_frame(_pack(old))) == [RESULT]
    new = ForwardResult((5, 6), "stop", 3, 2, 0.01, 0.02, 0.05, 0.015)
    fields = _reply_fields(new)
    assert fields[:9] == old and fields[9] == 0.015
    assert _decode_replies(_frame(_pack(fields))) == [new]


def test_ints_are_accepted_for_floats() -> None:
    fields = _req_fields()
    fields[4], fields[9], fields[10] = 1, 2, -3
    req = decode_forward_request(_pack(fields))
    assert (req.temperature, req.heartbeat_s, req.beat_s) == (1.0, 2.0, -3.0)
    assert all(isinstance(x, float) for x in (req.temperature, req.heartbeat_s, req.beat_s))


def test_limits_are_inclusive() -> None:
    req = ForwardRequest(tuple(range(64)), 1, stop_token_ids=tuple(range(8)))
    assert decode_forward_request(encode_forward_request(req), SMALL) == req
    tokens = ForwardTokens(tuple(range(64)))
    assert _decode_replies(encode_reply(tokens), SMALL) == [tokens]


# -------------------------------------------------------------------- message validation


@pytest.mark.parametrize("kwargs", [
    {"prompt": ()}, {"prompt": (-1,)}, {"prompt": (TOKEN_ID_LIMIT,)}, {"max_tokens": 0},
    {"temperature": -0.1}, {"temperature": math.inf}, {"top_p": 0.0}, {"top_p": 1.01},
    {"top_p": math.nan}, {"heartbeat_s": 0.001}, {"heartbeat_s": 61.0}, {"beat_s": 3601.0},
    {"beat_s": math.nan}, {"seed": 2**64}, {"seed": -(2**63) - 1}, {"stop_token_ids": (-5,)},
])  # fmt: skip
def test_invalid_requests_are_refused_on_construction(kwargs: dict[str, Any]) -> None:
    args: dict[str, Any] = {"prompt": (1,), "max_tokens": 1, **kwargs}
    with pytest.raises(ValueError):
        ForwardRequest(**args)


@pytest.mark.parametrize("build", [
    lambda: ForwardBusy("", 1.0), lambda: ForwardBusy("a", -1.0),
    lambda: ForwardBusy("a", math.inf), lambda: ForwardAdmitted("a", -1),
    lambda: ForwardTokens((2**32,)), lambda: ForwardError("x" * (MAX_ERROR_CHARS + 1)),
    lambda: ForwardResult((), "eos", 1, 0, 0.0, 0.0, 0.0),
    lambda: ForwardResult((), "stop", -1, 0, 0.0, 0.0, 0.0),
    lambda: ForwardResult((), "stop", 1, 0, math.nan, 0.0, 0.0),
    lambda: ForwardResult((), "stop", 1, 0, 0.0, -1.0, 0.0),
    lambda: ForwardResult((), "stop", 1, 0, 0.0, 0.0, 0.0, -0.1),
])  # fmt: skip
def test_invalid_replies_are_refused_on_construction(build: Any) -> None:
    with pytest.raises(ValueError):
        build()


def test_error_truncated() -> None:
    assert ForwardError.truncated("x" * 2000).message == "x" * MAX_ERROR_CHARS
    assert ForwardError.truncated("boom") == ForwardError("boom")


# -------------------------------------------------------------------------- hostile bytes


def _request_rejected(data: Any, limits: ForwardLimits | None = None) -> RemoteProtocolError:
    with pytest.raises(RemoteProtocolError) as info:
        decode_forward_request(data, limits)
    assert info.value.reason
    return info.value


def _reply_rejected(data: bytes, limits: ForwardLimits | None = None) -> RemoteProtocolError:
    with pytest.raises(RemoteProtocolError) as info:
        ReplyDecoder(limits).feed(data)
    assert info.value.reason
    return info.value


def _with(fields: list[Any], i: int, value: Any) -> bytes:
    copy = list(fields)
    copy[i] = value
    return _pack(copy)


REQUEST_HOSTILE = [  # (field index, value)
    (2, []), (2, [True]), (2, [-1]), (2, [2**32]), (2, [1.0]), (2, "abc"), (2, None),
    (3, True), (3, 0), (3, -1), (3, 1.5), (3, None),
    (4, float("nan")), (4, float("inf")), (4, -1.0), (4, True), (4, "0"),
    (5, 0.0), (5, 1.5), (5, float("nan")), (5, False),
    (6, True), (6, 1.5), (6, "7"),
    (7, [True]), (7, [-3]), (7, None), (7, [1] * 9),
    (8, 1), (8, None), (8, "true"),
    (9, 0.0), (9, 100.0), (9, float("inf")), (9, None), (9, True),
    (10, 3601.0), (10, float("-inf")), (10, float("nan")), (10, True), (10, "1"),
]  # fmt: skip


@pytest.mark.parametrize(("index", "value"), REQUEST_HOSTILE)
def test_hostile_request_fields(index: int, value: Any) -> None:
    _request_rejected(_with(_req_fields(), index, value), SMALL)


def test_request_header_and_shape() -> None:
    fields = _req_fields()
    assert _request_rejected(_with(fields, 0, PROTOCOL_VERSION + 1)).reason == "version"
    assert _request_rejected(_with(fields, 0, True)).reason == "decode"
    for kind in (1, KIND_BUSY, 99, -1, True):
        _request_rejected(_with(fields, 1, kind))
    _request_rejected(_pack([*fields, "t", 0]))  # extra field (after the optional tenant)
    _request_rejected(_pack(fields[:-1]))  # missing field (the adapter)
    _request_rejected(_pack({"prompt_ids": [1]}))
    good = encode_forward_request(REQ)
    for data in (b"", b"\xc1", good[:-1], good + b"\0", "text", None, 17):
        _request_rejected(data)


def test_oversize_request() -> None:
    too_long = ForwardRequest(tuple(range(65)), 1)
    _request_rejected(encode_forward_request(too_long), SMALL)
    big = ForwardRequest((2**31,) * 2000, 1)  # 5 bytes an id: over max_frame_bytes
    assert _request_rejected(encode_forward_request(big), SMALL).reason == "size"


REPLY_HOSTILE: list[tuple[ForwardReply, int, Any]] = [
    (ForwardBusy("a", 1.0), 2, ""), (ForwardBusy("a", 1.0), 2, "x" * 129),
    (ForwardBusy("a", 1.0), 2, 5), (ForwardBusy("a", 1.0), 3, -0.5),
    (ForwardBusy("a", 1.0), 3, float("nan")), (ForwardBusy("a", 1.0), 3, True),
    (ForwardBusy("a", 0.0, 1.0), 4, -0.5), (ForwardBusy("a", 0.0, 1.0), 4, float("inf")),
    (ForwardBusy("a", 0.0, 1.0), 4, None), (ForwardBusy("a", 0.0, 1.0), 4, "1"),
    (ForwardAdmitted("a", 1), 3, True), (ForwardAdmitted("a", 1), 3, -1),
    (ForwardAdmitted("a", 1), 3, 1.0), (ForwardAdmitted("a", 1), 2, None),
    (ForwardTokens((1,)), 2, [True]), (ForwardTokens((1,)), 2, [-1]),
    (ForwardTokens((1,)), 2, [2**32]), (ForwardTokens((1,)), 2, [1] * 65),
    (ForwardTokens((1,)), 2, b"\x01"), (ForwardTokens((1,)), 2, [[1]]),
    (RESULT, 2, [False]), (RESULT, 3, "eos"), (RESULT, 3, ""), (RESULT, 3, "stop" * 10),
    (RESULT, 4, True), (RESULT, 5, -2), (RESULT, 6, float("nan")),
    (RESULT, 7, float("inf")), (RESULT, 8, -1.0), (RESULT, 8, None),
    (ForwardError("e"), 2, "x" * (MAX_ERROR_CHARS + 1)), (ForwardError("e"), 2, None),
]  # fmt: skip


@pytest.mark.parametrize(("msg", "index", "value"), REPLY_HOSTILE)
def test_hostile_reply_fields(msg: ForwardReply, index: int, value: Any) -> None:
    _reply_rejected(_frame(_with(_reply_fields(msg), index, value)), SMALL)


def test_reply_header_and_shape() -> None:
    fields = _reply_fields(ForwardAdmitted("a", 1))
    assert _reply_rejected(_frame(_with(fields, 0, 0))).reason == "version"
    for kind in (KIND_FORWARD_REQUEST, 1, 0, 9, 255, True, "accepted", None):
        _reply_rejected(_frame(_with(fields, 1, kind)))
    _reply_rejected(_frame(_pack([*fields, 1])))
    _reply_rejected(_frame(_pack(fields[:-1])))
    _reply_rejected(_frame(_pack([PROTOCOL_VERSION, KIND_TOKENS])))
    _reply_rejected(_frame(_pack([PROTOCOL_VERSION, KIND_RESULT, [], "stop"])))
    _reply_rejected(_frame(_pack([PROTOCOL_VERSION, KIND_ACCEPTED])))
    _reply_rejected(_frame(b""))  # an empty payload
    _reply_rejected(_frame(b"\xc1"))
    _reply_rejected(_frame(encode_reply(RESULT)[4:] + b"\0"))  # trailing bytes in the payload
    _reply_rejected(_frame(_pack([PROTOCOL_VERSION])))


def test_oversize_length_prefix_is_refused_before_its_payload() -> None:
    dec = ReplyDecoder(SMALL)
    assert dec.feed(encode_reply(ForwardHeartbeat())) == [ForwardHeartbeat()]
    with pytest.raises(RemoteProtocolError) as info:
        dec.feed((SMALL.max_frame_bytes + 1).to_bytes(4, "big"))  # header alone
    assert info.value.reason == "size"
    assert _reply_rejected(b"\xff\xff\xff\xff").reason == "size"


def test_failure_is_sticky() -> None:
    dec = ReplyDecoder()
    with pytest.raises(RemoteProtocolError):
        dec.feed(_frame(b"\xc1"))
    with pytest.raises(RemoteProtocolError):
        dec.feed(encode_reply(ForwardHeartbeat()))


def test_valid_frames_then_garbage() -> None:
    dec = ReplyDecoder()
    assert dec.feed(encode_reply(ForwardAdmitted("a", 0))) == [ForwardAdmitted("a", 0)]
    with pytest.raises(RemoteProtocolError):
        dec.feed(encode_reply(ForwardHeartbeat()) + _frame(b"\x93\x01\x05"))


def test_gossip_and_forward_kinds_do_not_mix() -> None:
    with pytest.raises(RemoteProtocolError):
        Codec().decode(encode_forward_request(REQ))
    with pytest.raises(RemoteProtocolError):
        Codec().decode(encode_reply(ForwardHeartbeat())[4:])
    _reply_rejected(_frame(encode_forward_request(REQ)))


def test_deep_nesting_is_refused() -> None:
    deep = b"\x91" * 100_000 + b"\xc0"
    _request_rejected(b"\x93\x01\x02" + deep)
    _reply_rejected(_frame(b"\x93\x01\x06" + deep))


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=512), chunk=st.integers(1, 64))
def test_random_bytes_only_raise_remote_protocol_error(data: bytes, chunk: int) -> None:
    with contextlib.suppress(RemoteProtocolError):
        decode_forward_request(data, SMALL)
    dec = ReplyDecoder(SMALL)
    with contextlib.suppress(RemoteProtocolError):
        for i in range(0, len(data), chunk):
            dec.feed(data[i : i + chunk])


def test_large_prompt_at_the_default_limit() -> None:
    n = ForwardLimits().max_prompt_tokens
    req = ForwardRequest(tuple(i % 150_000 for i in range(n)), 1)
    assert decode_forward_request(encode_forward_request(req)) == req
    over = _req_fields(req)
    over[2].append(1)
    _request_rejected(_pack(over))


# ---------------------------------------------------------------------------------- links
link_frames = st.builds(
    LinkFrame,
    stream=st.integers(0, MAX_LINK_STREAM),
    type=st.sampled_from(sorted(LINK_FRAME_TYPES)),
    body=st.binary(max_size=64),
)


@given(frames=st.lists(link_frames, max_size=8), data=st.data())
def test_link_frames_survive_any_chunking(frames: list[LinkFrame], data: st.DataObject) -> None:
    wire = b"".join(encode_link_frame(f.stream, f.type, f.body) for f in frames)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=6)))
    decoder, out = LinkDecoder(), []
    for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True):
        out += decoder.feed(wire[a:b])
    assert out == frames and decoder.pending_bytes == 0


def test_link_frame_layout() -> None:
    assert encode_link_frame(7, LINK_REPLY, b"ab") == (
        b"\x00\x00\x00\x02" b"\x00\x00\x00\x07" b"\x03" b"ab")
    for stream, kind in ((-1, LINK_OPEN), (MAX_LINK_STREAM + 1, LINK_OPEN), (1, 99)):
        with pytest.raises(ValueError):
            encode_link_frame(stream, kind)


@given(token=st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=200),
       request=st.binary(max_size=64))
def test_link_open_roundtrip(token: str, request: bytes) -> None:
    [frame] = LinkDecoder().feed(encode_link_open(3, token, request))
    assert (frame.stream, frame.type) == (3, LINK_OPEN)
    assert decode_link_open(frame.body) == (token, request)


@pytest.mark.parametrize("body", [b"", b"\x00", b"\x00\x05abc", b"\x04\x01" + b"x" * 1100,
                                  b"\x00\x02\xff\xfe"])
def test_bad_link_open_bodies_are_refused(body: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_link_open(body)


def test_link_refusal_roundtrip_and_hostile_bodies() -> None:
    [frame] = LinkDecoder().feed(encode_link_refused(5, 403, "no"))
    assert frame.type == LINK_REFUSED and decode_link_refused(frame.body) == (403, "no")
    hostile = [b"", b"\xc1", msgpack.packb([403]), msgpack.packb([99, "x"]),
               msgpack.packb(["403", "x"]), msgpack.packb([403, 5]), msgpack.packb({"a": 1})]
    for body in hostile:
        with pytest.raises(RemoteProtocolError):
            decode_link_refused(body)


def test_link_decoder_refuses_unknown_types_and_oversize_bodies_before_buffering() -> None:
    with pytest.raises(RemoteProtocolError):
        LinkDecoder().feed(b"\x00\x00\x00\x00\x00\x00\x00\x01\x63")
    small = LinkDecoder(ForwardLimits(max_frame_bytes=16))
    with pytest.raises(RemoteProtocolError) as err:
        small.feed(b"\x00\x00\x00\x11\x00\x00\x00\x01\x03")  # 17 bytes announced, none sent
    assert err.value.reason == "size"
    with pytest.raises(RemoteProtocolError):
        small.feed(b"")  # sticky


@given(data=st.binary(max_size=512), chunk=st.integers(1, 64))
def test_random_bytes_on_a_link_only_raise_remote_protocol_error(data: bytes,
                                                                 chunk: int) -> None:
    decoder = LinkDecoder(ForwardLimits(max_frame_bytes=256))
    with contextlib.suppress(RemoteProtocolError):
        for i in range(0, len(data), chunk):
            for frame in decoder.feed(data[i : i + chunk]):
                if frame.type == LINK_OPEN:
                    with contextlib.suppress(RemoteProtocolError):
                        decode_link_open(frame.body)
                if frame.type == LINK_REFUSED:
                    with contextlib.suppress(RemoteProtocolError):
                        decode_link_refused(frame.body)


def test_the_tenants_quota_key_travels_with_a_forward() -> None:
    """core/quotas.py: the receiver checks the tenant's share by the key the forward carries
    (a keyed hash); a key that is no string, or too long, is refused."""
    req = ForwardRequest((1, 2), 4, namespace="n" * 32, tenant="t" * 32)
    assert decode_forward_request(encode_forward_request(req)).tenant == "t" * 32
    for bad in (7, "", "x" * 257):
        fields = _req_fields(req)
        fields[14] = bad
        _request_rejected(_pack(fields))
    _request_rejected(_pack([*_req_fields(req), "t"]))  # 16 fields: refused


def test_a_forward_of_the_previous_build_decodes() -> None:
    """docs/reliability.md: within a version a rolling restart is safe. The tenant is the
    optional fifteenth field: a 14-field request (the previous build's) decodes with no
    tenant, and one without a tenant is sent as 14 fields, which that build decodes."""
    req = ForwardRequest((1, 2), 4, namespace="n" * 32, session=9, adapter="a" * 16)
    old = _req_fields(req)
    assert len(old) == 14
    assert decode_forward_request(_pack(old)) == req
    assert decode_forward_request(_pack([*old, None])) == req  # an explicit nil: no tenant
    assert len(_req_fields(replace(req, tenant="t" * 32))) == 15
    with pytest.raises(ValueError, match="tenant"):
        ForwardRequest((1,), 1, tenant="")
