"""Router policies: availability, the cost policy's guarantees, Algorithm 1, baselines."""

from __future__ import annotations

import random
from dataclasses import replace

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from radixmesh.core.estimators import SpeedReport
from radixmesh.core.router import (
    Candidate,
    NodeInfo,
    Placement,
    Policy,
    RouteInput,
    Router,
    RouterConfig,
    Tag,
    mean_utilization,
    mesh_cost,
    over_bound,
    predict_latency,
    predict_service,
    predict_wait,
    request_slack,
)

SPEED = SpeedReport(0.004, 8e-5, 0.007, 0.05)
SCALE = RouterConfig().context_scale

speed_st = st.builds(
    SpeedReport,
    st.floats(0, 0.01),
    st.floats(1e-6, 1e-3),
    st.floats(1e-4, 0.05),
    st.floats(0.001, 1.0),
)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[RouteInput, list[NodeInfo]]:
    prompt = draw(st.integers(1, 4000))
    req = RouteInput(prompt, draw(st.integers(1, 64)))
    n_peers = draw(st.integers(0, 6))
    nodes = [
        NodeInfo(
            "self",
            True,
            draw(st.integers(0, prompt)),
            0.0,
            draw(st.integers(0, 20)),
            draw(speed_st),
        )
    ]
    for i in range(n_peers):
        nodes.append(
            NodeInfo(
                f"p{i}",
                False,
                draw(st.integers(0, prompt)),
                draw(st.floats(0, 0.5)),
                draw(st.integers(0, 20)),
                draw(speed_st),
                suspect=draw(st.booleans()),
                pushed_back=draw(st.booleans()),
            )
        )
    draw(st.randoms()).shuffle(nodes)
    return req, nodes


def peer(name: str, cached: int, *, rtt: float = 0.001, queue: int = 0, **kw: bool) -> NodeInfo:
    return NodeInfo(name, False, cached, rtt, queue, SPEED, **kw)


def me(cached: int = 0, queue: int = 0) -> NodeInfo:
    return NodeInfo("self", True, cached, 0.0, queue, SPEED)


def rank(policy: Policy, req: RouteInput, nodes: list[NodeInfo], seed: int = 0) -> list[str]:
    out = Router(RouterConfig(policy=policy)).rank(req, nodes, random.Random(seed))
    return [c.node_id for c in out]


@settings(max_examples=200, deadline=None)
@given(scenario=scenarios(), policy=st.sampled_from(list(Policy)), seed=st.integers(0, 99))
def test_self_always_ranked_and_unavailable_peers_never(
    scenario: tuple[RouteInput, list[NodeInfo]], policy: Policy, seed: int
) -> None:
    req, nodes = scenario
    ranked = Router(RouterConfig(policy=policy)).rank(req, nodes, random.Random(seed))
    ids = [c.node_id for c in ranked]
    assert "self" in ids and len(set(ids)) == len(ids)
    by_id = {n.node_id: n for n in nodes}
    assert all(by_id[i].available for i in ids)  # suspect / pushed back never chosen
    for c in ranked:
        assert 0 <= c.expected_cached_tokens <= req.prompt_tokens
        assert c.predicted_latency_s >= 0 and c.is_self == (c.node_id == "self")
    if policy is not Policy.NONE:
        assert sorted(ids) == sorted(n.node_id for n in nodes if n.available)


@settings(max_examples=200, deadline=None)
@given(scenario=scenarios(), seed=st.integers(0, 99))
def test_cost_never_forwards_when_rtt_exceeds_the_largest_possible_saving(
    scenario: tuple[RouteInput, list[NodeInfo]], seed: int
) -> None:
    req, nodes = scenario
    me = next(n for n in nodes if n.is_self)
    local = predict_latency(req, me, SCALE)
    local_work = predict_service(req, me, SCALE)
    slow = []
    for n in nodes:
        if n.is_self:
            slow.append(n)
            continue
        # Best case for the peer: everything but one token cached, nobody queued there; and
        # the most the mesh can save besides: the local work, once for each request queued
        # here (mesh_cost's term for the requests behind it; none one at a time).
        best_service = n.speed.service_s(1, req.prompt_tokens - 1, req.max_tokens, SCALE)
        spared = local_work * me.queue_depth
        rtt = max(n.rtt_s, local - best_service + spared + 1e-9)
        slow.append(
            NodeInfo(
                n.node_id,
                False,
                n.cached_tokens,
                rtt,
                n.queue_depth,
                n.speed,
                n.suspect,
                n.pushed_back,
            )
        )
    # each node's own speed (the saving bound is computed from it): robust speeds off here
    raw = Router(RouterConfig(policy=Policy.COST, speed_tolerance=None))
    assert raw.rank(req, slow, random.Random(seed))[0].is_self


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.integers(1, 4000),
    self_queue=st.integers(0, 10),
    extra_queues=st.lists(st.integers(0, 10), max_size=6),
    rtts=st.lists(st.floats(0, 0.1), min_size=6, max_size=6),
    seed=st.integers(0, 99),
)
def test_cost_with_no_cache_anywhere_stays_local(
    prompt: int, self_queue: int, extra_queues: list[int], rtts: list[float], seed: int
) -> None:
    # Equal hardware, nothing cached anywhere, peers at least as busy as self: stay local.
    req = RouteInput(prompt, 1)
    nodes = [me(0, self_queue)]
    nodes += [
        peer(f"p{i}", 0, rtt=rtts[i], queue=self_queue + q) for i, q in enumerate(extra_queues)
    ]
    ranked = Router(RouterConfig()).rank(req, nodes, random.Random(seed))
    assert ranked[0].is_self and ranked[0].expected_cached_tokens == 0


def test_cost_spreads_ties_among_equal_peers() -> None:
    req = RouteInput(3000, 1)
    nodes = [me(0, queue=5)] + [peer(f"p{i}", 2500) for i in range(6)]
    heads = {rank(Policy.COST, req, nodes, seed)[0] for seed in range(60)}
    assert "self" not in heads and len(heads) >= 3


def test_cost_forwards_when_the_saving_beats_the_rtt() -> None:
    req = RouteInput(3000, 1)
    nodes = [me(0), peer("warm", 2900, rtt=0.002), peer("cold", 0)]
    assert rank(Policy.COST, req, nodes)[0] == "warm"
    slow = [me(0), peer("warm", 2900, rtt=10.0)]
    assert rank(Policy.COST, req, slow)[0] == "self"


def test_cost_candidates_carry_what_the_peer_must_beat() -> None:
    req = RouteInput(3000, 1)
    nodes = [me(0, queue=2), peer("warm", 2900, rtt=0.002), peer("cold", 0, rtt=0.003)]
    out = Router(RouterConfig(policy=Policy.COST)).rank(req, nodes, random.Random(0))
    local = next(c for c in out if c.is_self)
    assert local.beat_s is None
    # What staying here costs the mesh: the local prediction (when the forward arrives, its
    # way out is spent and the way back is paid whether the peer serves it or refuses it),
    # plus the local work again for each of the 2 requests queued here (they wait for it).
    stay = mesh_cost(req, nodes, SCALE)[0]
    assert stay > local.predicted_latency_s
    for c in out:
        if not c.is_self:
            assert c.beat_s == pytest.approx(stay)
    paper = Router(RouterConfig(policy=Policy.PAPER)).rank(req, nodes, random.Random(0))
    assert all(c.beat_s is None for c in paper)  # Algorithm 1 forwards regardless of cost


@settings(max_examples=200, deadline=None)
@given(scenario=scenarios())
def test_mesh_cost_is_the_predicted_latency_when_nothing_is_queued(
    scenario: tuple[RouteInput, list[NodeInfo]],
) -> None:
    req, nodes = scenario
    idle = [replace(n, queue_depth=0.0) for n in nodes]  # one request at a time
    assert mesh_cost(req, idle, SCALE) == [predict_latency(req, n, SCALE) for n in idle]
    # under load each node's service counts once more per request queued there, and, at a
    # node that serves utilization / mean service requests per second, half of it once more
    # per request arriving while it runs
    for n, c in zip(nodes, mesh_cost(req, nodes, SCALE), strict=True):
        service = predict_service(req, n, SCALE)
        assert c == pytest.approx(predict_latency(req, n, SCALE) + service * n.queue_depth)
        busy = replace(n, utilization=0.5)
        arriving = 0.5 / n.speed.mean_service_s * service * service / 2.0
        assert mesh_cost(req, [busy], SCALE)[0] == pytest.approx(c + arriving)


def test_a_long_request_stays_off_a_holder_busy_with_a_stream_of_short_ones() -> None:
    # The holder of a hot prefix serves 90 % of the time, requests of 50 ms on average, and
    # nothing is queued there at this moment. A short request of the prefix goes there (it
    # holds up the stream for a few ms); a long one, which would hold it up for most of a
    # second, stays here: every request of the stream arriving meanwhile would wait for it.
    holder = replace(peer("holder", 1000, rtt=0.002), utilization=0.9)
    short, long = RouteInput(1100, 1), RouteInput(5000, 1)
    assert rank(Policy.COST, short, [me(0), holder])[0] == "holder"
    assert predict_latency(long, holder, SCALE) < predict_latency(long, me(0), SCALE)
    assert rank(Policy.COST, long, [me(0), holder])[0] == "self"
    assert rank(Policy.COST, long, [me(0), replace(holder, utilization=0.0)])[0] == "holder"


def test_an_idle_node_makes_its_own_copy_rather_than_queue_at_a_busy_holder() -> None:
    # The agentic shape: a 1,300-token system prompt every other node holds, this node's
    # engine idle. A forward to the holder is faster for this request alone (0.12 s against
    # 0.14 s) but its service delays the 2 requests queued there, while a copy here delays
    # nobody: stay (and the copy serves every later request entering here).
    req = RouteInput(1400, 1)
    nodes = [me(0), peer("holder", 1300, rtt=0.002, queue=2)]
    assert predict_latency(req, nodes[1], SCALE) < predict_latency(req, nodes[0], SCALE)
    assert rank(Policy.COST, req, nodes)[0] == "self"
    # with nothing queued at the holder the hit is worth the round trip
    nodes = [me(0), peer("holder", 1300, rtt=0.002, queue=0)]
    assert rank(Policy.COST, req, nodes)[0] == "holder"


def test_under_load_cost_keeps_the_hit_despite_a_slightly_longer_peer_queue() -> None:
    # 4 queued here, the holder of 2,900 of 3,000 tokens expected to have 11: its predicted
    # latency is longer (0.57 vs 0.53 s), but a local miss prefills 2,900 tokens more
    # (0.31 s), which the 4 requests queued here would wait for too.
    req = RouteInput(3000, 1)
    nodes = [me(0, queue=4), peer("warm", 2900, rtt=0.002, queue=11)]
    assert predict_latency(req, nodes[1], SCALE) > predict_latency(req, nodes[0], SCALE)
    assert rank(Policy.COST, req, nodes)[0] == "warm"
    idle = [me(0, queue=0), peer("warm", 2900, rtt=0.002, queue=11)]
    assert rank(Policy.COST, req, idle)[0] == "self"  # nothing queued here: latency decides


def test_cost_prefers_idle_peer_when_self_is_swamped_and_nothing_is_cached() -> None:
    req = RouteInput(500, 1)
    nodes = [me(0, queue=50), peer("idle", 0, queue=0), peer("busy", 0, queue=60)]
    assert rank(Policy.COST, req, nodes)[0] == "idle"


def test_a_queue_priced_by_its_tokens_sends_a_cold_request_to_an_idle_peer() -> None:
    """Two queued requests here at the mean service time are cheaper than the idle peer's
    prefill of the whole 3,000-token request; the same two places priced as the cold
    prefills they are (``queue_service_s``) are not, and the request goes to the idle peer."""
    req = RouteInput(3000, 1)
    here = me(3000, queue=2)
    nodes = [here, peer("idle", 0)]
    assert predict_wait(here) == 2 * SPEED.mean_service_s
    assert rank(Policy.COST, req, nodes)[0] == "self"
    cold = replace(here, queue_service_s=SPEED.service_s(3000, 0, 1, 4096.0))
    assert predict_wait(cold) == 2 * cold.queue_service_s  # type: ignore[operator]
    assert rank(Policy.COST, req, [cold, nodes[1]])[0] == "idle"


def test_cost_hysteresis_keeps_self_for_tiny_gains() -> None:
    req = RouteInput(3000, 1)
    local = predict_latency(req, me(100), SCALE)
    nodes = [me(100), peer("p", 116, rtt=0.0)]  # one block more: a negligible gain
    assert predict_latency(req, nodes[1], SCALE) < local
    assert rank(Policy.COST, req, nodes)[0] == "self"


def test_cost_bounded_load_skips_an_over_utilized_specialist() -> None:
    req = RouteInput(3000, 1)
    hot = NodeInfo("hot", False, 2900, 0.001, 1, SPEED, utilization=0.9)  # busy now too
    warm = NodeInfo("warm", False, 2000, 0.001, 0, SPEED, utilization=0.2)
    cold = NodeInfo("cold", False, 0, 0.001, 0, SPEED, utilization=0.2)
    mine = NodeInfo("self", True, 0, 0.0, 0, SPEED, utilization=0.2)
    order = rank(Policy.COST, req, [mine, hot, warm, cold])
    assert order[0] == "warm" and "hot" in order  # still a fallback
    only_hot = rank(Policy.COST, req, [mine, hot, cold])
    assert only_hot[0] == "self"  # served where it entered: self caches the prefix too
    unbounded = Router(RouterConfig(policy=Policy.COST, load_bound=None))
    assert unbounded.rank(req, [mine, hot, cold], random.Random(0))[0].node_id == "hot"


def test_cost_bounded_load_ignores_utilization_when_all_idle() -> None:
    req = RouteInput(3000, 1)
    nodes = [me(0), peer("warm", 1200)]
    assert rank(Policy.COST, req, nodes)[0] == "warm"
    # Light traffic: the warm peer alone served one request in the window. Its utilization is
    # far above (1 + load_bound) x the mean, yet it must still get the next request (the
    # one-request slack); a little more busy time and the bound applies where the peer has
    # no room to spare (a saving of 1,200 of 3,000 tokens, less than the half that
    # ``load_bound_bypass=0.5`` asks of a peer over the bound, keeps the request here).
    window = RouterConfig().load_window_s
    one_request = SPEED.mean_service_s / window
    light = NodeInfo("warm", False, 1200, 0.001, 0, SPEED, utilization=one_request)
    assert light.utilization > (1 + 0.5) * one_request / 2  # over the bound without the slack
    assert request_slack(light, window) == pytest.approx(one_request)
    assert not over_bound(light, one_request / 2, 0.5, request_slack(light, window))
    assert over_bound(light, one_request / 2, 0.5)  # placement's walk: no slack
    assert rank(Policy.COST, req, [me(0), light])[0] == "warm"
    busy = NodeInfo("warm", False, 1200, 0.001, 0, SPEED, utilization=5 * one_request)
    halves = Router(RouterConfig(policy=Policy.COST, load_bound_bypass=0.5))
    assert halves.rank(req, [me(0), busy], random.Random(0))[0].is_self


def test_cost_bound_yields_to_a_large_certain_hit_while_the_peer_has_room() -> None:
    req = RouteInput(3000, 1)
    window = RouterConfig().load_window_s
    roomy = NodeInfo("warm", False, 2900, 0.001, 0, SPEED,
                     utilization=5 * SPEED.mean_service_s / window)
    assert rank(Policy.COST, req, [me(0), roomy])[0] == "warm"  # most of the time saved
    full = NodeInfo("warm", False, 2900, 0.001, 1.2, SPEED, utilization=0.9)
    mine = NodeInfo("self", True, 0, 0.0, 0, SPEED, utilization=0.1)
    assert rank(Policy.COST, req, [mine, full])[0] == "self"  # no room: the bound holds
    # as busy lately, but idle now (no queue expected): a certain hit, not a second copy
    idle = NodeInfo("warm", False, 2900, 0.001, 0.4, SPEED, utilization=0.9)
    assert rank(Policy.COST, req, [mine, idle])[0] == "warm"
    never = Router(RouterConfig(policy=Policy.COST, load_bound_bypass=1.0))
    assert never.rank(req, [me(0), roomy], random.Random(0))[0].is_self
    # a small certain hit on a peer with room (an agent's scratchpad, with the system prompt
    # cached everywhere): where nothing queues, balancing buys no time, so it is kept
    step = RouteInput(1600, 1)
    mine = NodeInfo("self", True, 1266, 0.0, 0, SPEED, utilization=0.1)
    holder = NodeInfo("warm", False, 1456, 0.001, 0, SPEED, utilization=0.45)
    assert over_bound(holder, mean_utilization([mine, holder]), 0.5)
    assert rank(Policy.COST, step, [mine, holder])[0] == "warm"
    halves = Router(RouterConfig(policy=Policy.COST, load_bound_bypass=0.5))
    assert halves.rank(step, [mine, holder], random.Random(0))[0].is_self
    # the same holder with a request queued and busy over the floor has no room: balanced
    loaded = replace(holder, queue_depth=1.0, utilization=0.6)
    assert rank(Policy.COST, step, [mine, loaded])[0] == "self"


# ----------------------------------------------------------------------- paper (Algorithm 1)
def test_paper_argmax_match() -> None:
    req = RouteInput(1000, 1)
    nodes = [me(100), peer("a", 300), peer("b", 800, queue=30), peer("c", 500)]
    assert rank(Policy.PAPER, req, nodes) == ["b", "c", "a", "self"]


def test_paper_ties_go_to_self_then_lowest_id() -> None:
    req = RouteInput(1000, 1)
    assert rank(Policy.PAPER, req, [peer("b", 400), me(400), peer("a", 400)]) == ["self", "a", "b"]
    assert rank(Policy.PAPER, req, [peer("b", 400), me(0), peer("a", 400)])[0] == "a"
    assert rank(Policy.PAPER, req, [me(0), peer("a", 0)])[0] == "self"


def test_paper_skips_suspect_and_pushed_back() -> None:
    req = RouteInput(1000, 1)
    nodes = [
        me(0),
        peer("s", 900, suspect=True),
        peer("pb", 800, pushed_back=True),
        peer("ok", 100),
    ]
    assert rank(Policy.PAPER, req, nodes) == ["ok", "self"]
    assert rank(Policy.PAPER, req, nodes[:3]) == ["self"]


# --------------------------------------------------------------------------------- baselines
@settings(max_examples=100, deadline=None)
@given(scenario=scenarios(), seed=st.integers(0, 99))
def test_none_is_always_self_with_no_claimed_hit(
    scenario: tuple[RouteInput, list[NodeInfo]], seed: int
) -> None:
    req, nodes = scenario
    ranked = Router(RouterConfig(policy=Policy.NONE)).rank(req, nodes, random.Random(seed))
    assert [(c.node_id, c.expected_cached_tokens) for c in ranked] == [("self", 0)]


def test_round_robin_cycles_over_available_nodes() -> None:
    router = Router(RouterConfig(policy=Policy.ROUND_ROBIN))
    nodes = [me(), peer("a", 0), peer("b", 0), peer("x", 0, suspect=True)]
    heads = [router.rank(RouteInput(10, 1), nodes, random.Random(0))[0].node_id for _ in range(6)]
    assert heads == ["a", "b", "self"] * 2


def test_least_loaded_and_random() -> None:
    req = RouteInput(10, 1)
    nodes = [me(queue=3), peer("a", 0, queue=1), peer("b", 0, queue=0)]
    assert rank(Policy.LEAST_LOADED, req, nodes) == ["b", "a", "self"]
    heads = {rank(Policy.RANDOM, req, nodes, seed)[0] for seed in range(40)}
    assert heads == {"self", "a", "b"}


def test_rank_requires_exactly_one_self() -> None:
    router = Router(RouterConfig())
    with pytest.raises(ValueError):
        router.rank(RouteInput(10, 1), [peer("a", 0)], random.Random(0))
    with pytest.raises(ValueError):
        router.rank(RouteInput(10, 1), [me(), me()], random.Random(0))


def test_policy_parse_and_config_validation() -> None:
    assert Policy.parse(" Cost ") is Policy.COST
    with pytest.raises(ValueError):
        Policy.parse("fastest")
    with pytest.raises(ValueError):
        RouterConfig(min_gain_frac=1.0)
    with pytest.raises(ValueError):
        RouterConfig(context_scale=0)


def _speed(factor: float) -> SpeedReport:
    return SpeedReport(*(factor * v for v in (0.004, 8e-5, 0.007, 0.05)))


@pytest.mark.parametrize(("factor", "forwards"), [(0.75, False), (0.25, True)])
def test_cost_ignores_speed_differences_within_the_noise_tolerance(
    factor: float, forwards: bool
) -> None:
    """A cold request (no cache anywhere, idle queues) follows a peer that looks faster only
    when it is faster beyond the tolerance (1.5x): a 25 % difference is noise, 4x is real."""
    req = RouteInput(3000, 1)
    peers = [NodeInfo(f"p{i}", False, 0, 0.001, 0, _speed(factor)) for i in range(2)]
    mine = NodeInfo("self", True, 0, 0.0, 0, SPEED)
    head = rank(Policy.COST, req, [mine, *peers])[0]
    assert (head != "self") is forwards
    untuned = Router(RouterConfig(policy=Policy.COST, speed_tolerance=None))
    assert not untuned.rank(req, [mine, *peers], random.Random(0))[0].is_self  # old behaviour


def test_speeds_that_split_a_prefill_differently_but_agree_on_its_time_count_as_equal() -> None:
    """Overhead and rate are fitted together, so two nodes that agree on every prefill they
    served may split it differently (one all overhead, one mostly rate): compared at a warm
    step's and a cold prompt's size they are the same speed, and a cold request stays here.
    A peer whose line is 4x faster at the cold size is really faster, and gets it."""
    req = RouteInput(3000, 1)
    mine = NodeInfo("self", True, 0, 0.0, 0, SpeedReport(0.004, 8e-5, 0.007, 0.05))
    # within 1.5x of this node's times at 64 and 1,024 units, split differently; 11 % faster
    # for this prompt, which alone would pass the 10 % hysteresis
    split = SpeedReport(0.009, 7e-5, 0.007, 0.05)
    peers = [NodeInfo(f"p{i}", False, 0, 0.001, 0, split) for i in range(2)]
    assert rank(Policy.COST, req, [mine, *peers])[0] == "self"
    untuned = Router(RouterConfig(policy=Policy.COST, speed_tolerance=None))
    assert not untuned.rank(req, [mine, *peers], random.Random(0))[0].is_self
    fast = SpeedReport(0.004, 2e-5, 0.007, 0.05)  # 4x faster for a cold prompt
    peers = [NodeInfo(f"p{i}", False, 0, 0.001, 0, fast) for i in range(2)]
    assert rank(Policy.COST, req, [mine, *peers])[0] != "self"


# -------------------------------------------------------------- placement: owners and replicas
def placed(
    nodes: list[NodeInfo], owners: tuple[str, ...], seed: int = 0, held: int = 256, **cfg: float
) -> list[Candidate]:
    router = Router(RouterConfig(policy=Policy.COST, **cfg))  # type: ignore[arg-type]
    return router.rank(RouteInput(3000, 1), nodes, random.Random(seed), Placement(owners, held))


def test_a_prefix_nobody_holds_goes_to_its_owner_and_is_tagged_first() -> None:
    out = placed([me(0), peer("o", 0), peer("x", 0)], ("o",))
    assert out[0].node_id == "o" and out[0].placement is Tag.FIRST
    tags = {c.node_id: c.placement for c in out}
    assert tags["self"] is Tag.UNPLACED and tags["x"] is Tag.UNPLACED


def test_an_overloaded_holder_overflows_to_the_next_owner_a_deliberate_replica() -> None:
    hot = NodeInfo("hot", False, 2900, 0.001, 1, SPEED, utilization=0.95)  # busy now too
    nxt = NodeInfo("next", False, 0, 0.001, 0, SPEED, utilization=0.1)
    mine = NodeInfo("self", True, 0, 0.0, 0, SPEED, utilization=0.1)
    other = NodeInfo("other", False, 0, 0.001, 0, SPEED, utilization=0.1)
    out = placed([mine, hot, nxt, other], ("hot", "next"))
    assert out[0].node_id == "next" and out[0].placement is Tag.REPLICA
    tags = {c.node_id: c.placement for c in out}
    assert tags["hot"] is Tag.HIT and tags["self"] is Tag.SECOND_COPY  # an accidental copy


def test_a_busy_owner_gives_way_when_it_costs_more_than_the_slack() -> None:
    out = placed([me(0), peer("o", 0, queue=40)], ("o",))
    assert out[0].is_self and out[0].placement is Tag.UNPLACED


def test_near_equal_preferred_candidates_are_spread_at_random_self_first() -> None:
    holders = [peer(f"h{i}", 2900) for i in range(4)]
    heads = {placed([me(0), *holders], ("h0", "h1"), seed)[0].node_id for seed in range(40)}
    assert len(heads) >= 3 and "self" not in heads  # entry nodes sharing a view spread out
    warm_self = placed([me(2900), *holders], ("h0",))
    assert warm_self[0].is_self and warm_self[0].placement is Tag.HIT


def test_preferred_peers_may_be_slower_by_the_slack_and_carry_that_budget() -> None:
    req = RouteInput(3000, 1)
    nodes = [me(0, queue=1), peer("o", 0), peer("h", 2900), peer("x", 0)]
    out = placed(nodes, ("o",))
    local = mesh_cost(req, nodes, SCALE)[0]  # what staying costs the mesh
    beats = {c.node_id: c.beat_s for c in out}
    assert beats["self"] is None
    slack, first = RouterConfig().placement_slack, RouterConfig().first_copy_slack
    assert beats["h"] == pytest.approx(local * (1 + slack))  # a holder: the slack more
    # an owner that would make the first copy: its (smaller) share of the copy's work only
    assert beats["o"] == pytest.approx(local + first * predict_service(req, me(0), SCALE))
    assert beats["x"] == pytest.approx(local)


def test_an_owner_may_cost_a_share_of_the_first_copys_work_more_not_of_the_queue() -> None:
    """Under load a prediction is mostly queue: a slack on all of it let new prefixes pile
    onto their owner (1.75x the others' queue) for the sake of one copy. An owner that would
    make the first copy may be slower than the best choice by the slack's share of the
    copy's work; a holder keeps the slack on the whole prediction."""
    req = RouteInput(3000, 1)
    slack, first = RouterConfig().placement_slack, RouterConfig().first_copy_slack
    cold = predict_service(req, me(0), SCALE)
    nodes = [me(0, queue=8), peer("o", 0, queue=10)]  # two more queued at the owner
    here, there = mesh_cost(req, nodes, SCALE)
    assert here + first * cold < there <= (1 + slack) * here  # the slack on all: the owner
    owner = placed(nodes, ("o",))
    assert owner[0].is_self and owner[0].placement is Tag.UNPLACED
    idle = placed([me(0), peer("o", 0)], ("o",))  # over empty queues: the owner, as before
    assert idle[0].node_id == "o" and idle[0].placement is Tag.FIRST
    holder = placed([me(0, queue=8), peer("h", 2900, queue=10)], ("h",))
    assert holder[0].node_id == "h" and holder[0].placement is Tag.HIT


def test_no_slack_for_a_copy_whose_round_trip_costs_more_than_it_can_save() -> None:
    """A holder across a round trip longer than the whole prefill is not preferred: no later
    request would be forwarded to use its copy, so the slack buys nothing (the 1 s delay run
    sent cold prompts across a 2 s round trip). The plain cost comparison still decides."""
    req = RouteInput(3000, 1)
    cold = predict_service(req, me(0), SCALE)
    rtt = 1.2 * cold  # the holder is within the slack (rtt + warm < 1.75 cold), yet too far
    far = placed([me(0), peer("h", 2900, rtt=rtt)], ("h",))
    assert far[0].is_self
    assert next(c for c in far if c.node_id == "h").beat_s == pytest.approx(cold)  # no slack
    near = placed([me(0), peer("h", 2900, rtt=0.2 * cold)], ("h",))
    assert near[0].node_id == "h"  # a round trip the copy repays: the holder is preferred
    assert near[0].beat_s is not None and near[0].beat_s > cold  # ... with the slack


def test_a_holder_is_worth_only_what_it_holds_beyond_this_node() -> None:
    """A holder of a 1,500-token prefix of a 3,000-token prompt saves a later request that
    prefix's prefill, not the whole prompt's: across a round trip longer than that, it is not
    preferred (the 200 ms runs forwarded half the MMLU requests to such holders)."""
    req = RouteInput(3000, 1)
    saved = predict_service(req, me(0), SCALE) - predict_service(req, me(1500), SCALE)
    out = placed([me(0), peer("h", 1500, rtt=0.9 * saved)], ("o",), held=256)
    beat = next(c for c in out if c.node_id == "h").beat_s
    assert beat == pytest.approx(next(c for c in out if c.is_self).predicted_latency_s)


def test_ski_rental_a_forward_becomes_a_local_copy_once_its_round_trips_cost_the_copy() -> None:
    """Renting another node's copy costs a round trip per request; a copy here costs, once,
    what staying costs more than forwarding now. With no rent paid the hit is forwarded; once
    the round trips spent on the prefix reach that price, the request stays and is tagged a
    deliberate local copy. A forward the slack chose (slower than staying) is not a rental."""
    req = RouteInput(3000, 1)
    nodes = [me(0), peer("h", 2900, rtt=0.05)]
    router = Router(RouterConfig(policy=Policy.COST))
    fresh = router.rank(req, nodes, random.Random(0), Placement(("h",), 256))
    assert fresh[0].node_id == "h" and fresh[0].placement is Tag.HIT
    price = next(c for c in fresh if c.is_self).predicted_latency_s - fresh[0].predicted_latency_s
    rtt = 0.05
    short = router.rank(req, nodes, random.Random(0),
                        Placement(("h",), 256, rent_s=0.99 * (price - rtt)))
    assert short[0].node_id == "h"  # this round trip would not reach the price yet
    paid = router.rank(req, nodes, random.Random(0), Placement(("h",), 256, rent_s=price - rtt))
    assert paid[0].is_self and paid[0].placement is Tag.LOCAL_COPY
    # a hit here is a hit, whatever was spent (the rent only buys copies this node lacks)
    warm = router.rank(req, [me(2900, queue=3), peer("h", 2900)], random.Random(0),
                       Placement(("h",), 256, rent_s=100.0))
    assert all(c.placement is not Tag.LOCAL_COPY for c in warm)
    first = router.rank(req, [me(0), peer("o", 0)], random.Random(0),
                        Placement(("o",), 256, rent_s=10.0))
    assert first[0].node_id == "o" and first[0].placement is Tag.FIRST  # placement, not rent


def test_ski_rental_with_a_known_rate_buys_when_the_rentals_to_come_cost_the_copy() -> None:
    """A prefix this node keeps seeing will be rented again: the round trips to come over the
    rate's window (confident rate × ``replica_window_s`` × round trip) count with the rent
    paid, so a shared prompt requested here often is copied at once, and one seen rarely
    is still rented (issue #52: agentic steps forwarded to the few holders of the tool
    prompt)."""
    req = RouteInput(3000, 1)
    rtt = 0.05
    nodes = [me(0), peer("h", 2900, rtt=rtt)]
    router = Router(RouterConfig(policy=Policy.COST))
    window = RouterConfig().replica_window_s
    fresh = router.rank(req, nodes, random.Random(0), Placement(("h",), 256))
    price = next(c for c in fresh if c.is_self).predicted_latency_s - fresh[0].predicted_latency_s
    enough = (price - rtt) / (window * rtt)  # requests/s whose rentals to come reach it
    rare = router.rank(req, nodes, random.Random(0),
                       Placement(("h",), 256, rate_hz=0.99 * enough))
    assert rare[0].node_id == "h" and rare[0].placement is Tag.HIT
    often = router.rank(req, nodes, random.Random(0), Placement(("h",), 256, rate_hz=enough))
    assert often[0].is_self and often[0].placement is Tag.LOCAL_COPY
    half = router.rank(req, nodes, random.Random(0),
                       Placement(("h",), 256, rent_s=(price - rtt) / 2, rate_hz=enough / 2))
    assert half[0].is_self  # rent paid and rentals to come add up
    # a copy avoids no rentals where, warm, this node would still lose to the forward (its
    # queue here; a slower engine alike): those to come are not counted
    busy = router.rank(req, [me(0, queue=8), peer("h", 2900, rtt=rtt)], random.Random(0),
                       Placement(("h",), 256, rate_hz=1000 * enough))
    assert busy[0].node_id == "h" and busy[0].placement is Tag.HIT


def test_no_slack_for_a_holder_when_the_best_choice_holds_more_of_the_request() -> None:
    """The slack keeps a request on a holder (here: self, with one request queued) to avoid
    a copy elsewhere; when the cheaper choice holds the prefix too, and more of this request
    (a conversation's newer turns), there is no copy to avoid: the cheaper one wins."""
    req = RouteInput(3000, 1)
    mine = NodeInfo("self", True, 300, 0.0, 1, SPEED)  # holds the key's 256 tokens and more
    newer = peer("p", 600)
    slack = 1.0 + RouterConfig().placement_slack
    assert predict_latency(req, newer, SCALE) < predict_latency(req, mine, SCALE)
    assert predict_latency(req, mine, SCALE) < slack * predict_latency(req, newer, SCALE)
    out = placed([mine, newer], ("o",), held=256)
    assert out[0].node_id == "p" and out[0].placement is Tag.HIT
    # a holder with as much as the cheaper holder, or one block more (a saving inside the
    # hysteresis), has no copy to avoid either: the plain cost ranking decides
    for more in (0, 16):
        nodes = [me(0), peer("a", 2880, queue=2), peer("p", 2880 + more, queue=3)]
        assert placed(nodes, ("o",), held=256)[0].node_id == "a"
    # nobody holding more than self: self keeps its slack against a cheaper non-holder
    queued = NodeInfo("self", True, 1200, 0.0, 1, SPEED)
    assert placed([queued, peer("x", 0)], ("o",), held=256, placement_slack=0.0)[0].node_id == "x"
    assert placed([queued, peer("x", 0)], ("o",), held=256)[0].is_self


def test_a_copy_the_placement_would_make_gives_way_to_a_holder_no_slower_now() -> None:
    """A conversation's second turn: every node holds the shared preamble (2,000 tokens), the
    node the first turn ran on holds 80 more, past the key's block; the key's owner holds only
    the preamble. The holder saves this node too little to be preferred for itself, the owner
    is preferred (its copy would serve later turns), so the placement used to forward the turn
    to the owner, which re-prefilled the first turn. The holder is cheaper now and needs no
    copy: it gets the forward, tagged a hit, with the placement's ``beat_s``."""
    req = RouteInput(3000, 1)
    nodes = [me(2000), peer("o", 2000), peer("h", 2080), peer("x", 0)]
    assert predict_latency(req, nodes[2], SCALE) < predict_latency(req, nodes[1], SCALE)
    out = placed(nodes, ("o",), held=2016)
    assert out[0].node_id == "h" and out[0].placement is Tag.HIT
    local = next(c for c in out if c.is_self).predicted_latency_s
    assert out[0].beat_s is not None and out[0].beat_s > local  # the slack's beat, not staying's
    # an overloaded holder does not: the owner makes the copy (a replica of a busy prefix)
    busy = replace(nodes[2], utilization=1.0)
    idle = [replace(n, utilization=0.1) for n in (nodes[0], nodes[1], nodes[3])]
    assert placed([idle[0], idle[1], busy, idle[2]], ("o",), held=2016)[0].node_id == "o"
    # nor does a holder slower than the owner now
    queued = replace(nodes[2], queue_depth=3)
    assert placed([nodes[0], nodes[1], queued, nodes[3]], ("o",), held=2016)[0].node_id == "o"


def test_a_holder_busy_for_the_moment_does_not_make_a_copy_here_cheap() -> None:
    """The rent buys a copy at what staying costs more than the forward now, but never for
    less than the extra prefill the copy makes this node compute, less the round trip it
    saves: a holder whose queue makes the forward nearly as slow as a cold prefill here is
    busy, and the copy's prefill is as dear as ever. Over a link whose round trip is most of
    what the holder's copy saves, the first forward still buys (the floor is then below this
    round trip's rent). A forward the slack chose, slower than staying, never buys."""
    req = RouteInput(3000, 1)
    rtt = 0.01
    cold = predict_service(req, me(0), SCALE)
    warm = predict_service(req, me(2900), SCALE)
    # a queue that leaves the forward 1 ms cheaper than staying (its wait, its service, and
    # that service again for the one request queued there): a small price now
    wait = cold - 2 * warm - rtt - 0.001
    busy = NodeInfo("h", False, 2900, rtt, 1, SPEED, queue_service_s=None)
    busy = replace(busy, speed=replace(SPEED, mean_service_s=wait))
    router = Router(RouterConfig(policy=Policy.COST, min_gain_s=0.0, min_gain_frac=0.0))
    out = router.rank(req, [me(0), busy], random.Random(0), Placement(("h",), 256, rent_s=rtt))
    assert out[0].node_id == "h" and out[0].placement is Tag.HIT  # rented, not bought
    floor = cold - warm - rtt
    paid = router.rank(req, [me(0), busy], random.Random(0),
                       Placement(("h",), 256, rent_s=floor - rtt))
    assert paid[0].is_self and paid[0].placement is Tag.LOCAL_COPY
    short = router.rank(req, [me(0), busy], random.Random(0),
                        Placement(("h",), 256, rent_s=0.99 * (floor - rtt)))
    assert short[0].node_id == "h"  # just below the floor: still rented
    # a round trip of 80 % of what the holder's copy saves: the first forward buys
    far = peer("h", 2900, rtt=0.8 * (cold - warm))
    first = router.rank(req, [me(0), far], random.Random(0), Placement(("h",), 256))
    assert first[0].is_self and first[0].placement is Tag.LOCAL_COPY
    # the slack's forward to a holder slower than staying is not a rental, whatever was spent
    slow = NodeInfo("h", False, 2900, rtt, 1, replace(SPEED, mean_service_s=cold))
    kept = router.rank(req, [me(0), slow], random.Random(0),
                       Placement(("h",), 256, rent_s=10.0))
    assert predict_latency(req, slow, SCALE) > cold and kept[0].node_id == "h"


def test_a_forward_must_also_beat_the_measured_error_of_queue_predictions() -> None:
    """``wait_error_s`` (how far predictions of peers' waits have lately been off) is added to
    the hysteresis: a hit saving less than that stays here; 0 leaves the decision unchanged."""
    req = RouteInput(3000, 1)
    local = predict_latency(req, me(0), SCALE)
    hit = NodeInfo("h", False, 2900, 0.001, 0, SPEED)
    saving = local - predict_latency(req, hit, SCALE)
    router = Router(RouterConfig(policy=Policy.COST))
    assert router.rank(req, [me(0), hit], random.Random(0))[0].node_id == "h"
    unsure = replace(hit, wait_error_s=1.1 * saving)
    assert router.rank(req, [me(0), unsure], random.Random(0))[0].is_self


@settings(max_examples=200, deadline=None)
@given(scenario=scenarios(), seed=st.integers(0, 99), n_owners=st.integers(0, 3))
def test_placement_keeps_the_ranking_complete_and_picks_a_preferred_node_or_the_best(
    scenario: tuple[RouteInput, list[NodeInfo]], seed: int, n_owners: int
) -> None:
    req, nodes = scenario
    owners = tuple(n.node_id for n in nodes if not n.is_self)[:n_owners]
    held = max(1, req.prompt_tokens // 2)
    router = Router(RouterConfig(policy=Policy.COST))
    out = router.rank(req, nodes, random.Random(seed), Placement(owners, held))
    assert sorted(c.node_id for c in out) == sorted(n.node_id for n in nodes if n.available)
    head = out[0]
    unplaced = router.rank(req, nodes, random.Random(seed))[0]
    preferred = head.node_id in owners or head.expected_cached_tokens >= held
    assert preferred or head.node_id == unplaced.node_id or head.is_self
    assert all(c.placement is not None for c in out)


def test_no_forward_for_load_alone_over_a_round_trip_longer_than_the_ttft_here() -> None:
    """Issue #52: a request crosses regions only when that is predicted faster. Over a 120 ms
    round trip, with no more of the prompt there than here, the mesh cost (this node's queue
    and the requests arriving behind a 1,000-token prefill) no longer sends it to an idle
    far peer when the round trip alone is longer than its TTFT here (one place queued: 0.104
    s); with two places queued (0.124 s) the rule is silent and the mesh cost decides, as it
    does over a 90 ms or a 2 ms link."""
    speed = SpeedReport(0.004, 8e-5, 0.007, 0.02)
    req = RouteInput(1000, 1)
    for rtt, queued, first in ((0.12, 1, "self"), (0.12, 2, "far"), (0.09, 1, "far"),
                               (0.002, 1, "far")):  # fmt: skip
        here = NodeInfo("self", True, 0, 0.0, queued, speed, utilization=0.9)
        far = NodeInfo("far", False, 0, rtt, 0, speed)
        assert rank(Policy.COST, req, [here, far])[0] == first
    # a holder of more of the request is not held to it
    here = NodeInfo("self", True, 0, 0.0, 1, speed, utilization=0.9)
    holder = NodeInfo("far", False, 500, 0.12, 0, speed)
    assert rank(Policy.COST, req, [here, holder])[0] == "far"


def test_a_request_this_node_cannot_keep_falls_back_to_a_near_peer_before_a_far_one() -> None:
    """This node first (the far peer's round trip is over its TTFT here), a near peer busier
    than the far one: the fallbacks (refused, or this node full or leaving) try the near peer
    first, the far one after (review finding: the tail was in mesh-cost order)."""
    speed = SpeedReport(0.004, 8e-5, 0.007, 0.02)
    here = NodeInfo("self", True, 0, 0.0, 1, speed, utilization=0.9)
    far = NodeInfo("far", False, 0, 0.12, 0, speed)
    near = NodeInfo("near", False, 0, 0.002, 3, speed, utilization=0.9)
    assert rank(Policy.COST, RouteInput(1000, 1), [here, far, near]) == ["self", "near", "far"]
