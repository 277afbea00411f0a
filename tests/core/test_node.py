"""NodeCore: events in, actions out; routing from the view; push-back; failures; metrics."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixmesh.core.admission import admission, token_cap
from radixmesh.core.blocks import Fingerprint
from radixmesh.core.config import AdmissionConfig, GossipConfig, NodeConfig, PushbackConfig
from radixmesh.core.events import (
    AcceptForward,
    ExecuteLocally,
    Forward,
    ForwardAccepted,
    ForwardArrived,
    ForwardFailed,
    ForwardRefused,
    LoadChanged,
    Log,
    MessageReceived,
    PeerStateChanged,
    QueueChanged,
    RefuseForward,
    RejectRequest,
    RequestArrived,
    RequestDone,
    RequestServed,
    Send,
    Tick,
)
from radixmesh.core.node import NodeCore
from radixmesh.core.router import Policy, RouteInput, RouterConfig, Tag
from radixmesh.core.shadow_state import BatchState
from radixmesh.testing import LinkConfig, TwinCluster

FP = Fingerprint("test-model", "bytes", 16)


def offer(c: TwinCluster, rid: int, peer: str) -> None:
    """n0 receives request ``rid`` aimed at ``peer`` and forwards it there."""
    [action] = c.deliver("n0", RequestArrived(rid, (), 128, 0, 1, target=peer))
    assert isinstance(action, Forward) and action.peer_id == peer


def refusal_answer(
    node: NodeCore,
    now: float,
    prompt: int = 540,
    cached: int = 0,
    max_tokens: int = 1,
    beat_s: float | None = None,
) -> RefuseForward | None:
    """Offer ``node`` a forward: None if it admits it, else its refusal."""
    [action] = node.handle(ForwardArrived(0, prompt, cached, max_tokens, beat_s), now)
    if isinstance(action, AcceptForward):
        return None
    assert isinstance(action, RefuseForward)
    return action


def refusal(node: NodeCore, now: float, *offer: Any, **named: Any) -> float | None:
    """``refusal_answer``'s retry-after (None: admitted)."""
    answer = refusal_answer(node, now, *offer, **named)
    return None if answer is None else answer.retry_after_s


def lone_node(**overrides: object) -> NodeCore:
    config = NodeConfig(
        node_id="solo",
        address="mem://solo",
        fingerprint=FP,
        incarnation=1,
        seeds=("mem://seed",),
        **overrides,
    )  # type: ignore[arg-type]
    return NodeCore(config, random.Random(0), now=0.0)


def warm_cluster(n: int = 3, policy: Policy = Policy.PAPER, **kw: object) -> TwinCluster:
    c = TwinCluster(n, router=RouterConfig(policy=policy), seed=11, **kw)  # type: ignore[arg-type]
    c.run_for(2.0)
    return c


def hashes_of(c: TwinCluster, node: str, rng: random.Random, n: int = 8) -> list[int]:
    chain = [rng.getrandbits(64) for _ in range(n)]
    c.change_cache(node, chain)
    return chain


# ------------------------------------------------------------------------------ events
def test_first_tick_joins_the_seeds_and_schedules_the_next_round() -> None:
    node = lone_node()
    assert node.next_deadline() == 0.0
    actions = node.handle(Tick(), 0.0)
    sends = [a for a in actions if isinstance(a, Send)]
    assert [(s.address, s.peer_id) for s in sends] == [("mem://seed", None)]
    assert 0.5 <= node.next_deadline() <= 0.55
    assert node.handle(Tick(), 0.1) == []  # not due yet


@given(st.binary(max_size=300))
@settings(max_examples=200, deadline=None)
def test_garbage_never_raises_and_is_counted(data: bytes) -> None:
    node = lone_node()
    before = node.metrics()["messages_rejected"]
    actions = node.handle(MessageReceived(data, "evil:1"), 1.0)
    assert all(isinstance(a, Log) for a in actions)
    metrics = node.metrics()
    assert metrics["messages_rejected"] == before + 1
    assert metrics["messages_rejected_decode"] + metrics["messages_rejected_size"] >= 1
    assert metrics["peers_alive"] == 0


def test_request_served_feeds_the_advertised_speed() -> None:
    c = warm_cluster(2)
    c.deliver("n1", RequestServed(1000, 0, 0.5, 10, 0.5, 1.0))
    c.run_for(1.0)
    [peer] = c.nodes["n0"].mesh_state(c.now)["peers"]  # type: ignore[misc]
    assert peer["load"]["decode_s_per_token"] > 0.02  # learnt from n1's own measurement
    assert peer["load"]["mean_service_s"] > 0.1


def test_metrics_and_mesh_state_shape() -> None:
    c = warm_cluster(3)
    m = c.nodes["n0"].metrics()
    for key in (
        "gossip_bytes_in",
        "gossip_bytes_out",
        "gossip_messages_in",
        "gossip_messages_out",
        "messages_rejected",
        "messages_rejected_decode",
        "messages_rejected_fingerprint",
        "messages_rejected_stale",
        "peers_alive",
        "peers_suspect",
        "peers_dead",
        "view_entries",
    ):
        assert isinstance(m[key], float), key
    assert m["gossip_bytes_out"] > 0 and m["peers_alive"] == 2
    state = c.nodes["n0"].mesh_state(c.now)
    json.dumps(state)
    peers = state["peers"]
    assert isinstance(peers, list) and {p["node_id"] for p in peers} == {"n1", "n2"}
    assert all(p["state"] == "alive" and p["age_s"] < 1.0 for p in peers)


# ----------------------------------------------------------------------------- routing
def test_paper_policy_routes_to_the_peer_holding_the_longest_prefix() -> None:
    rng = random.Random(1)
    c = warm_cluster(3)
    chain = hashes_of(c, "n2", rng)
    c.change_cache("n1", chain[:3])
    c.run_for(1.0)
    ranked = c.nodes["n0"].route(
        chain, prompt_tokens=8 * 16 + 5, local_cached_tokens=0, max_tokens=1, now=c.now
    )
    assert [r.node_id for r in ranked] == ["n2", "n1", "n0"]
    assert ranked[0].expected_cached_tokens == 128
    assert ranked[1].expected_cached_tokens == 48
    capped = c.nodes["n0"].route(
        chain, prompt_tokens=40, local_cached_tokens=0, max_tokens=1, now=c.now
    )
    assert capped[0].expected_cached_tokens == 40


def test_self_wins_ties_and_local_cache_is_exact() -> None:
    rng = random.Random(2)
    c = warm_cluster(2)
    chain = hashes_of(c, "n1", rng, n=4)
    c.run_for(1.0)
    ranked = c.nodes["n0"].route(chain, 64, local_cached_tokens=64, max_tokens=1, now=c.now)
    assert ranked[0].is_self and ranked[0].expected_cached_tokens == 64


def test_cost_policy_forwards_a_long_cached_prompt_and_keeps_a_cold_one() -> None:
    rng = random.Random(3)
    c = warm_cluster(3, policy=Policy.COST)
    chain = hashes_of(c, "n2", rng, n=200)
    c.run_for(1.0)
    node = c.nodes["n0"]
    assert node.route(chain, 3200, 0, 1, c.now)[0].node_id == "n2"
    cold = [rng.getrandbits(64) for _ in range(200)]
    owners = {c.nodes[n].route(cold, 3200, 0, 1, c.now)[0].node_id for n in ("n0", "n1", "n2")}
    assert len(owners) == 1  # a prefix nobody holds: the same owner from every entry node
    off = TwinCluster(3, router=RouterConfig(policy=Policy.COST, placement_depth_blocks=None),
                      seed=11)
    off.run_for(2.0)
    assert off.nodes["n0"].route(cold, 3200, 0, 1, off.now)[0].is_self  # without placement


def test_cold_prefixes_spread_over_their_owners() -> None:
    rng = random.Random(5)
    c = warm_cluster(4, policy=Policy.COST)
    firsts = [c.nodes["n0"].route([rng.getrandbits(64) for _ in range(20)], 320, 0, 1, c.now)
              for _ in range(200)]
    share = {n: sum(f[0].node_id == n for f in firsts) / 200 for n in ("n0", "n1", "n2", "n3")}
    assert all(0.1 < v < 0.45 for v in share.values()), share  # ~a quarter each, no home
    # the forward to an owner carries a budget a cold owner can meet (it is as cold as we are)
    peer = next(f[0] for f in firsts if not f[0].is_self)
    mine = next(f for f in firsts if not f[0].is_self)[1:]
    me = next(x for x in mine if x.is_self)
    assert peer.beat_s is not None and peer.beat_s > me.predicted_latency_s - 0.01


@pytest.mark.parametrize(("bound", "served"), [(0.15, (30, 20)), (None, (30, 20)), (0.15, (2, 1))])
def test_a_busy_owner_is_passed_over_on_the_ring_by_every_entry_node(
    bound: float | None, served: tuple[int, int]
) -> None:
    """Consistent hashing with bounded load: once a prefix's owner is busier than 1.15x the
    mean utilization, a new prefix goes past it to the next member clockwise, the same one
    from every entry node, the busy one included; what it holds still goes to it. Without
    the bound (None) the busy owner is not sent them either: its utilization prices it
    above the best choice by more than a first copy's slack (10 % of the copy's work,
    ``first_copy_slack``; at 75 % it kept them), so each entry node makes its own copy
    (the simulator's regimes gained from the smaller slack; the bound, on by default,
    is what keeps one copy here). ``served``: busy time in requests of 0.1 s,
    the owner's and each other node's: 3 s against 2 s is 1.3x the mean (within
    the 1.5x forward ``load_bound``); 0.2 s against 0.1 s is the real cluster's low load
    (1.6x the mean, within the forward bound's slack of one request, which placement lacks:
    with it the walk did not act there)."""
    rng = random.Random(7)
    router = RouterConfig(policy=Policy.COST, placement_load_bound=bound)
    c = TwinCluster(4, router=router, seed=11)
    c.run_for(2.0)
    cold = [rng.getrandbits(64) for _ in range(20)]
    owner = c.nodes["n1"].route(cold, 320, 0, 1, c.now)[0].node_id
    c.busy_for({n: 0.1 * (served[0] if n == owner else served[1]) for n in c.nodes})
    c.run_for(1.0)  # the load spreads by gossip
    heads = [c.nodes[n].route(cold, 320, 0, 1, c.now)[0] for n in sorted(c.nodes)]
    if bound is None:  # the busy owner keeps its own; every other entry node copies it
        assert all(h.is_self for h in heads)
        assert {h.placement for h in heads} == {Tag.FIRST, Tag.UNPLACED}
    else:
        assert len({h.node_id for h in heads}) == 1  # every entry node, the owner too, agrees
        assert all(h.placement is Tag.FIRST for h in heads)
        assert heads[0].node_id != owner
    held = hashes_of(c, owner, rng, n=20)
    c.run_for(1.0)
    entry = next(n for n in sorted(c.nodes) if n != owner)
    assert c.nodes[entry].route(held, 320, 0, 1, c.now)[0].node_id == owner  # its hit
    with pytest.raises(ValueError, match="placement_load_bound"):
        RouterConfig(placement_load_bound=-0.1)


def test_cost_policy_offloads_to_an_idle_unmatched_peer_when_self_is_busy() -> None:
    rng = random.Random(4)
    c = warm_cluster(3, policy=Policy.COST, pushback=PushbackConfig(queue_threshold=1000))
    c.set_load("n1", 5)
    c.run_for(1.0)
    c.set_load("n0", 50)
    cold = [rng.getrandbits(64) for _ in range(10)]
    ranked = c.nodes["n0"].route(cold, 160, 0, 1, c.now)
    assert ranked[0].node_id == "n2"  # idle and unmatched beats busy self and busier n1
    assert {r.node_id for r in ranked} == {"n0", "n1", "n2"}


def test_baseline_policies_see_every_routable_peer() -> None:
    for policy in (Policy.RANDOM, Policy.ROUND_ROBIN, Policy.LEAST_LOADED):
        c = warm_cluster(4, policy=policy)
        ranked = c.nodes["n0"].route([1, 2, 3], 48, 0, 1, c.now)
        assert {r.node_id for r in ranked} == {"n0", "n1", "n2", "n3"}, policy


def test_none_policy_is_always_self() -> None:
    c = warm_cluster(2, policy=Policy.NONE)
    ranked = c.nodes["n0"].route([1, 2], 32, 16, 1, c.now)
    assert [r.node_id for r in ranked] == ["n0"]


# ---------------------------------------------------------------------- failures, push-back
def test_forward_failed_marks_suspect_at_once_and_speech_revives() -> None:
    rng = random.Random(5)
    c = warm_cluster(2)
    chain = hashes_of(c, "n1", rng)
    c.run_for(1.0)
    offer(c, 1, "n1")
    actions = c.deliver("n0", ForwardFailed(1, "n1", "connection refused"))
    assert PeerStateChanged("n1", "alive", "suspect") in actions
    assert ExecuteLocally(1, "fallback", 0, 0) in actions  # the only other candidate: self
    assert c.nodes["n0"].route(chain, 128, 0, 1, c.now)[0].is_self  # not routed to
    c.run_for(0.6)  # n1 gossips again
    assert c.nodes["n0"].peer_state("n1") == "alive"
    assert c.nodes["n0"].route(chain, 128, 0, 1, c.now)[0].node_id == "n1"


def test_silent_peer_becomes_suspect_then_dead_and_its_estimate_is_dropped() -> None:
    rng = random.Random(6)
    gossip = GossipConfig(suspect_after_s=2.0, dead_after_s=5.0)
    c = warm_cluster(3, gossip=gossip)
    hashes_of(c, "n2", rng)
    c.run_for(1.0)
    c.crash("n2")
    t0 = c.now
    c.run_for(1.5)
    assert c.nodes["n0"].peer_state("n2") == "alive"
    c.run_for(1.2)
    assert c.nodes["n0"].peer_state("n2") == "suspect"
    assert c.nodes["n0"].estimate("n2")  # still held while only suspect
    c.run_until(t0 + 5.7)
    assert c.nodes["n0"].peer_state("n2") == "dead"
    assert c.nodes["n0"].estimate("n2") == frozenset()
    changes = [(s.old, s.new) for s in c.state_changes("n0") if s.peer_id == "n2"]
    assert changes[-2:] == [("alive", "suspect"), ("suspect", "dead")]


def test_pushback_excludes_the_node_for_the_advertised_time_and_no_longer() -> None:
    rng = random.Random(7)
    pb = PushbackConfig(queue_threshold=4, duration_s=2.0)
    c = warm_cluster(2, pushback=pb, link=LinkConfig(delay_s=0.001))
    chain = hashes_of(c, "n1", rng)
    c.run_for(1.0)
    n0 = c.nodes["n0"]
    assert n0.route(chain, 128, 0, 1, c.now)[0].node_id == "n1"
    c.set_load("n1", 5)  # above the threshold: advertised at once, not at the next round
    t0 = c.now
    c.set_load("n1", 0)  # the queue drains at once; the advertised duration still holds
    c.run_for(0.01)
    assert n0.pushed_back("n1", c.now)
    assert n0.metrics()["peers_routable"] == 1  # still alive: only unavailable
    c.run_until(t0 + 1.99)
    assert n0.route(chain, 128, 0, 1, c.now)[0].is_self
    c.run_until(t0 + 2.01)
    assert not n0.pushed_back("n1", c.now)
    assert n0.route(chain, 128, 0, 1, c.now)[0].node_id == "n1"


def test_a_node_no_busier_than_its_peers_does_not_push_back() -> None:
    """Push-back is for a node busier than its peers (``PushbackConfig.relative``): over the
    threshold while every peer reports a queue as deep, it neither pushes back nor refuses
    forwards as busy (its work would only move to nodes as busy, its prefixes computed
    again); once its peers' queues are short, the same depth pushes back."""
    pb = PushbackConfig(queue_threshold=4, duration_s=2.0)
    c = warm_cluster(3, pushback=pb, link=LinkConfig(delay_s=0.001))
    n0, n1 = c.nodes["n0"], c.nodes["n1"]
    for peer in ("n0", "n2"):
        c.set_load(peer, 5)  # over the threshold too: they push back (n1 reported 0)
    c.run_for(1.0)  # their reports reach n1
    c.set_load("n1", 9)  # over the threshold, under 2x its peers' mean
    c.run_for(0.01)
    assert not n0.pushed_back("n1", c.now)
    assert refusal(n1, c.now) is None
    assert n1.metrics()["pushback_started"] == 0
    for peer in ("n0", "n2"):
        c.set_load(peer, 0)
    c.run_for(3.0)  # their push-back over, their short queues reported to n1
    c.set_load("n1", 9)
    c.run_for(0.01)
    assert n0.pushed_back("n1", c.now)
    assert refusal(n1, c.now) is not None
    assert n1.metrics()["pushback_started"] == 1


def test_queued_blocks_reach_the_peers_and_leave_with_their_request() -> None:
    """Blocks a queued request will compute are advertised as held from the moment it is
    queued (``QueueChanged``), with the next gossip round; a request that leaves the queue
    without the engine caching them (cancelled) takes them back."""
    rng = random.Random(21)
    c = warm_cluster(2, policy=Policy.COST, link=LinkConfig(delay_s=0.001))
    chain = tuple(rng.getrandbits(64) for _ in range(64))
    n0 = c.nodes["n0"]
    c.deliver("n1", QueueChanged(chain, True))
    assert c.nodes["n1"].local_hashes() == frozenset(chain)
    assert c.nodes["n1"].cached_hashes() == frozenset()  # the engine has none of them yet
    c.run_for(1.0)
    assert n0.estimate("n1") == frozenset(chain)
    [first] = n0.route(chain, 1100, 0, 1, c.now)[:1]
    assert first.node_id == "n1" and first.expected_cached_tokens == 64 * 16
    c.deliver("n1", QueueChanged(chain, False))
    c.run_for(1.0)
    assert n0.estimate("n1") == frozenset()


def test_a_forward_in_flight_holds_its_prefix_at_the_peer_for_the_next_request() -> None:
    """Before any gossip can say so, the entry node counts the prompt of its own forward
    in flight as held by the peer computing it; a refusal releases it before the request
    is ranked again."""
    rng = random.Random(22)
    c = warm_cluster(3, policy=Policy.COST, link=LinkConfig(delay_s=0.001))
    n0 = c.nodes["n0"]
    chain = tuple(rng.getrandbits(64) for _ in range(64))
    other = (*chain[:48], *(rng.getrandbits(64) for _ in range(16)))  # shares 48 blocks

    def expected_at(peer: str) -> int:
        ranked = n0.route(other, 1100, 0, 1, c.now)
        return next(x.expected_cached_tokens for x in ranked if x.node_id == peer)

    [sent] = c.deliver("n0", RequestArrived(1, chain, 1100, 0, 1, target="n1"))
    assert isinstance(sent, Forward) and sent.peer_id == "n1"
    assert expected_at("n1") == 48 * 16
    assert expected_at("n2") == 0
    c.deliver("n0", ForwardRefused(1, "n1", 0.0, 0.0))
    assert expected_at("n1") == 0


def test_busy_refusal_skips_the_peer_for_retry_after_without_suspecting_it() -> None:
    rng = random.Random(8)
    c = warm_cluster(2)
    chain = hashes_of(c, "n1", rng)
    c.run_for(1.0)
    n0 = c.nodes["n0"]
    assert n0.route(chain, 128, 0, 1, c.now)[0].node_id == "n1"
    t0 = c.now
    offer(c, 1, "n1")
    assert c.deliver("n0", ForwardRefused(1, "n1", 0.5)) == [ExecuteLocally(1, "fallback", 0, 0)]
    assert n0.peer_state("n1") == "alive"  # it answered: not suspect
    assert n0.pushed_back("n1", c.now)
    assert n0.route(chain, 128, 0, 1, c.now)[0].is_self
    assert n0.metrics()["forwards_refused"] == 1
    offer(c, 2, "n1")
    c.deliver("n0", ForwardRefused(2, "n1", 1e9))  # an absurd back-off is ignored
    [local] = c.deliver("n0", RequestArrived(3, (), 128, 0, 1, target="ghost"))
    assert local == ExecuteLocally(3, "fallback", 0, 0)  # an unknown peer: tried, not sent
    assert n0.metrics()["forwards_unknown_peer"] == 1
    assert c.deliver("n0", ForwardRefused(3, "ghost", 0.5)) == []  # not its try: stale
    c.run_until(t0 + 0.51)
    assert not n0.pushed_back("n1", c.now)
    assert n0.route(chain, 128, 0, 1, c.now)[0].node_id == "n1"


def test_a_refusal_as_slower_reports_the_peers_queue_and_keeps_it_a_candidate() -> None:
    """A peer that refused a forward only because it would not beat the sender's alternative
    is not busy as such: the sender does not back off from it, it takes the queue wait the
    refusal gave as a fresh report of the peer's queue (the next decision prices it; the
    next gossip report replaces it), and the peer still gets the hits it holds when they
    pay. (Backing off made a holder unavailable, and the prefixes it held looked held by
    nobody: new `first` copies on the next member of the ring.)"""
    rng = random.Random(8)
    c = warm_cluster(3, policy=Policy.COST)
    chain = hashes_of(c, "n1", rng, n=64)
    c.run_for(1.0)
    n0 = c.nodes["n0"]
    [first] = c.deliver("n0", RequestArrived(1, tuple(chain), 1100, 0, 1))
    assert isinstance(first, Forward) and first.peer_id == "n1"
    [peer] = [p for p in n0.mesh_state(c.now)["peers"]  # type: ignore[attr-defined]
              if p["node_id"] == "n1"]
    service = peer["load"]["mean_service_s"]
    queue_s = 40 * service
    [then] = c.deliver("n0", ForwardRefused(1, "n1", 0.0, queue_s))
    assert not n0.pushed_back("n1", c.now) and n0.peer_state("n1") == "alive"
    assert not (isinstance(then, Forward) and then.peer_id == "n1")  # not tried twice
    ranked = n0.route(chain, 1100, 0, 1, c.now)
    holder = next(x for x in ranked if x.node_id == "n1")  # still a candidate ...
    assert holder.wait_s == pytest.approx(queue_s, rel=0.01)  # ... behind the queue it reported
    assert ranked[0].node_id != "n1"  # a 40-deep queue: not worth it now
    c.run_for(1.0)  # n1's gossip: idle again
    assert n0.route(chain, 1100, 0, 1, c.now)[0].node_id == "n1"  # its hit wins again
    assert n0.metrics()["forwards_refused"] == 1
    offer(c, 2, "n1")
    c.deliver("n0", ForwardRefused(2, "n1", 0.0, 1e9))  # an absurd wait is not believed
    assert n0.metrics()["forward_waits_rejected"] == 1
    assert n0.route(chain, 1100, 0, 1, c.now)[0].node_id == "n1"


def test_a_node_at_its_pushback_threshold_refuses_forwards() -> None:
    node = lone_node(pushback=PushbackConfig(queue_threshold=2, duration_s=1.5))
    node.handle(Tick(), 0.0)
    node.handle(LoadChanged(1, 1, 0, 100), 0.1)
    assert refusal(node, 0.1) is None
    node.handle(LoadChanged(2, 1, 0, 100), 0.2)  # at the threshold: no push-back yet
    assert refusal(node, 0.2) == 1.5
    node.handle(LoadChanged(3, 1, 0, 100), 0.3)  # above: the push-back's remaining time
    assert refusal(node, 0.8) == 1.0
    node.handle(LoadChanged(0, 0, 0, 100), 0.9)
    assert refusal(node, 0.9) is None
    assert node.metrics()["forwards_refused_busy"] == 2


def test_a_node_fronting_a_batching_engine_never_pushes_back_at_a_depth() -> None:
    """A load with a batch (a batching engine) counts its batch in its depth: 40 running is
    no queue, so neither push-back nor a busy refusal; the same depth without one is."""
    node = lone_node(pushback=PushbackConfig(queue_threshold=2, duration_s=1.5))
    node.handle(Tick(), 0.0)
    batch = BatchState(0.005, 1e-4, 0.0, 1e-4, 0.0, 8192, 256, 500_000, 40, 0, 40, 40_000,
                       0, 40_000, 0.0, 0.004, 0.05, 80.0)
    node.handle(LoadChanged(40, 40, 0, 100, batch=batch), 0.1)
    assert refusal(node, 0.1) is None
    assert node.metrics()["pushback_started"] == 0
    node.handle(LoadChanged(40, 1, 0, 100), 0.2)  # no batch report: a queue 40 deep
    assert refusal(node, 0.2) == 1.5
    assert node.metrics()["pushback_started"] == 1


def test_a_forward_is_refused_when_this_node_would_not_beat_the_senders_prediction() -> None:
    node = lone_node()
    node.handle(Tick(), 0.0)
    cold = refusal(node, 0.0, 540, 0, 1, beat_s=None)
    assert cold is None  # no budget given (paper policy): only the threshold applies
    # this node's own prediction for the request, warm and cold (a lone node routes to self)
    warm_pred, cold_pred = (node.route([], 540, c, 1, 0.0)[0].predicted_latency_s for c in (512, 0))
    assert warm_pred < cold_pred
    between = (warm_pred + cold_pred) / 2
    assert refusal(node, 0.0, 540, 512, 1, beat_s=between) is None  # cached here: pays
    cold = refusal_answer(node, 0.0, 540, 0, 1, beat_s=between)
    assert cold == RefuseForward(0, 0.0, 0.0)  # cold, idle: this one (and no queue here)
    node.handle(LoadChanged(3, 1, 0, 100), 0.1)  # a queue: the warm one no longer pays either
    warm = refusal_answer(node, 0.1, 540, 512, 1, beat_s=between)
    # ... and the sender learns the queue's wait; this node is not busy as such: no back-off
    assert warm is not None and warm.retry_after_s == 0.0
    assert warm.queue_s == pytest.approx(3 * node.own_speed().mean_service_s)
    assert node.metrics()["forwards_refused_slower"] == 2
    # refused by its state (at the push-back threshold): back off, no queue wait given
    node.handle(LoadChanged(9, 1, 0, 100), 0.2)
    busy = refusal_answer(node, 0.2, 540, 512, 1, beat_s=between)
    assert busy is not None and busy.retry_after_s > 0 and busy.queue_s is None


def test_a_forward_is_refused_when_its_service_would_delay_this_nodes_queue_too_much() -> None:
    """The refusal check counts what the sender counted (``mesh_cost``): its queue wait and
    service, plus that service again for each request queued here. A forward this node
    would answer within the budget is still refused when the two queued requests it would
    delay make it cost the mesh more than the sender staying."""
    node = lone_node()
    node.handle(Tick(), 0.0)
    service = node.route([], 540, 512, 1, 0.0)[0].predicted_latency_s  # idle: service only
    node.handle(LoadChanged(2, 1, 0, 100), 0.1)
    latency = node.route([], 540, 512, 1, 0.1)[0].predicted_latency_s  # + the queue's wait
    assert latency > service
    within = latency + service  # beats its latency, not latency + 2 × service
    assert refusal(node, 0.1, 540, 512, 1, beat_s=within) is not None
    assert refusal(node, 0.1, 540, 512, 1, beat_s=latency + 2 * service + 1e-6) is None
    assert node.metrics()["forwards_refused_slower"] == 1


def test_a_queue_of_cold_prefills_is_priced_by_its_tokens_not_by_the_mean_service() -> None:
    """The refusal check prices this node's queue by what its requests will compute: two
    queued cold 2,000-token prefills cost more than two places at the mean service time (a
    node that served mostly warm requests), so a forward that pays against the mean is
    refused against the real queue; the same queue, warm, admits it."""
    node = lone_node()
    node.handle(Tick(), 0.0)
    speed = node.own_speed()
    mean_wait = 2 * speed.mean_service_s
    warm = node.route([], 540, 512, 1, 0.0)[0].predicted_latency_s  # the request itself
    cold_queue = LoadChanged(2, 1, 0, 100, queue_prompt_tokens=4000, queue_output_tokens=2,
                             queue_uncached_tokens=4000)
    node.handle(cold_queue, 0.1)
    priced = node.route([], 540, 512, 1, 0.1)[0].predicted_latency_s - warm
    assert priced > 2 * mean_wait  # what the two cold prefills take, not two mean services
    beat = warm + 1.5 * mean_wait  # pays against depth x mean service
    refused = refusal_answer(node, 0.1, 540, 512, 1, beat_s=beat)
    assert refused is not None and refused.queue_s == pytest.approx(priced)
    warm_queue = LoadChanged(2, 1, 0, 100, queue_prompt_tokens=4000, queue_output_tokens=2,
                             queue_uncached_tokens=2)
    node.handle(warm_queue, 0.2)
    assert refusal(node, 0.2, 540, 512, 1, beat_s=beat) is None
    # a shell that does not report its queue's tokens: the mean service prices each place
    node.handle(LoadChanged(2, 1, 0, 100), 0.3)
    assert node.route([], 540, 512, 1, 0.3)[0].predicted_latency_s - warm == pytest.approx(
        mean_wait)


def test_forward_succeeded_inserts_optimistically_and_measures_rtt() -> None:
    c = warm_cluster(2)
    n0 = c.nodes["n0"]
    c.deliver("n0", RequestArrived(1, (11, 22, 33), 128, 0, 1, target="n1"))
    c.deliver("n0", ForwardAccepted(1, "n1", 0))
    assert not {11, 22, 33} & n0.estimate("n1")  # accepted is not answered yet
    c.deliver("n0", RequestDone(1, forward_overhead_s=0.004))
    assert {11, 22, 33} <= n0.estimate("n1")
    [peer] = n0.mesh_state(c.now)["peers"]  # type: ignore[misc]
    assert peer["rtt_measured"] is True
    assert n0.metrics()["requests_fallback"] == 0 and n0.metrics()["requests_forwarded"] == 1
    c.deliver("n0", RequestArrived(2, (1,), 128, 0, 1, target="ghost"))
    c.deliver("n0", RequestDone(2, forward_overhead_s=0.004))  # served here: no insert for anyone
    assert n0.estimate("ghost") == frozenset()
    assert n0.metrics()["requests_fallback"] == 1


def test_cost_keeps_requests_here_before_a_round_trip_was_measured() -> None:
    """On a 1 s link the gossip that shows a peer's cache arrives 2 s before the first echo
    that measures the link: in between, the 2 ms prior made a certain cache hit there look
    worth a forward that cost 2 s. Nothing measured: serve here (the peer only as a fallback,
    for a full or leaving node); measured: the real price."""
    c = TwinCluster(2, router=RouterConfig(policy=Policy.COST), link=LinkConfig(delay_s=1.0),
                    seed=11)
    n0 = c.nodes["n0"]
    chain = hashes_of(c, "n1", random.Random(1), n=48)
    tokens = 48 * c.fingerprint.block_size
    while not set(chain) <= n0.estimate("n1"):
        c.run_for(0.25)
    [peer] = n0.mesh_state(c.now)["peers"]  # type: ignore[misc]
    assert peer["rtt_measured"] is False
    ranked = n0.route(chain, tokens, 0, 1, c.now)
    assert ranked[0].is_self  # the peer stays behind it, for what this node cannot serve
    assert [c.node_id for c in ranked[1:]] == ["n1"]
    while not n0.mesh_state(c.now)["peers"][0]["rtt_measured"]:  # type: ignore[index]
        c.run_for(0.25)
    [peer] = n0.mesh_state(c.now)["peers"]  # type: ignore[misc]
    assert peer["rtt_s"] == pytest.approx(2.0, abs=0.1)
    assert n0.route(chain, tokens, 0, 1, c.now)[0].is_self  # 2 s buys no 0.07 s prefill


def test_the_queue_waits_forwards_met_teach_the_error_of_that_peers_predictions() -> None:
    c = warm_cluster(2, policy=Policy.COST)
    n0 = c.nodes["n0"]

    def forward(rid: int, waited: float) -> None:
        offer(c, rid, "n1")
        c.deliver("n0", ForwardAccepted(rid, "n1", 0))
        c.deliver("n0", RequestDone(rid, forward_overhead_s=0.004, forward_queue_s=waited))

    def error() -> float:
        [peer] = n0.mesh_state(c.now)["peers"]  # type: ignore[misc]
        return float(peer["wait_error_s"])

    assert error() == 0.0
    forward(1, 0.5)  # predicted no wait (a target: no prediction), met half a second
    first = error()
    assert first == pytest.approx(n0.config.priors.alpha * 0.5, rel=0.05)
    forward(2, 1e9)  # a peer's absurd claim: counted, not learnt
    assert n0.metrics()["forward_waits_rejected"] == 1 and error() <= first


def test_how_late_a_peers_first_tokens_come_corrects_its_predicted_wait() -> None:
    """A forward whose first token came later than the chosen candidate's ``ttft_s`` teaches
    that peer's lateness (signed, decaying): added to its predicted wait, a peer whose
    forwards answer late loses a near tie to this node; one answering early gains none of a
    negative wait, and a measurement the shell could not make teaches nothing."""
    rng = random.Random(5)
    c = warm_cluster(2, policy=Policy.COST)
    chain = hashes_of(c, "n1", rng, n=40)
    c.run_for(1.0)
    n0 = c.nodes["n0"]

    def lateness() -> float:
        [peer] = n0.mesh_state(c.now)["peers"]  # type: ignore[misc]
        return float(peer["lateness_s"])

    [head] = n0.route(chain, 700, 0, 1, c.now)[:1]
    assert head.node_id == "n1" and head.ttft_s is not None  # its hit wins
    for rid in range(1, 40):
        [action] = c.deliver("n0", RequestArrived(rid, tuple(chain), 700, 0, 1))
        if not isinstance(action, Forward):
            break
        c.deliver("n0", ForwardAccepted(rid, "n1", 640))
        c.deliver("n0", RequestDone(rid, forward_overhead_s=0.004, forward_queue_s=0.0,
                                    forward_ttft_s=head.ttft_s + 1.0))
    else:
        raise AssertionError("a peer answering a second late kept every request")
    assert rid > 1 and lateness() > 0.1
    later = c.now + 60.0
    c.run_until(later)  # no forwards for six windows: the correction fades
    assert lateness() < 0.01
    before = lateness()
    c.deliver("n0", RequestDone(10_000, forward_ttft_s=0.5))  # no such flight: stale
    assert lateness() == before


def test_a_batching_peers_refusal_teaches_lateness_and_a_queues_does_not() -> None:
    """A refusal as slower says the peer's wait: for a peer whose view is a batch report
    (aged, which a point report cannot replace) the excess over the predicted wait is
    learnt as lateness; a peer without one takes it as its queue (no lateness, or the two
    would count the same wait twice)."""
    def lateness(c: TwinCluster) -> float:
        [peer] = c.nodes["n0"].mesh_state(c.now)["peers"]  # type: ignore[misc]
        return float(peer["lateness_s"])

    for batching in (True, False):
        c = warm_cluster(2, policy=Policy.COST)
        chain = tuple(hashes_of(c, "n1", random.Random(2), n=64))
        batch = BatchState(0.005, 1e-4, 0.0, 1e-4, 0.0, 8192, 256, 500_000, 1, 0, 1, 1_000,
                           0, 1_000, 0.0, 0.0, 0.05, 10.0) if batching else None
        c.deliver("n1", LoadChanged(1, 1, 0, 1 << 20, batch=batch))
        c.run_for(1.0)
        [first] = c.deliver("n0", RequestArrived(1, chain, 1100, 0, 1))
        assert isinstance(first, Forward) and first.peer_id == "n1"
        c.deliver("n0", ForwardRefused(1, "n1", 0.0, 2.0))
        assert (lateness(c) > 0.1) is batching


def test_rent_spent_forwarding_to_a_holder_buys_a_local_copy_in_the_end() -> None:
    """Each first ranking that forwards to the holder of a prefix this node lacks adds that
    round trip to the prefix's rent; re-rankings add nothing; once the rent reaches what a
    copy here costs more than the forward, the request stays here, tagged local_copy."""
    rng = random.Random(3)
    c = warm_cluster(3, policy=Policy.COST)
    chain = hashes_of(c, "n2", rng, n=200)
    c.run_for(1.0)
    n0 = c.nodes["n0"]
    for _ in range(50):
        assert n0.route(chain, 3200, 0, 1, c.now)[0].node_id == "n2"  # observe=False
    heads = []
    for _ in range(2000):
        head = n0.route(chain, 3200, 0, 1, c.now, observe=True)[0]
        heads.append(head.node_id)
        if head.is_self:
            assert head.placement is Tag.LOCAL_COPY
            break
    assert heads[0] == "n2" and heads[-1] == "n0" and len(heads) > 10


def test_the_waits_rented_forwards_met_at_the_holder_count_as_rent() -> None:
    """A rental that waits at the holder pays that wait (beyond the wait this node predicted
    for itself) on top of the round trip: forwards that each wait 0.1 s there buy a local
    copy after a few requests, where forwards that find the holder idle take many more. The
    rent never goes below 0: waits shorter than this node's own, while it was the busier
    one, do not delay the copy once the holder is the busy one."""

    def setup() -> tuple[TwinCluster, tuple[int, ...]]:
        c = warm_cluster(3, policy=Policy.COST)
        chain = tuple(hashes_of(c, "n2", random.Random(3), n=200))
        c.run_for(1.0)
        return c, chain

    def forwards_until_bought(c: TwinCluster, chain: tuple[int, ...], waited: float,
                              first: int = 1) -> int:
        n0 = c.nodes["n0"]
        for rid in range(first, first + 500):
            [action] = c.deliver("n0", RequestArrived(rid, chain, 3200, 0, 1))
            if isinstance(action, ExecuteLocally):
                assert n0.placement_of(rid) is Tag.LOCAL_COPY  # bought, not a tie
                return rid - first
            assert isinstance(action, Forward) and action.peer_id == "n2"
            c.deliver("n0", ForwardAccepted(rid, "n2", 3200))
            c.deliver("n0", RequestDone(rid, forward_overhead_s=0.004, forward_queue_s=waited))
            assert n0.metrics()["forward_waits_rejected"] == 0
        raise AssertionError("never bought")

    idle = forwards_until_bought(*setup(), 0.0)
    busy = forwards_until_bought(*setup(), 0.1)
    assert 1 <= busy <= 5 and idle >= 3 * busy  # (the rentals to come shorten both)

    c, chain = setup()
    # this node busy (its own queue: four cold prompts), the holder's forwards wait nothing
    c.deliver("n0", LoadChanged(4, 1, 0, 100_000, 4 * 3200, 4, 4 * 3200))
    for rid in range(1000, 1010):
        [action] = c.deliver("n0", RequestArrived(rid, chain, 3200, 0, 1))
        assert isinstance(action, Forward) and action.peer_id == "n2"
        c.deliver("n0", ForwardAccepted(rid, "n2", 3200))
        c.deliver("n0", RequestDone(rid, forward_overhead_s=0.004, forward_queue_s=0.0))
    c.deliver("n0", LoadChanged(0, 0, 0, 100_000))  # idle again; now the holder is busy
    assert forwards_until_bought(c, chain, 0.1, first=2000) <= busy + 1


def test_a_held_prefix_is_replicated_for_its_load_not_for_a_few_requests() -> None:
    """Replicas are sized by the prefix's load: its rate here less one standard deviation of
    the count, times the members, times the service of a request that finds what the best
    holder holds cached (not only the placement key's blocks: that priced a hit as a cold
    prefill and made modest prefixes look hot). A few requests in a window keep one owner;
    a real flood gets more."""
    rng = random.Random(9)
    c = warm_cluster(3, policy=Policy.COST)
    chain = hashes_of(c, "n2", rng, n=200)  # n2 holds a 3,200-token prefix
    c.run_for(1.0)
    n0 = c.nodes["n0"]
    cfg = n0.config.router
    req = RouteInput(3200, 1)

    def placement(requests: int) -> tuple[str, ...]:
        placed = None
        for _ in range(requests):
            parts = n0._parts
            nodes = [parts.own.self_info(0, c.now),
                     *parts.routing.peer_infos(chain, 3200, Policy.COST, c.now)]
            placed = parts.placer.place(chain, req, nodes, c.now, observe=True)
            c.run_for(0.01)
        assert placed is not None
        return placed[0].owners

    few = 12  # in 0.12 s: 12 a window here, 36 across the mesh
    cold = n0._parts.own.self_info(0, c.now).speed.service_s(3200, 0, 1, cfg.context_scale)
    assert few * 3 / cfg.replica_window_s * cold > cfg.replica_load  # hot if priced cold
    assert len(placement(few)) == 1
    # a flood whose requests never wait (its first owner's queue empty: one client sending
    # them back to back) keeps one owner; once they queue there, more (the busy owner, now
    # over the load bound, is passed over: its copy stays, new ones go to the next members)
    [first] = placement(3000)
    c.deliver(first, LoadChanged(4, 1, 0, 100))
    c.run_for(0.6)  # its next gossip round reports the queue
    flood = placement(1)
    assert len(flood) > 1 and first not in flood


def test_a_speed_nothing_refreshed_for_a_load_window_restarts_from_the_peers_median() -> None:
    """A node that learnt a far slower speed (requests served while the machine was
    oversubscribed) and then served nothing for a load window adopts the median speed of
    the peers that served lately, and its peers see that in its next report; not while a
    request is queued or running (a sample is coming). The next request weighs as after a
    fresh start. An idle mesh keeps its estimates (nobody has a fresher one)."""
    c = warm_cluster(3, policy=Policy.COST)
    n0, n1 = c.nodes["n0"], c.nodes["n1"]
    window = n0.config.router.load_window_s
    c.run_for(window + 1.0)
    assert all(n.metrics()["speed_adopted"] == 0 for n in c.nodes.values())
    per_token = n0.own_speed().prefill_s_per_token

    def seconds_of_peers_serving(seconds: float) -> None:
        for _ in range(int(seconds)):
            for peer in ("n1", "n2"):
                c.deliver(peer, RequestServed(1000, 0, per_token * 1000, 1, 0.0, 0.2))
            c.run_for(1.0)

    seconds_of_peers_serving(2)
    for _ in range(5):
        c.deliver("n0", RequestServed(1000, 0, 100 * per_token * 1000, 1, 0.0, 1.0))
    slow, adoptions = n0.own_speed(), n0.metrics()["speed_adopted"]
    assert slow.prefill_s_per_token > 20 * per_token
    c.deliver("n0", LoadChanged(1, 1, 0, 100))  # one running: no adoption while it runs
    seconds_of_peers_serving(window + 1.0)
    assert n0.own_speed() == slow and n0.metrics()["speed_adopted"] == adoptions
    c.deliver("n0", LoadChanged(0, 0, 0, 100))
    seconds_of_peers_serving(2)  # gossip rounds: the estimate is a window old, the node idle
    adopted = n0.own_speed()
    assert n0.metrics()["speed_adopted"] == adoptions + 1
    assert adopted.prefill_s_per_token < 2 * per_token  # the busy peers' speed
    [view] = [p for p in n1.mesh_state(c.now)["peers"] if p["node_id"] == "n0"]  # type: ignore[index, union-attr]
    assert view["load"]["prefill_s_per_token"] == pytest.approx(  # type: ignore[index]
        adopted.prefill_s_per_token, rel=1e-3)
    c.deliver("n0", RequestServed(1000, 0, 10 * per_token * 1000, 1, 0.0, 1.0))
    assert n0.own_speed().prefill_s_per_token > 3 * per_token  # half the way, not a fifth


def test_a_node_that_measured_nothing_adopts_the_peers_median_at_once() -> None:
    """A node that has served nothing advertises the configured prior, the tiny engine's
    speed on an idle machine; peers that measured a loaded machine (5x slower here) would
    see it as the fastest node and send it cold prefills. It adopts their median at its
    first round after they served, not a load window later, and only once; while busy
    too (its first request measures nothing until it ends)."""
    c = warm_cluster(3, policy=Policy.COST)
    n0, n1 = c.nodes["n0"], c.nodes["n1"]
    prior = n0.own_speed().prefill_s_per_token
    c.run_for(2.0)
    assert n0.metrics()["speed_adopted"] == 0  # an idle mesh: nobody measured anything
    c.busy_for({"n1": 1.5, "n2": 1.5})  # busy with first requests: still nothing measured
    assert n0.metrics()["speed_adopted"] == 0  # (adopting their priors would spend the rule)
    c.set_load("n0", 1, 1)  # its own first request runs
    for peer in ("n1", "n2"):
        for _ in range(3):
            c.deliver(peer, RequestServed(1000, 0, 5 * prior * 1000, 1, 0.0, 0.6))
    c.run_for(1.5)  # the peers' reports, then n0's next round
    assert n0.metrics()["speed_adopted"] == 1
    assert n0.own_speed().prefill_s_per_token > 3 * prior
    [view] = [p for p in n1.mesh_state(c.now)["peers"] if p["node_id"] == "n0"]  # type: ignore[index, union-attr]
    assert view["load"]["prefill_s_per_token"] == pytest.approx(  # type: ignore[index]
        n0.own_speed().prefill_s_per_token, rel=1e-3)
    c.run_for(3.0)  # measured now (adopted): the stale-speed rule's window applies again
    assert n0.metrics()["speed_adopted"] == 1


def test_peers_learn_when_a_node_last_measured_its_speed_not_when_it_adopted_one() -> None:
    """What makes a peer's speed fresh for the stale-speed rule is that it *measured* it
    (served a request) lately, as its load reports say (``Load.speed_measured_at``, through
    the report's stamp). A changed report is not a measurement (an adoption changes it too):
    on the real cluster (the hot prefix at Poisson 50 %, right after the capacity probe) a
    node whose report changed to a probe-era speed looked fresh, and two idle peers adopted
    that stale speed from it, 3x slower than the node that was serving."""
    c = warm_cluster(3, policy=Policy.COST)
    n0, n1 = c.nodes["n0"], c.nodes["n1"]
    prior = n0.own_speed().prefill_s_per_token
    c.deliver("n1", RequestServed(1000, 0, 5 * prior * 1000, 1, 0.0, 0.6))
    served_at = c.now
    c.run_for(1.5)
    assert n0.metrics()["speed_adopted"] == 1  # n0 measured nothing: adopted n1's
    view_of_n0 = n1._parts.gossip.estimates["n0"]
    assert view_of_n0.speed is not None and view_of_n0.speed_measured_at is None
    view_of_n1 = n0._parts.gossip.estimates["n1"]
    assert view_of_n1.speed_measured_at == pytest.approx(served_at, abs=0.05)
    c.deliver("n0", RequestServed(1000, 0, 5 * prior * 1000, 1, 0.0, 0.6))
    measured_at = c.now
    c.run_for(1.5)
    assert view_of_n0.speed_measured_at == pytest.approx(measured_at, abs=0.05)


def test_load_above_threshold_advertises_immediately() -> None:
    node = lone_node(pushback=PushbackConfig(queue_threshold=2, duration_s=1.0))
    node.handle(Tick(), 0.0)
    actions = node.handle(LoadChanged(3, 1, 0, 100), 0.2)
    assert any(isinstance(a, Log) for a in actions)
    assert node.next_deadline() == 0.2
    assert node.mesh_state(0.2)["pushback_remaining_s"] == 1.0
    assert node.metrics()["pushback_started"] == 1


def test_fingerprint_mismatch_is_refused_once_loudly_and_counted() -> None:
    c = TwinCluster(2, seed=12)
    other = Fingerprint("another-model", "bytes", 16)
    c.add_node("x", fingerprint=other)
    c.run_for(5.0)
    n0 = c.nodes["n0"]
    warnings = [log.message for log in c.logs("n0", "warning")]
    assert len(warnings) == 1 and "x" in warnings[0] and "another-model" in warnings[0]
    assert n0.metrics()["messages_rejected_fingerprint"] >= 5
    assert n0.peer_state("x") is None and n0.estimate("x") == frozenset()
    assert n0.metrics()["peers_alive"] == 1
    x_warnings = c.logs("x", "warning")  # the refused side learns why, once
    assert len(x_warnings) == 1 and "test-model" in x_warnings[0].message


def test_messages_from_an_old_incarnation_are_rejected_as_stale() -> None:
    c = warm_cluster(2)
    old = c.nodes["n1"]
    stale = [a for a in old.handle(Tick(), c.now + 1) if isinstance(a, Send)]
    c.restart("n1")
    c.run_for(1.0)
    n0 = c.nodes["n0"]
    before = n0.metrics()["messages_rejected_stale"]
    for send in stale:
        c.deliver("n0", MessageReceived(send.payload))
    assert n0.metrics()["messages_rejected_stale"] == before + len(stale)


def test_utilization_is_gossiped_and_bounds_forwards_to_a_busy_specialist() -> None:
    rng = random.Random(3)
    c = warm_cluster(3, policy=Policy.COST, link=LinkConfig(delay_s=0.001))
    chain = hashes_of(c, "n1", rng, n=64)  # n1 caches a 1,024-token prefix
    c.run_for(1.0)
    n0 = c.nodes["n0"]
    assert n0.route(chain, 1100, 0, 1, c.now)[0].node_id == "n1"
    # One request is no overload: light traffic must still reach the only warm node.
    c.busy_for({"n1": 0.5})
    c.run_for(1.0)
    assert n0.route(chain, 1100, 0, 1, c.now)[0].node_id == "n1"
    # n1 has been busy for most of its recent window, but its queue is empty now: an idle
    # holder has room, and keeps a certain hit (a cold copy elsewhere would gain nothing).
    c.busy_for({"n1": 8.0})
    c.run_for(1.0)
    assert n0.mesh_state(c.now)["node_id"] == "n0"
    assert n0.route(chain, 1100, 0, 1, c.now)[0].node_id == "n1"
    # ... and still busy, with requests queued: overflow leaves the busy specialist, served
    # here or by the prefix's next ring owner as a deliberate replica.
    c.deliver("n1", LoadChanged(3, 1, 0, 100))
    c.run_for(0.6)  # its next gossip round reports the queue
    head = n0.route(chain, 1100, 0, 1, c.now)[0]
    assert head.node_id != "n1" and (head.is_self or head.placement is Tag.REPLICA)
    c.deliver("n1", LoadChanged(0, 0, 0, 100))
    c.run_for(60.0)  # the busy period decays away: affinity routing resumes
    assert n0.route(chain, 1100, 0, 1, c.now)[0].node_id == "n1"


def test_a_full_node_refuses_forwards_and_rejects_what_no_peer_takes() -> None:
    node = lone_node(admission=AdmissionConfig(max_queue_requests=2))
    node.handle(Tick(), 0.0)
    node.handle(LoadChanged(1, 1, 0, 100), 0.1)
    assert refusal(node, 0.1) is None
    [local] = node.handle(RequestArrived(1, (), 64, 0, 4), 0.1)
    assert isinstance(local, ExecuteLocally)
    node.handle(LoadChanged(2, 1, 0, 100), 0.2)  # full: the cap is two requests
    retry = refusal(node, 0.2)
    assert retry is not None and retry >= 1.0
    assert node.handle(RequestArrived(2, (), 64, 0, 4), 0.2) == [RejectRequest(2, retry)]
    m = node.metrics()
    assert m["forwards_refused_full"] == 1 and m["requests_rejected"] == 1


def test_a_token_cap_bounds_prompt_plus_max_tokens_of_the_queue() -> None:
    node = lone_node(admission=AdmissionConfig(max_queue_tokens=1000))
    node.handle(Tick(), 0.0)
    node.handle(LoadChanged(1, 1, 0, 100, 500, 200), 0.1)  # 700 tokens queued or running
    assert refusal(node, 0.1, prompt=200, max_tokens=100) is None  # 1,000: at the cap
    retry = refusal(node, 0.1, prompt=200, max_tokens=101)  # 1,001: over it
    assert retry is not None and retry >= 1.0
    assert node.handle(RequestArrived(1, (), 290, 0, 20), 0.1) == [RejectRequest(1, retry)]
    node.handle(LoadChanged(0, 0, 0, 100), 0.2)  # idle: even a request over the cap runs
    [local] = node.handle(RequestArrived(2, (), 5000, 0, 64), 0.2)
    assert isinstance(local, ExecuteLocally)
    m = node.metrics()
    assert m["admission_full_tokens"] == 2 and m["requests_rejected"] == 1
    assert m["forwards_refused_full"] == 1


def test_the_default_token_cap_is_what_the_engine_gets_through_within_max_queue_wait() -> None:
    adm = AdmissionConfig(max_queue_wait_s=30.0)  # max_queue_tokens 0: derived
    node = lone_node(admission=adm)
    prior = node.token_rate()  # 272 tokens per prior request time
    assert 1000 < prior < 5000
    node.handle(Tick(), 0.0)
    for _ in range(30):  # measured: 1,016 tokens (mostly cached prompt) per 0.1 s of service
        node.handle(RequestServed(1000, 900, 0.01, 16, 0.09, 0.1), 0.0)
    assert node.token_rate() == pytest.approx(10_160, rel=0.02)
    assert token_cap(adm, 10_000.0) == 300_000  # 30 s x 10,000 tokens/s
    assert token_cap(adm, 10_000.0, streams=4) == 1_200_000  # four streams at once
    assert token_cap(replace(adm, max_queue_tokens=None), 10_000.0) is None
    assert token_cap(replace(adm, max_queue_tokens=5), 10_000.0) == 5
    speed = node.own_speed()
    load = LoadChanged(2, 1, 0, 100, 250_000, 40_000)  # 290,000 tokens waiting or running
    assert admission(adm, speed, 10_000.0, load, 9_000, 1_000) is None  # 300,000: at the cap
    full = admission(adm, speed, 10_000.0, load, 9_000, 1_001)
    assert full is not None and full.bound == "tokens"
    assert full.wait_s == pytest.approx(29.0)  # the queue's tokens at the measured rate
    two = LoadChanged(2, 2, 0, 100, 250_000, 40_000)  # two streams at once: twice the room
    assert admission(adm, speed, 10_000.0, two, 200_000, 100_000) is None
    assert admission(replace(adm, max_queue_tokens=None), speed, 10_000.0, load, 10**9, 1) \
        is None
    capped = admission(replace(adm, max_queue_requests=2), speed, 10_000.0, load, 0, 1)
    assert capped is not None and capped.bound == "requests"
    node.handle(LoadChanged(2, 1, 0, 100, 250_000, 40_000), 0.0)  # the node decides the same
    [reject] = node.handle(RequestArrived(1, (), 10**6, 0, 16), 0.0)
    assert isinstance(reject, RejectRequest)
    assert node.metrics()["admission_full_tokens"] == 1


@settings(max_examples=200, deadline=None)
@given(
    depth=st.integers(0, 64),
    prompt=st.integers(0, 100_000),
    output=st.integers(0, 100_000),
    extra=st.integers(0, 100_000),
    cap=st.sampled_from([0, 1, 2_000, 50_000, None]),
    rate=st.floats(0.0, 1e6),
)
def test_admission_is_monotone_in_the_queued_tokens(
    depth: int, prompt: int, output: int, extra: int, cap: int | None, rate: float
) -> None:
    """More queued tokens never turn a full node into one with room; idle always has room."""
    adm = AdmissionConfig(max_queue_tokens=cap)
    speed = lone_node().own_speed()
    small = LoadChanged(depth, min(depth, 1), 0, 100, prompt, output)
    big = LoadChanged(depth, min(depth, 1), 0, 100, prompt + extra, output + extra)
    if admission(adm, speed, rate, small, 100, 10) is not None:
        assert admission(adm, speed, rate, big, 100, 10) is not None
    if depth == 0:
        assert admission(adm, speed, rate, big, 10**9, 10**9) is None


def test_a_refused_request_is_ranked_again_from_the_current_view() -> None:
    """A burst: n0 routes a request to n1 (which holds its prefix) while n0 is idle; by the
    time n1 refuses, n0's own queue is long, so the next try is the idle n2, not n0."""
    rng = random.Random(12)
    c = warm_cluster(3, policy=Policy.COST)
    chain = hashes_of(c, "n1", rng, n=64)
    c.run_for(1.0)
    [first] = c.deliver("n0", RequestArrived(1, tuple(chain), 1100, 0, 1))
    assert isinstance(first, Forward) and first.peer_id == "n1"
    c.deliver("n0", LoadChanged(6, 1, 0, 100))  # the rest of the burst queued here meanwhile
    [second] = c.deliver("n0", ForwardRefused(1, "n1", 0.5))
    assert isinstance(second, Forward) and second.peer_id == "n2"
    assert second.route == "fallback"
    c.deliver("n0", ForwardRefused(1, "n2", 0.5))  # the second peer: the limit is reached
    assert c.nodes["n0"].metrics()["requests_in_flight"] == 1  # running here now
