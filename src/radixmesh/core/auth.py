"""Peer authentication: HMAC-SHA256 over each peer message, with a timestamp and a nonce.

Theory of operation
-------------------
Every node of one cluster shares a secret (the *cluster key*). A sender attaches one header
to every peer message (gossip, forwarded requests)::

    v1;kid=<8 hex>;node=<sender id>;ts=<unix ms>;nonce=<32 hex>;mac=<64 hex>

``mac`` is HMAC-SHA256, under a key derived from the secret, over the length-prefixed fields
``(version, purpose, kid, node, ts, nonce, body)``. ``purpose`` names what the message is for
(``"gossip"``, ``"forward /v1/completions"``), so a body signed for one endpoint cannot be
replayed against another. The receiver checks, in this order::

    parse header ──► kid known? ──► |now - ts| <= max_skew? ──► mac equal? ──► nonce unseen?
     Malformed        UnknownKey      StaleTimestamp              BadSignature   ReplayedNonce

and only then remembers the nonce. The MAC is compared in constant time.

Replay cache. A nonce must be remembered only while its timestamp is still inside the skew
window: once ``ts < now - max_skew`` the timestamp check alone rejects it. The cache is a dict
``nonce -> ts`` plus a min-heap on ``ts``; expired entries are dropped on every call. If it
still holds ``capacity`` entries, the *oldest* entry is evicted and ``floor`` is raised to its
timestamp; any message with ``ts <= floor`` is then rejected as stale. Memory is bounded and no
replay is ever accepted; the price of an overflowing cache is that slightly delayed, genuine
messages are refused (and counted), never that a replay gets through. Only messages whose MAC
verified enter the cache, so an attacker without the key cannot fill it.

Key rotation. A verifier accepts several keys (current first); ``kid`` (a short digest of the
key, not secret) selects which. Rotate by deploying ``[new, old]`` everywhere, then signing
with ``new``, then dropping ``old``.

This module is pure: the clock (``now``, Unix seconds on the caller's wall clock) and the
nonce bytes are arguments. It owns no I/O, threads or globals.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

VERSION = "v1"
NONCE_BYTES = 16
MIN_SECRET_BYTES = 16
_KID_HEX = 8
_MAC_HEX = 64
_NODE_RE = re.compile(r"[A-Za-z0-9._:@\-]{1,128}")
_HEX_RE = re.compile(r"[0-9a-f]+")
_FIELDS = ("kid", "node", "ts", "nonce", "mac")

# ------------------------------------------------------------------------------- errors


class AuthError(Exception):
    """A peer message failed authentication. ``reason`` is a short metric label."""

    reason = "auth_error"
    http_status = 403


class MissingAuth(AuthError):
    reason = "missing"
    http_status = 401


class MalformedAuth(AuthError):
    reason = "malformed"
    http_status = 401


class UnknownKey(AuthError):
    reason = "unknown_key"


class StaleTimestamp(AuthError):
    reason = "stale"


class BadSignature(AuthError):
    reason = "bad_signature"


class ReplayedNonce(AuthError):
    reason = "replayed"


AUTH_FAILURE_REASONS: tuple[str, ...] = tuple(
    cls.reason
    for cls in (MissingAuth, MalformedAuth, UnknownKey, StaleTimestamp, BadSignature, ReplayedNonce)
)

# ---------------------------------------------------------------------------------- keys


@dataclass(frozen=True, slots=True)
class ClusterKey:
    """A cluster secret. ``kid`` identifies it publicly; ``mac_key`` is what HMAC uses."""

    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_SECRET_BYTES:
            raise ValueError(f"cluster key must be at least {MIN_SECRET_BYTES} bytes")

    @classmethod
    def from_text(cls, text: str) -> ClusterKey:
        """A key from its text form (flag, environment, config file); whitespace stripped."""
        return cls(text.strip().encode("utf-8"))

    @property
    def kid(self) -> str:
        return hashlib.sha256(b"radixmesh-kid\x00" + self.secret).hexdigest()[:_KID_HEX]

    @property
    def mac_key(self) -> bytes:
        return hmac.new(self.secret, b"radixmesh peer auth v1", hashlib.sha256).digest()


# ------------------------------------------------------------------------------- tokens


@dataclass(frozen=True, slots=True)
class AuthToken:
    """The parsed header. ``ts_ms`` is the sender's Unix time in milliseconds."""

    kid: str
    node: str
    ts_ms: int
    nonce: str  # hex
    mac: str  # hex

    def encode(self) -> str:
        return (
            f"{VERSION};kid={self.kid};node={self.node};ts={self.ts_ms};"
            f"nonce={self.nonce};mac={self.mac}"
        )


def _mac(key: ClusterKey, purpose: str, node: str, ts_ms: int, nonce: str, body: bytes) -> str:
    h = hmac.new(key.mac_key, digestmod=hashlib.sha256)
    for part in (VERSION, purpose, key.kid, node, str(ts_ms), nonce):
        raw = part.encode("utf-8")
        h.update(len(raw).to_bytes(4, "big") + raw)
    h.update(len(body).to_bytes(8, "big"))
    h.update(body)
    return h.hexdigest()


def sign(key: ClusterKey, purpose: str, node: str, body: bytes, now: float, nonce: bytes) -> str:
    """The header value authenticating ``body`` for ``purpose`` from ``node`` at ``now``."""
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"nonce must be {NONCE_BYTES} bytes")
    if not _NODE_RE.fullmatch(node):
        raise ValueError(f"node id {node!r} cannot be carried in an auth header")
    ts_ms = round(now * 1000)
    nonce_hex = nonce.hex()
    mac = _mac(key, purpose, node, ts_ms, nonce_hex, body)
    return AuthToken(key.kid, node, ts_ms, nonce_hex, mac).encode()


def _field_value(pairs: dict[str, str], name: str, pattern: re.Pattern[str], size: int) -> str:
    value = pairs.get(name)
    if value is None:
        raise MalformedAuth(f"auth header lacks {name}=")
    if len(value) != size or not pattern.fullmatch(value):
        raise MalformedAuth(f"auth header field {name} is malformed")
    return value


def _split_pairs(parts: list[str]) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for part in parts:
        name, sep, value = part.partition("=")
        if not sep or name not in _FIELDS or name in pairs:
            raise MalformedAuth("auth header has an unknown, repeated or empty field")
        pairs[name] = value
    return pairs


def _parse_ts(text: str | None) -> int:
    if text is None:
        raise MalformedAuth("auth header lacks ts=")
    if not text.isascii() or not text.isdigit() or len(text) > 16:
        raise MalformedAuth("auth header field ts is malformed")
    return int(text)


def parse_token(header: str | None, max_len: int = 512) -> AuthToken:
    """Parse a header value; raises :class:`MissingAuth` or :class:`MalformedAuth`."""
    if header is None or not header.strip():
        raise MissingAuth("peer message carries no auth header")
    if len(header) > max_len:
        raise MalformedAuth("auth header too long")
    version, *rest = header.strip().split(";")
    if version != VERSION:
        raise MalformedAuth(f"unsupported auth version {version[:16]!r}")
    pairs = _split_pairs(rest)
    node = pairs.get("node")
    if node is None or not _NODE_RE.fullmatch(node):
        raise MalformedAuth("auth header field node is malformed")
    return AuthToken(
        kid=_field_value(pairs, "kid", _HEX_RE, _KID_HEX),
        node=node,
        ts_ms=_parse_ts(pairs.get("ts")),
        nonce=_field_value(pairs, "nonce", _HEX_RE, 2 * NONCE_BYTES),
        mac=_field_value(pairs, "mac", _HEX_RE, _MAC_HEX),
    )


# ---------------------------------------------------------------------------- verifier


@dataclass(frozen=True, slots=True)
class AuthConfig:
    max_skew_s: float = 30.0  # accepted |receiver clock - sender clock|, also the replay window
    replay_capacity: int = 200_000  # nonces remembered at most (bounded memory)
    max_header_len: int = 512

    def __post_init__(self) -> None:
        if self.max_skew_s <= 0:
            raise ValueError("max_skew_s must be > 0")
        if self.replay_capacity < 1 or self.max_header_len < 64:
            raise ValueError("replay_capacity must be >= 1 and max_header_len >= 64")


@dataclass(frozen=True, slots=True)
class Verified:
    """What a successful verification established."""

    node: str  # the sender's claimed id (any key holder may claim any id)
    kid: str
    ts: float  # sender's clock, Unix seconds
    skew_s: float  # now - ts on the receiver's clock


class ReplayCache:
    """Nonces seen within the skew window, bounded; see the module docstring."""

    def __init__(self, window_s: float, capacity: int) -> None:
        self._window_ms = int(window_s * 1000)
        self._capacity = capacity
        self._seen: dict[str, int] = {}
        self._heap: list[tuple[int, str]] = []
        self.floor_ms: int | None = None  # ts at or below this is refused
        self.evicted_early = 0  # entries dropped before expiry because the cache was full

    def __len__(self) -> int:
        return len(self._seen)

    def below_floor(self, ts_ms: int) -> bool:
        return self.floor_ms is not None and ts_ms <= self.floor_ms

    def contains(self, nonce: str) -> bool:
        return nonce in self._seen

    def expire(self, now_ms: int) -> None:
        horizon = now_ms - self._window_ms
        while self._heap and self._heap[0][0] < horizon:
            _, nonce = heapq.heappop(self._heap)
            del self._seen[nonce]

    def add(self, nonce: str, ts_ms: int) -> None:
        while len(self._seen) >= self._capacity:
            old_ts, old = heapq.heappop(self._heap)
            del self._seen[old]
            self.floor_ms = old_ts if self.floor_ms is None else max(self.floor_ms, old_ts)
            self.evicted_early += 1
        self._seen[nonce] = ts_ms
        heapq.heappush(self._heap, (ts_ms, nonce))


class Verifier:
    """Checks peer-message headers against one or more cluster keys (current first)."""

    def __init__(self, keys: Sequence[ClusterKey], config: AuthConfig | None = None) -> None:
        if not keys:
            raise ValueError("a verifier needs at least one key")
        self.config = config or AuthConfig()
        self._keys = {k.kid: k for k in keys}
        self._replay = ReplayCache(self.config.max_skew_s, self.config.replay_capacity)
        self.rejected: dict[str, int] = dict.fromkeys(AUTH_FAILURE_REASONS, 0)
        self.accepted = 0

    @property
    def replay_cache_size(self) -> int:
        return len(self._replay)

    def verify(self, header: str | None, purpose: str, body: bytes, now: float) -> Verified:
        """Authenticate ``body`` received for ``purpose`` at ``now`` (Unix seconds).

        Raises a subclass of :class:`AuthError`, counted in ``rejected[reason]``.
        """
        try:
            result = self._check(header, purpose, body, now)
        except AuthError as exc:
            self.rejected[exc.reason] += 1
            raise
        self.accepted += 1
        return result

    def _check(self, header: str | None, purpose: str, body: bytes, now: float) -> Verified:
        token = parse_token(header, self.config.max_header_len)
        key = self._keys.get(token.kid)
        if key is None:
            raise UnknownKey("auth header names a key this node does not hold")
        now_ms = round(now * 1000)
        self._check_fresh(token.ts_ms, now_ms)
        expected = _mac(key, purpose, token.node, token.ts_ms, token.nonce, body)
        if not hmac.compare_digest(expected, token.mac):
            raise BadSignature("peer message signature does not verify")
        self._replay.expire(now_ms)
        if self._replay.contains(token.nonce):
            raise ReplayedNonce("peer message nonce was already used")
        self._replay.add(token.nonce, token.ts_ms)
        ts = token.ts_ms / 1000.0
        return Verified(node=token.node, kid=token.kid, ts=ts, skew_s=now - ts)

    def _check_fresh(self, ts_ms: int, now_ms: int) -> None:
        if abs(now_ms - ts_ms) > int(self.config.max_skew_s * 1000):
            raise StaleTimestamp(
                f"peer message timestamp is {(now_ms - ts_ms) / 1000:.1f} s off this node's "
                f"clock (allowed ±{self.config.max_skew_s:g} s)"
            )
        if self._replay.below_floor(ts_ms):
            raise StaleTimestamp("peer message is older than the replay cache remembers")


def header_safe_node(node_id: str) -> str:
    """``node_id`` with characters an auth header cannot carry replaced by ``_``."""
    return re.sub(r"[^A-Za-z0-9._:@\-]", "_", node_id)[:128] or "_"


class Signer:
    """Signs outgoing peer messages with one key, as one node. Nonces come from the caller."""

    def __init__(self, key: ClusterKey, node: str) -> None:
        self.key = key
        self.node = header_safe_node(node)

    def sign(self, purpose: str, body: bytes, now: float, nonce: bytes) -> str:
        return sign(self.key, purpose, self.node, body, now, nonce)
