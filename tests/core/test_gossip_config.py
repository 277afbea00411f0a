"""GossipConfig and its nested parts: today's defaults, validation, lan()/wan() presets."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

import pytest

from radixmesh.core.config import (
    EpidemicConfig,
    ExchangeConfig,
    GossipConfig,
    MembershipConfig,
)

# The gossip layer's tuning constants as they were at module level before they moved here.
BEFORE = {
    "membership": {"max_members": 8192, "max_refused": 4096, "peer_sample": 4,
                   "sample_every": 8, "dead_probe_every": 8, "seed_every": 10},
    "exchange": {"resend_after_rounds": 2.5, "echo_every": 8, "max_rtt_s": 60.0,
                 "speed_every": 16, "speed_change": 0.05, "max_retry_after_s": 60.0,
                 "identity_every": 16},  # (new with protocol 3)
    "epidemic": {"digest_full": 64, "digest_sample": 48, "max_rumors": 16, "rumor_sends": 3,
                 "max_recent": 64, "max_knows": 64, "rumor_changes": 4,
                 "rumor_snapshot_hashes": 1024, "relay_log_hashes": 4096, "max_relays": 16,
                 "max_relay_hashes": 100_000},
}  # fmt: skip


def test_defaults_are_the_former_constants() -> None:
    cfg = asdict(GossipConfig())
    for part, values in BEFORE.items():
        assert cfg[part] == values


def test_lan_is_the_default() -> None:
    assert GossipConfig.lan() == GossipConfig()


def test_wan_is_slower_and_keeps_cadences_in_seconds_within_2x() -> None:
    lan, wan = GossipConfig.lan(), GossipConfig.wan()
    ratio = wan.interval_s / lan.interval_s
    assert wan.suspect_after_s > lan.suspect_after_s and wan.dead_after_s > lan.dead_after_s
    for part, name in [("membership", "dead_probe_every"), ("membership", "seed_every"),
                       ("exchange", "echo_every"), ("exchange", "speed_every")]:  # fmt: skip
        lan_s = getattr(getattr(lan, part), name) * lan.interval_s
        wan_s = getattr(getattr(wan, part), name) * wan.interval_s
        assert lan_s < wan_s <= 2 * lan_s <= ratio * lan_s, name
    assert wan.epidemic == lan.epidemic  # message-size bounds do not depend on the link


def test_for_interval_keeps_nested_parts_and_overrides() -> None:
    epi = EpidemicConfig(max_relays=4)
    cfg = GossipConfig.for_interval(0.1, epidemic=epi)
    assert cfg.epidemic is epi and cfg.membership == MembershipConfig()
    assert cfg.suspect_after_s == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("kind", "changes"),
    [
        (MembershipConfig, {"max_members": 0}),
        (MembershipConfig, {"dead_probe_every": 0}),
        (MembershipConfig, {"seed_every": 0}),
        (MembershipConfig, {"peer_sample": 0}),
        (ExchangeConfig, {"resend_after_rounds": 0.0}),
        (ExchangeConfig, {"echo_every": 0}),
        (ExchangeConfig, {"max_rtt_s": -1.0}),
        (ExchangeConfig, {"speed_change": -0.1}),
        (ExchangeConfig, {"max_retry_after_s": 0.0}),
        (EpidemicConfig, {"digest_sample": 65}),
        (EpidemicConfig, {"max_relays": 0}),
        (EpidemicConfig, {"rumor_sends": 0}),
        (EpidemicConfig, {"relay_log_hashes": -1}),
    ],
)
def test_bad_values_are_value_errors(kind: Any, changes: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        replace(kind(), **changes)


def test_configs_are_frozen() -> None:
    cfg = GossipConfig()
    with pytest.raises(AttributeError):
        cfg.epidemic.max_relays = 3  # type: ignore[misc]
