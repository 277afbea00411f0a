"""Peer authentication (core/auth.py): every way a message can be wrong is a typed rejection."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixmesh.core.auth import (
    AUTH_FAILURE_REASONS,
    AuthConfig,
    AuthError,
    BadSignature,
    ClusterKey,
    MalformedAuth,
    MissingAuth,
    ReplayCache,
    ReplayedNonce,
    Signer,
    StaleTimestamp,
    UnknownKey,
    Verifier,
    header_safe_node,
    parse_token,
    sign,
)

KEY = ClusterKey.from_text("correct horse battery staple 0123")
OTHER = ClusterKey.from_text("another cluster's secret material!")
NOW = 1_790_000_000.0
BODY = b"\x82\xa4kind\xa6gossip\xa5peers\x90"


class Nonces:
    """Deterministic, distinct 16-byte nonces."""

    def __init__(self, seed: int = 1) -> None:
        self._rng = random.Random(seed)

    def __call__(self) -> bytes:
        return self._rng.randbytes(16)


@pytest.fixture
def nonce() -> Nonces:
    return Nonces()


def fresh(verifier: Verifier | None = None) -> Verifier:
    return verifier or Verifier([KEY])


def test_roundtrip_accepts_and_reports(nonce: Nonces) -> None:
    header = sign(KEY, "gossip", "node-a", BODY, NOW, nonce())
    v = fresh()
    got = v.verify(header, "gossip", BODY, NOW + 0.25)
    assert got.node == "node-a"
    assert got.kid == KEY.kid
    assert got.ts == pytest.approx(NOW)
    assert got.skew_s == pytest.approx(0.25)
    assert v.accepted == 1
    assert sum(v.rejected.values()) == 0


def test_every_body_bit_flip_is_rejected(nonce: Nonces) -> None:
    header = sign(KEY, "gossip", "a", BODY, NOW, nonce())
    for i in range(len(BODY) * 8):
        tampered = bytearray(BODY)
        tampered[i // 8] ^= 1 << (i % 8)
        with pytest.raises(BadSignature):
            Verifier([KEY]).verify(header, "gossip", bytes(tampered), NOW)


@pytest.mark.parametrize("change", ["body_extended", "body_truncated", "purpose", "node", "ts"])
def test_forgeries_are_bad_signatures(change: str, nonce: Nonces) -> None:
    header = sign(KEY, "gossip", "a", BODY, NOW, nonce())
    body, purpose = BODY, "gossip"
    if change == "body_extended":
        body = BODY + b"\x00"
    elif change == "body_truncated":
        body = BODY[:-1]
    elif change == "purpose":
        purpose = "forward /v1/completions"  # signed for gossip, replayed to the forward endpoint
    elif change == "node":
        header = header.replace("node=a;", "node=b;")
    elif change == "ts":
        header = header.replace(f"ts={int(NOW * 1000)}", f"ts={int(NOW * 1000) + 1}")
    with pytest.raises(BadSignature):
        fresh().verify(header, purpose, body, NOW)


def test_mac_forged_by_attacker_is_rejected(nonce: Nonces) -> None:
    header = sign(KEY, "gossip", "a", BODY, NOW, nonce())
    forged = header[:-64] + "0" * 64
    with pytest.raises(BadSignature):
        fresh().verify(forged, "gossip", BODY, NOW)


def test_wrong_key_same_kid_is_a_bad_signature(nonce: Nonces) -> None:
    # An attacker who learned the (public) kid but not the secret.
    header = sign(OTHER, "gossip", "a", BODY, NOW, nonce())
    header = header.replace(f"kid={OTHER.kid}", f"kid={KEY.kid}")
    with pytest.raises(BadSignature):
        fresh().verify(header, "gossip", BODY, NOW)


def test_wrong_key_is_unknown_key(nonce: Nonces) -> None:
    header = sign(OTHER, "gossip", "a", BODY, NOW, nonce())
    with pytest.raises(UnknownKey):
        fresh().verify(header, "gossip", BODY, NOW)


def test_replay_is_rejected_within_window(nonce: Nonces) -> None:
    v = fresh()
    header = sign(KEY, "gossip", "a", BODY, NOW, nonce())
    v.verify(header, "gossip", BODY, NOW)
    for dt in (0.0, 1.0, 29.0):
        with pytest.raises(ReplayedNonce):
            v.verify(header, "gossip", BODY, NOW + dt)
    assert v.rejected["replayed"] == 3


def test_replay_after_window_is_stale(nonce: Nonces) -> None:
    v = fresh()
    header = sign(KEY, "gossip", "a", BODY, NOW, nonce())
    v.verify(header, "gossip", BODY, NOW)
    with pytest.raises(StaleTimestamp):
        v.verify(header, "gossip", BODY, NOW + 31.0)


@pytest.mark.parametrize("offset", [-30.5, 30.5, -3600.0, 1e6])
def test_stale_or_future_timestamps_rejected(offset: float, nonce: Nonces) -> None:
    header = sign(KEY, "gossip", "a", BODY, NOW + offset, nonce())
    with pytest.raises(StaleTimestamp):
        fresh().verify(header, "gossip", BODY, NOW)


@pytest.mark.parametrize("offset", [-29.9, 29.9])
def test_skew_inside_window_is_accepted(offset: float, nonce: Nonces) -> None:
    header = sign(KEY, "gossip", "a", BODY, NOW + offset, nonce())
    v = fresh()
    got = v.verify(header, "gossip", BODY, NOW)
    assert got.node == "a" and got.skew_s == pytest.approx(-offset, abs=1e-3)
    assert v.accepted == 1


def test_stale_check_does_not_consume_nonce(nonce: Nonces) -> None:
    v = fresh()
    header = sign(KEY, "gossip", "a", BODY, NOW, nonce())
    with pytest.raises(StaleTimestamp):
        v.verify(header, "gossip", BODY, NOW + 100)
    with pytest.raises(BadSignature):
        v.verify(header, "gossip", BODY + b"x", NOW)
    v.verify(header, "gossip", BODY, NOW)  # the genuine message still goes through once
    assert v.replay_cache_size == 1


@pytest.mark.parametrize("header", [None, "", "   "])
def test_missing_header(header: str | None) -> None:
    with pytest.raises(MissingAuth) as info:
        fresh().verify(header, "gossip", BODY, NOW)
    assert info.value.http_status == 401


def _truncations(header: str) -> list[str]:
    return [header[:n] for n in range(1, len(header))]


def test_every_truncation_is_rejected_with_a_typed_error(nonce: Nonces) -> None:
    header = sign(KEY, "gossip", "a", BODY, NOW, nonce())
    v = fresh()
    for cut in _truncations(header):
        with pytest.raises((MalformedAuth, BadSignature)):
            v.verify(cut, "gossip", BODY, NOW)
    assert v.accepted == 0


@pytest.mark.parametrize(
    "mutate",
    [
        lambda h: h.replace("v1;", "v2;"),
        lambda h: h.replace("kid=", "kid=z"),
        lambda h: h.replace("ts=", "ts=-"),
        lambda h: h.replace("ts=", "ts=1e"),
        lambda h: h.replace("nonce=", "nonce=AA"),
        lambda h: h.replace("node=a", "node=a b"),
        lambda h: h.replace("node=a", "node="),
        lambda h: h + ";kid=00000000",
        lambda h: h + ";extra=1",
        lambda h: h.replace(";mac=", ";mac"),
        lambda h: h.upper(),
        lambda h: h + "x" * 600,
        lambda h: h.replace("ts=", "ts=\u0661"),  # non-ASCII digit
    ],
)
def test_malformed_headers(mutate: Callable[[str], str], nonce: Nonces) -> None:
    header = sign(KEY, "gossip", "a", BODY, NOW, nonce())
    with pytest.raises(MalformedAuth) as info:
        fresh().verify(mutate(header), "gossip", BODY, NOW)
    assert info.value.http_status == 401


def test_rejections_are_counted_by_reason(nonce: Nonces) -> None:
    v = fresh()
    good = sign(KEY, "gossip", "a", BODY, NOW, nonce())
    attempts = [
        (None, BODY),
        ("v1;junk", BODY),
        (sign(OTHER, "gossip", "a", BODY, NOW, nonce()), BODY),
        (sign(KEY, "gossip", "a", BODY, NOW - 100, nonce()), BODY),
        (good, BODY + b"!"),
    ]
    for header, body in attempts:
        with pytest.raises(AuthError):
            v.verify(header, "gossip", body, NOW)
    v.verify(good, "gossip", BODY, NOW)
    with pytest.raises(ReplayedNonce):
        v.verify(good, "gossip", BODY, NOW)
    assert v.rejected == dict.fromkeys(AUTH_FAILURE_REASONS, 1)
    assert v.accepted == 1


def test_key_rotation_accepts_old_and_new(nonce: Nonces) -> None:
    v = Verifier([OTHER, KEY])
    new = v.verify(sign(KEY, "gossip", "a", BODY, NOW, nonce()), "gossip", BODY, NOW)
    old = v.verify(sign(OTHER, "gossip", "a", BODY, NOW, nonce()), "gossip", BODY, NOW)
    assert (new.kid, old.kid) == (KEY.kid, OTHER.kid)
    assert v.accepted == 2 and sum(v.rejected.values()) == 0


def test_short_keys_and_bad_config_refused() -> None:
    with pytest.raises(ValueError):
        ClusterKey.from_text("  short  ")
    with pytest.raises(ValueError):
        Verifier([])
    with pytest.raises(ValueError):
        AuthConfig(max_skew_s=0)
    with pytest.raises(ValueError):
        sign(KEY, "gossip", "a", BODY, NOW, b"short")


def test_key_repr_hides_secret() -> None:
    assert "battery" not in repr(KEY)
    assert len(KEY.kid) == 8 and KEY.kid != OTHER.kid


def test_signer_sanitises_node_ids(nonce: Nonces) -> None:
    s = Signer(KEY, "node a/ü")
    assert s.node == header_safe_node("node a/ü") == "node_a__"
    got = fresh().verify(s.sign("gossip", BODY, NOW, nonce()), "gossip", BODY, NOW)
    assert got.node == "node_a__"


# ----------------------------------------------------------------------- replay cache bounds


def test_replay_cache_expires_entries(nonce: Nonces) -> None:
    v = Verifier([KEY], AuthConfig(max_skew_s=5.0))
    for i in range(50):
        v.verify(sign(KEY, "g", "a", BODY, NOW + i, nonce()), "g", BODY, NOW + i)
    # Only nonces whose timestamp is still within the window remain: NOW+44 ... NOW+49.
    assert v.replay_cache_size == 6
    assert v.accepted == 50


def test_replay_cache_overflow_raises_floor_and_never_accepts_replays(nonce: Nonces) -> None:
    v = Verifier([KEY], AuthConfig(max_skew_s=30.0, replay_capacity=8))
    headers = [sign(KEY, "g", "a", BODY, NOW + i * 0.01, nonce()) for i in range(20)]
    for i, h in enumerate(headers):
        v.verify(h, "g", BODY, NOW + i * 0.01)
    assert v.replay_cache_size == 8
    for i, h in enumerate(headers):
        with pytest.raises((ReplayedNonce, StaleTimestamp)):
            v.verify(h, "g", BODY, NOW + 0.2 + i * 0.001)
    # A genuine but delayed message older than the floor is refused as stale, not accepted.
    late = sign(KEY, "g", "a", BODY, NOW + 0.05, nonce())
    with pytest.raises(StaleTimestamp):
        v.verify(late, "g", BODY, NOW + 0.3)
    # New messages keep flowing.
    accepted = v.accepted
    assert v.verify(sign(KEY, "g", "a", BODY, NOW + 1.0, nonce()), "g", BODY, NOW + 1.0).node == "a"
    assert v.accepted == accepted + 1


def test_replay_cache_unit() -> None:
    cache = ReplayCache(window_s=1.0, capacity=2)
    cache.add("a", 1000)
    cache.add("b", 1500)
    cache.add("c", 1200)  # evicts "a" (oldest ts), floor = 1000
    assert not cache.contains("a") and cache.below_floor(1000) and not cache.below_floor(1001)
    cache.expire(2300)  # drops ts < 1300: "c"
    assert cache.contains("b") and not cache.contains("c") and len(cache) == 1
    assert cache.evicted_early == 1


# --------------------------------------------------------------------------- property tests


@settings(max_examples=300, deadline=None)
@given(header=st.one_of(st.none(), st.text(max_size=300), st.binary(max_size=200).map(repr)))
def test_arbitrary_headers_only_raise_auth_errors(header: str | None) -> None:
    with pytest.raises(AuthError):
        fresh().verify(header, "gossip", BODY, NOW)


@settings(max_examples=200, deadline=None)
@given(
    body=st.binary(max_size=256),
    purpose=st.text(max_size=40),
    pos=st.integers(min_value=0, max_value=10_000),
    char=st.characters(codec="ascii"),
)
def test_mutated_headers_never_verify(body: bytes, purpose: str, pos: int, char: str) -> None:
    header = sign(KEY, purpose, "n1", body, NOW, bytes(range(16)))
    i = pos % len(header)
    mutated = header[:i] + char + header[i + 1 :]
    v = fresh()
    if mutated == header:
        assert v.verify(mutated, purpose, body, NOW).node == "n1"
        return
    with pytest.raises(AuthError):
        v.verify(mutated, purpose, body, NOW)


@settings(max_examples=100, deadline=None)
@given(body=st.binary(max_size=512), skew=st.floats(min_value=-29.0, max_value=29.0))
def test_genuine_messages_always_verify(body: bytes, skew: float) -> None:
    header = sign(KEY, "forward /v1/completions", "n1", body, NOW + skew, b"\x01" * 16)
    assert parse_token(header).node == "n1"
    got = fresh().verify(header, "forward /v1/completions", body, NOW)
    assert got.node == "n1" and got.skew_s == pytest.approx(-skew, abs=1e-3)
