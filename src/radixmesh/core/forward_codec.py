"""The codec of forwarded requests and their replies: msgpack arrays, framed replies.

Theory of operation
-------------------
Like gossip (:mod:`codec`), each message is a msgpack array ``[PROTOCOL_VERSION, KIND, field,
...]`` with fields in declaration order; the kinds are listed below. The request is the body
of ``POST /peer/forward``; the replies stream back in the response body, each as one *frame*:
a 4-byte big-endian payload length, then the msgpack payload. :class:`ReplyDecoder` cuts any
chunking of that stream back into messages.

Decoding treats every byte as hostile and uses the gossip codec's checked readers: msgpack's
limits bound every string and array before it is allocated, a length prefix above
``max_frame_bytes`` is refused before its payload is buffered, each field is type-checked
(bools are not ints, floats are finite, token ids are ints) and each message then validates
its own values on construction. Anything wrong raises :class:`RemoteProtocolError`, only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgpack

from radixmesh.core.checked import (
    RemoteProtocolError,
    check_array,
    check_bool,
    check_float,
    check_int,
    check_text,
    checked,
    unpack_checked,
)
from radixmesh.core.messages import (
    MAX_ERROR_CHARS,
    MAX_NAMESPACE_CHARS,
    PROTOCOL_VERSION,
    SEED_MAX,
    SEED_MIN,
    ForwardAdmitted,
    ForwardBusy,
    ForwardError,
    ForwardHeartbeat,
    ForwardReply,
    ForwardRequest,
    ForwardResult,
    ForwardTokens,
)

KIND_FORWARD_REQUEST, KIND_BUSY, KIND_ACCEPTED, KIND_HEARTBEAT = 2, 3, 4, 5
KIND_TOKENS, KIND_RESULT, KIND_ERROR = 6, 7, 8

FRAME_HEADER_BYTES = 4  # big-endian payload length
T = TypeVar("T")
_U64_MAX, _MAX_FINISH_LEN = 2**64 - 1, 16


@dataclass(frozen=True, slots=True)
class ForwardLimits:
    """Hard limits on what a peer may send in a forward or its replies."""

    max_prompt_tokens: int = 1_048_576  # prompt ids, output ids, ids in one tokens frame
    max_stop_tokens: int = 4096
    max_frame_bytes: int = 64 * 1024 * 1024  # one request body or one reply payload
    max_id_len: int = 128  # node ids, in characters

    def __post_init__(self) -> None:
        sizes = (self.max_prompt_tokens, self.max_stop_tokens, self.max_frame_bytes)
        if min(*sizes, self.max_id_len) < 1:
            raise ValueError("limits must be positive")


# ------------------------------------------------------------------------------- request
def encode_forward_request(req: ForwardRequest) -> bytes:
    """The request body: ``[version, kind, prompt, max_tokens, ..., adapter, tenant?]``."""
    fields = [
        PROTOCOL_VERSION,
        KIND_FORWARD_REQUEST,
        req.prompt,
        req.max_tokens,
        float(req.temperature),
        float(req.top_p),
        req.seed,
        req.stop_token_ids,
        req.stream,
        float(req.heartbeat_s),
        None if req.beat_s is None else float(req.beat_s),
        req.namespace,
        req.session,
        req.adapter,
    ]
    return _pack(fields if req.tenant is None else [*fields, req.tenant])  # else 14, as before


def decode_forward_request(data: bytes, limits: ForwardLimits | None = None) -> ForwardRequest:
    """Parse a request body; raises :class:`RemoteProtocolError` (only) if it is not valid."""
    lim = limits or ForwardLimits()
    kind, f = _message(data, lim)
    if kind != KIND_FORWARD_REQUEST:
        raise RemoteProtocolError(f"not a forward request: kind {kind}")
    return checked(lambda raw: _request(raw, lim), f)


def _request(f: list[Any], lim: ForwardLimits) -> ForwardRequest:
    check_array(f, 15 if len(f) == 15 else 14, "forward request")  # tenant: optional 15th
    tenant = f[14] if len(f) == 15 else None
    return ForwardRequest(
        prompt=_ids(f[2], lim.max_prompt_tokens, "prompt"),
        max_tokens=check_int(f[3], "max_tokens"),
        temperature=check_float(f[4], "temperature"),
        top_p=check_float(f[5], "top_p"),
        seed=None if f[6] is None else check_int(f[6], "seed", SEED_MAX, SEED_MIN),
        stop_token_ids=_ids(f[7], lim.max_stop_tokens, "stop_token_ids"),
        stream=check_bool(f[8], "stream"),
        heartbeat_s=check_float(f[9], "heartbeat_s"),
        beat_s=None if f[10] is None else check_float(f[10], "beat_s"),
        namespace=None if f[11] is None else check_text(f[11], MAX_NAMESPACE_CHARS, "namespace"),
        session=None if f[12] is None else check_int(f[12], "session", _U64_MAX),
        adapter=None if f[13] is None else check_text(f[13], 64, "adapter", 16),
        tenant=None if tenant is None else check_text(tenant, MAX_NAMESPACE_CHARS, "tenant"),
    )


# ------------------------------------------------------------------------------- replies
def encode_reply(msg: ForwardReply) -> bytes:
    """One frame: the 4-byte big-endian payload length, then the msgpack payload."""
    payload = _pack([PROTOCOL_VERSION, *_reply_fields(msg)])
    return len(payload).to_bytes(FRAME_HEADER_BYTES, "big") + payload


def _reply_fields(msg: ForwardReply) -> list[Any]:
    match msg:
        case ForwardBusy():  # queue_s only when set: a refusal by state keeps the old layout
            busy = [KIND_BUSY, msg.node_id, float(msg.retry_after_s)]
            return busy if msg.queue_s is None else [*busy, float(msg.queue_s)]
        case ForwardAdmitted():
            return [KIND_ACCEPTED, msg.node_id, msg.cached_tokens]
        case ForwardHeartbeat():
            return [KIND_HEARTBEAT]
        case ForwardTokens():
            return [KIND_TOKENS, msg.ids]
        case ForwardResult():
            first = [] if msg.first_token_s is None else [float(msg.first_token_s)]  # optional
            timings = [float(msg.queue_s), float(msg.service_s), float(msg.handler_s), *first]
            return [KIND_RESULT, msg.output_ids, msg.finish_reason, msg.prompt_tokens,
                    msg.cached_tokens, *timings]
        case ForwardError():
            return [KIND_ERROR, msg.message]
    raise TypeError(f"not a forward reply: {type(msg).__name__}")


def _busy(f: list[Any], lim: ForwardLimits) -> ForwardBusy:
    check_array(f, 5 if len(f) == 5 else 4, "busy")  # queue_s is the optional fifth
    node_id = check_text(f[2], lim.max_id_len, "busy node id")
    queue_s = check_float(f[4], "queue_s") if len(f) == 5 else None
    return ForwardBusy(node_id, check_float(f[3], "retry_after_s"), queue_s)


def _accepted(f: list[Any], lim: ForwardLimits) -> ForwardAdmitted:
    check_array(f, 4, "accepted")
    node_id = check_text(f[2], lim.max_id_len, "accepted node id")
    return ForwardAdmitted(node_id, check_int(f[3], "cached_tokens"))


def _heartbeat(f: list[Any], lim: ForwardLimits) -> ForwardHeartbeat:
    check_array(f, 2, "heartbeat")
    return ForwardHeartbeat()


def _tokens(f: list[Any], lim: ForwardLimits) -> ForwardTokens:
    check_array(f, 3, "tokens")
    return ForwardTokens(_ids(f[2], lim.max_prompt_tokens, "ids"))


def _result(f: list[Any], lim: ForwardLimits) -> ForwardResult:
    check_array(f, 10 if len(f) == 10 else 9, "result")  # first_token_s is the optional tenth
    return ForwardResult(
        output_ids=_ids(f[2], lim.max_prompt_tokens, "output_ids"),
        finish_reason=check_text(f[3], _MAX_FINISH_LEN, "finish_reason"),
        prompt_tokens=check_int(f[4], "prompt_tokens"),
        cached_tokens=check_int(f[5], "cached_tokens"),
        queue_s=check_float(f[6], "queue_s"),
        service_s=check_float(f[7], "service_s"),
        handler_s=check_float(f[8], "handler_s"),
        first_token_s=check_float(f[9], "first_token_s") if len(f) == 10 else None,
    )


def _error(f: list[Any], lim: ForwardLimits) -> ForwardError:
    check_array(f, 3, "error")
    return ForwardError(check_text(f[2], MAX_ERROR_CHARS, "error message", minimum=0))


_REPLIES: dict[int, Callable[[list[Any], ForwardLimits], ForwardReply]] = {
    KIND_BUSY: _busy,
    KIND_ACCEPTED: _accepted,
    KIND_HEARTBEAT: _heartbeat,
    KIND_TOKENS: _tokens,
    KIND_RESULT: _result,
    KIND_ERROR: _error,
}


class _Stream(Generic[T]):
    """A byte stream fed in chunks of any size and cut into items by :meth:`_cut`; the first
    :class:`RemoteProtocolError` is sticky (every later ``feed`` raises it again)."""

    def __init__(self, limits: ForwardLimits | None = None) -> None:
        self.limits = limits or ForwardLimits()
        self._buf = bytearray()
        self._failed: RemoteProtocolError | None = None

    @property
    def pending_bytes(self) -> int:
        """Bytes received that do not yet complete a frame (0 at a frame boundary)."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[T]:
        if self._failed is not None:
            raise self._failed
        self._buf += data
        try:
            out, used = self._cut(self._buf)
        except RemoteProtocolError as exc:
            self._failed = exc
            raise
        del self._buf[:used]
        return out

    def _cut(self, buf: bytearray) -> tuple[list[T], int]:
        """The complete items at the start of ``buf`` and the bytes they take."""
        raise NotImplementedError


class ReplyDecoder(_Stream[ForwardReply]):
    """Cuts a reply stream, fed in chunks of any size, back into messages.

    ``feed`` returns the messages completed by ``data`` and raises :class:`RemoteProtocolError`
    on an oversize length prefix or an invalid payload; after that the stream is unusable and
    every later ``feed`` raises the same error. It does not check the order of replies. At the
    end of the body, ``pending_bytes`` > 0 means the stream was cut inside a frame.
    """

    def _cut(self, buf: bytearray) -> tuple[list[ForwardReply], int]:
        pos = 0
        out: list[ForwardReply] = []
        while len(buf) - pos >= FRAME_HEADER_BYTES:
            size = int.from_bytes(buf[pos : pos + FRAME_HEADER_BYTES], "big")
            if size > self.limits.max_frame_bytes:
                raise RemoteProtocolError(f"reply frame of {size} bytes exceeds the limit", "size")
            end = pos + FRAME_HEADER_BYTES + size
            if len(buf) < end:
                break
            out.append(_reply(bytes(buf[pos + FRAME_HEADER_BYTES : end]), self.limits))
            pos = end
        return out, pos


def _reply(payload: bytes, lim: ForwardLimits) -> ForwardReply:
    kind, f = _message(payload, lim)
    parse = _REPLIES.get(kind)
    if parse is None:
        raise RemoteProtocolError(f"unknown reply kind {kind}")
    return checked(lambda raw: parse(raw, lim), f)


def _pack(fields: list[Any]) -> bytes:
    return bytes(msgpack.packb(fields, use_bin_type=True))


def _message(data: bytes, lim: ForwardLimits) -> tuple[int, list[Any]]:
    """Unpack ``data`` within the limits; check its version; return its kind and fields."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise RemoteProtocolError("message is not bytes")
    if len(data) > lim.max_frame_bytes:
        raise RemoteProtocolError(f"message of {len(data)} bytes exceeds the limit", "size")
    max_str = 4 * max(lim.max_id_len, MAX_ERROR_CHARS)  # characters -> UTF-8 bytes
    max_array = max(lim.max_prompt_tokens, lim.max_stop_tokens, 16)
    raw = unpack_checked(bytes(data), max_str=max_str, max_bin=0, max_array=max_array)
    if not isinstance(raw, list) or len(raw) < 2:
        raise RemoteProtocolError("message: expected an array [version, kind, ...]")
    if check_int(raw[0], "protocol version") != PROTOCOL_VERSION:
        raise RemoteProtocolError(f"unsupported protocol version {raw[0]}", "version")
    return check_int(raw[1], "kind"), raw


def _ids(v: Any, limit: int, what: str) -> tuple[int, ...]:
    """A list of at most ``limit`` ints (their range is checked by the message itself).
    Exactly ``int`` (not ``bool``), checked by the set of the items' types: half the time of
    a generator over the items (~30 µs less for 1,500 ids), paid on every forward."""
    if not isinstance(v, list) or len(v) > limit or not {*map(type, v)} <= _INT_ONLY:
        raise RemoteProtocolError(f"{what}: expected a list of at most {limit} token ids")
    return tuple(v)


_INT_ONLY = frozenset({int})


# ---------------------------------------------------------------------------------- link
# A *link* carries many forwards over one long-lived exchange between two nodes (the entry
# node's request body one way, the peer's response body the other): each frame is a 9-byte
# header (the body's length, the forward's stream id, the frame type, big-endian) then the
# body. The bodies are what the per-forward exchange would have carried: OPEN the request
# (after its authentication token), REPLY bytes of the framed replies (cut anywhere: the
# receiving stream feeds them to its own ReplyDecoder), REFUSED the HTTP status and detail the
# per-forward exchange would have answered with. HELLO (stream 0) opens a link; CANCEL
# abandons a forward (the peer aborts its work); END closes a stream, normally after its
# final reply.
LINK_HELLO = 0
LINK_OPEN = 1
LINK_CANCEL = 2
LINK_REPLY = 3
LINK_END = 4
LINK_REFUSED = 5
LINK_FRAME_TYPES = frozenset({LINK_HELLO, LINK_OPEN, LINK_CANCEL, LINK_REPLY, LINK_END,
                              LINK_REFUSED})
LINK_HEADER_BYTES = 9
MAX_LINK_STREAM = 2**32 - 1
_MAX_TOKEN_BYTES = 1024  # an authentication token in an OPEN


@dataclass(frozen=True, slots=True)
class LinkFrame:
    stream: int
    type: int
    body: bytes


def encode_link_frame(stream: int, kind: int, body: bytes = b"") -> bytes:
    """One link frame; ``stream`` in 0..2**32-1, ``kind`` one of the ``LINK_*`` types."""
    if not 0 <= stream <= MAX_LINK_STREAM or kind not in LINK_FRAME_TYPES:
        raise ValueError(f"bad link frame: stream {stream}, type {kind}")
    return (len(body).to_bytes(4, "big") + stream.to_bytes(4, "big") + bytes((kind,))
            + body)


def encode_link_open(stream: int, token: str, request: bytes) -> bytes:
    """OPEN: the 2-byte length of ``token`` (the request's authentication, "" without a
    cluster key), the token, then the encoded :class:`ForwardRequest`."""
    raw = token.encode("ascii")
    if len(raw) > _MAX_TOKEN_BYTES:
        raise ValueError("authentication token too long")
    return encode_link_frame(stream, LINK_OPEN, len(raw).to_bytes(2, "big") + raw + request)


def decode_link_open(body: bytes) -> tuple[str, bytes]:
    """The token and the request bytes of an OPEN body (the request is decoded by
    :func:`decode_forward_request`); :class:`RemoteProtocolError` if cut short."""
    if len(body) < 2:
        raise RemoteProtocolError("link open: no token length")
    size = int.from_bytes(body[:2], "big")
    if size > _MAX_TOKEN_BYTES or len(body) < 2 + size:
        raise RemoteProtocolError("link open: bad token length")
    try:
        token = body[2 : 2 + size].decode("ascii")
    except UnicodeDecodeError:
        raise RemoteProtocolError("link open: token is not ASCII") from None
    return token, body[2 + size :]


def encode_link_refused(stream: int, status: int, detail: str) -> bytes:
    """REFUSED: ``[status, detail]`` in msgpack (the detail cut to the error length)."""
    return encode_link_frame(stream, LINK_REFUSED, _pack([status, detail[:MAX_ERROR_CHARS]]))


def decode_link_refused(body: bytes) -> tuple[int, str]:
    raw = unpack_checked(body, max_str=4 * MAX_ERROR_CHARS, max_bin=0, max_array=2)
    if not isinstance(raw, list):
        raise RemoteProtocolError("link refusal: expected [status, detail]")
    check_array(raw, 2, "link refusal")
    status = check_int(raw[0], "status", 599, 100)
    return status, check_text(raw[1], MAX_ERROR_CHARS, "detail", minimum=0)


class LinkDecoder(_Stream[LinkFrame]):
    """Cuts a link's byte stream, fed in chunks of any size, into :class:`LinkFrame` s.

    Raises :class:`RemoteProtocolError` on an unknown frame type or a body above
    ``max_frame_bytes`` (before buffering it); the link is then unusable, and every later
    ``feed`` raises the same error."""

    def _cut(self, buf: bytearray) -> tuple[list[LinkFrame], int]:
        pos = 0
        out: list[LinkFrame] = []
        while len(buf) - pos >= LINK_HEADER_BYTES:
            size = int.from_bytes(buf[pos : pos + 4], "big")
            kind = buf[pos + 8]
            if size > self.limits.max_frame_bytes:
                raise RemoteProtocolError(f"link frame of {size} bytes exceeds the limit", "size")
            if kind not in LINK_FRAME_TYPES:
                raise RemoteProtocolError(f"unknown link frame type {kind}")
            end = pos + LINK_HEADER_BYTES + size
            if len(buf) < end:
                break
            stream = int.from_bytes(buf[pos + 4 : pos + 8], "big")
            out.append(LinkFrame(stream, kind, bytes(buf[pos + LINK_HEADER_BYTES : end])))
            pos = end
        return out, pos
