"""Announcements: a change to a node's own cache or queue brings its next gossip round forward;
a grown queue brings it sooner still."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from radixmesh.core.config import GossipConfig, GossipMode
from radixmesh.core.events import LoadChanged, QueueChanged
from radixmesh.core.profile import resolve
from radixmesh.core.rounds import URGENT_GAP
from radixmesh.core.shadow import Shadow
from radixmesh.core.shadow_state import BatchState, ttft_parts
from radixmesh.core.units import parse_optional_duration
from radixmesh.testing import LinkConfig, TwinCluster

INTERVAL_S = 0.5
GAP_S = 0.05
LINK = LinkConfig(delay_s=0.002)


def _cluster(n: int, announce: float | None, mode: GossipMode = GossipMode.DELTA) -> TwinCluster:
    gossip = GossipConfig(interval_s=INTERVAL_S, announce_gap_s=announce, mode=mode)
    c = TwinCluster(n, gossip=gossip, link=LINK, seed=7)
    c.run_for(3 * INTERVAL_S)  # joined
    return c


def _time_to_converge(c: TwinCluster, rng: random.Random, node: str) -> float:
    c.change_cache(node, [rng.getrandbits(64) for _ in range(8)])
    took = c.run_until_converged(2 * INTERVAL_S, step_s=0.001)
    assert took is not None
    return took


def test_a_change_reaches_every_peer_within_the_gap_not_a_round() -> None:
    rng = random.Random(1)
    c = _cluster(5, GAP_S)
    for _ in range(10):  # at random phases of the round, sometimes right after one
        c.run_for(rng.random() * INTERVAL_S)
        assert _time_to_converge(c, rng, f"n{rng.randrange(5)}") <= GAP_S + 3 * LINK.delay_s
    assert c.metric("gossip_rounds_announced") > 0


def test_without_announcements_a_change_waits_for_the_round() -> None:
    rng = random.Random(1)
    c = _cluster(5, None)
    took = []
    for _ in range(10):
        c.run_for(rng.random() * INTERVAL_S)
        took.append(_time_to_converge(c, rng, f"n{rng.randrange(5)}"))
    assert max(took) > 4 * GAP_S  # some change waited for most of a round
    assert c.metric("gossip_rounds_announced") == 0


@pytest.mark.parametrize("mode", [GossipMode.SNAPSHOT, GossipMode.EPIDEMIC])
def test_only_delta_mode_announces(mode: GossipMode) -> None:
    rng = random.Random(2)
    c = _cluster(4, GAP_S, mode)
    for _ in range(20):
        c.change_cache("n1", [rng.getrandbits(64)])
        c.run_for(0.01)
    assert c.metric("gossip_rounds_announced") == 0


def test_a_stream_of_changes_costs_at_most_one_round_per_gap() -> None:
    """Changes every millisecond: rounds are paced by the gap, not by the changes."""
    rng = random.Random(3)
    c = _cluster(3, GAP_S)
    before = c.nodes["n0"].metrics()["gossip_rounds"]
    seconds = 2.0
    for _ in range(int(seconds / 0.001)):
        c.change_cache("n0", [rng.getrandbits(64)])
        c.run_for(0.001)
    rounds = c.nodes["n0"].metrics()["gossip_rounds"] - before
    assert seconds / GAP_S * 0.9 <= rounds <= seconds / GAP_S + 1


def test_a_request_joining_or_leaving_the_queue_is_announced_within_the_gap() -> None:
    """The load peers price a node by goes out within the gap of a queue change, not a round
    later; a stream of them is paced by the gap as cache changes are."""
    rng = random.Random(4)
    c = _cluster(4, GAP_S)
    for _ in range(5):
        c.run_for(rng.random() * INTERVAL_S)
        before = c.nodes["n2"].metrics()["gossip_rounds"]
        c.deliver("n2", QueueChanged((rng.getrandbits(64),), True))
        c.run_for(GAP_S + 0.001)
        assert c.nodes["n2"].metrics()["gossip_rounds"] > before
    announced = c.metric("gossip_rounds_announced")
    assert announced > 0
    before = c.nodes["n2"].metrics()["gossip_rounds"]
    for i in range(1000):  # a request joining or leaving every millisecond for a second
        c.deliver("n2", QueueChanged((i,), i % 2 == 0))
        c.run_for(0.001)
    rounds = c.nodes["n2"].metrics()["gossip_rounds"] - before
    assert 1.0 / GAP_S * 0.9 <= rounds <= 1.0 / GAP_S + 1
    quiet = _cluster(4, None)  # without announcements a queue change waits for the round
    quiet.deliver("n2", QueueChanged((1,), True))
    quiet.run_for(GAP_S)
    assert quiet.metric("gossip_rounds_announced") == 0


def test_no_round_is_announced_for_a_change_that_changes_nothing() -> None:
    c = _cluster(3, GAP_S)
    held = sorted(c.truth("n0"))
    c.change_cache("n0", [1, 2, 3])
    c.run_for(INTERVAL_S)
    announced = c.metric("gossip_rounds_announced")
    c.change_cache("n0", [1, 2, 3])  # already held
    c.change_cache("n0", (), [99])  # never held
    c.run_for(INTERVAL_S)
    assert c.metric("gossip_rounds_announced") == announced
    assert sorted(c.truth("n0")) == sorted({*held, 1, 2, 3})


def test_config_and_flag_values() -> None:
    assert GossipConfig().announce_gap_s == GAP_S
    with pytest.raises(ValueError, match="announce_gap_s"):
        replace(GossipConfig(), announce_gap_s=-0.01)
    assert parse_optional_duration("off") is None
    assert parse_optional_duration(" None ") is None
    assert parse_optional_duration("50ms") == pytest.approx(0.05)
    assert parse_optional_duration(0) == 0.0
    with pytest.raises(ValueError, match="duration"):
        parse_optional_duration("soon")


def _batch(tokens: int) -> BatchState:
    shadow = Shadow(resolve("h100-llama3-8b"))
    if tokens:
        shadow.add(1, list(range(tokens)), 8, 0.0)
    return replace(shadow.state(0.0), rate=10.0)


def _round_just_passed(c: TwinCluster, node: str) -> int:
    """Run until ``node`` has gossiped a round; its round count."""
    rounds = c.nodes[node].metrics()["gossip_rounds"]
    while c.nodes[node].metrics()["gossip_rounds"] == rounds:
        c.run_for(0.0005)
    return int(c.nodes[node].metrics()["gossip_rounds"])


def test_a_grown_queue_is_announced_sooner_than_the_gap() -> None:
    """A batch predicting a materially longer TTFT than the one of our last round (a cold
    prompt queued) brings the next round to ``URGENT_GAP`` of the gap after the last; a
    drained one, or a change within the tolerance, waits for the gap as before."""
    c = _cluster(3, GAP_S)
    c.deliver("n0", LoadChanged(0, 0, 0, 1 << 20, batch=_batch(0)))
    rounds = _round_just_passed(c, "n0")
    c.deliver("n0", LoadChanged(1, 1, 0, 1 << 20, batch=_batch(6000)))
    c.run_for(URGENT_GAP * GAP_S + 0.001)
    assert c.nodes["n0"].metrics()["gossip_rounds"] == rounds + 1
    assert c.metric("gossip_rounds_urgent") == 1
    c.run_for(2 * LINK.delay_s)
    seen = c.nodes["n1"]._parts.peers.info("n0", 0, c.now)
    assert seen is not None and seen.batch is not None
    assert sum(ttft_parts(seen.batch, 512, 0)) > 0.05  # the cold prompt's step, aged
    rounds = _round_just_passed(c, "n0")
    c.deliver("n0", LoadChanged(0, 0, 0, 1 << 20, batch=_batch(0)))  # drained: no hurry
    c.run_for(URGENT_GAP * GAP_S + 0.001)
    assert c.nodes["n0"].metrics()["gossip_rounds"] == rounds
    assert c.metric("gossip_rounds_urgent") == 1
    quiet = _cluster(3, None)  # without announcements, none
    quiet.deliver("n0", LoadChanged(0, 0, 0, 1 << 20, batch=_batch(0)))
    _round_just_passed(quiet, "n0")
    quiet.deliver("n0", LoadChanged(1, 1, 0, 1 << 20, batch=_batch(6000)))
    quiet.run_for(GAP_S)
    assert quiet.metric("gossip_rounds_urgent") == 0
