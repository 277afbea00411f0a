"""ForwardConfig: every silence timeout a node may be configured with gives a heartbeat period
a ForwardRequest can carry (a benchmark's --time-scale 150 stretched the 2 s timeout to 300 s,
whose 75 s heartbeat every forward then refused to build: HTTP 500 on each forwarded request)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixmesh.core.config import ForwardConfig
from radixmesh.core.forward_codec import decode_forward_request, encode_forward_request
from radixmesh.core.messages import HEARTBEAT_MAX_S, HEARTBEAT_MIN_S, ForwardRequest


@given(st.floats(min_value=1e-6, max_value=1e6, allow_nan=False))
def test_every_silence_timeout_gives_a_heartbeat_a_request_carries(silence_s: float) -> None:
    cfg = ForwardConfig(silence_timeout_s=silence_s)
    beat = cfg.heartbeat_s
    assert HEARTBEAT_MIN_S <= beat <= HEARTBEAT_MAX_S
    assert beat <= max(silence_s / 4, HEARTBEAT_MIN_S)  # never slower than four per timeout
    req = ForwardRequest((1, 2, 3), 4, heartbeat_s=beat)
    assert decode_forward_request(encode_forward_request(req)).heartbeat_s == pytest.approx(beat)


def test_a_stretched_timeout_beats_every_minute() -> None:
    assert ForwardConfig(silence_timeout_s=2.0 * 150).heartbeat_s == HEARTBEAT_MAX_S
    assert ForwardConfig(silence_timeout_s=2.0).heartbeat_s == 0.5


def test_a_request_out_of_range_is_still_refused() -> None:
    with pytest.raises(ValueError, match="heartbeat_s"):
        ForwardRequest((1,), 1, heartbeat_s=75.0)
