"""The shadow scheduler of an external engine and the TTFT it predicts (core/shadow*.py)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from radixmesh.core.cost_model import (
    NodeInfo,
    Placement,
    RouteInput,
    Tag,
    batch_externality,
    predict_ttft,
)
from radixmesh.core.estimators import SpeedReport
from radixmesh.core.events import LoadChanged
from radixmesh.core.profile import resolve
from radixmesh.core.router import Policy, Router
from radixmesh.core.router_config import RouterConfig
from radixmesh.core.scheduler import Scheduler
from radixmesh.core.shadow import OVERHEAD_AGE_S, Shadow, scaled
from radixmesh.core.shadow_state import (
    BATCH_REFRESH_ROUNDS,
    BatchState,
    aged,
    ttft_parts,
    worth_sending,
)
from radixmesh.testing import TwinCluster

H100 = resolve("h100-llama3-8b")


def _engine_run(rate: float, n: int, seed: int, shadow: Shadow) -> list[tuple[float, float]]:
    """An engine (the same scheduler, stepping on the profile's time) and its shadow, fed the
    same Poisson arrivals in time order: (predicted, actual) TTFT of each request."""
    rng = random.Random(seed)
    eng = Scheduler(H100.scheduler_config())
    t, arrivals = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        shared = [rng.randrange(4)] * 16 * rng.randrange(1, 12)
        prompt = shared + [rng.randrange(1 << 20) for _ in range(rng.randrange(50, 2500))]
        arrivals.append((t, i, prompt, rng.randrange(1, 16)))
    pred: dict[int, tuple[float, float]] = {}
    first: dict[int, float] = {}
    clock, ai = 0.0, 0

    def arrive(until: float) -> None:
        nonlocal ai
        while ai < len(arrivals) and arrivals[ai][0] <= until:
            ta, i, prompt, out = arrivals[ai]
            pred[i] = (shadow.add(i, prompt, out, ta, eng.cached_prefix(prompt)), ta)
            eng.add(i, prompt, out, ta)
            ai += 1

    while ai < len(arrivals) or eng.running or eng.waiting:
        arrive(clock)
        step = eng.schedule(clock)
        if step.empty:
            clock = arrivals[ai][0]
            continue
        end = clock + H100.step_s(step)
        arrive(end)  # arrivals during the step come before its end's events (time order)
        for seq in step.emitting:
            if seq not in first:
                first[seq] = end
                shadow.first_token(seq, end)
        for fin in eng.complete(step, dict.fromkeys(step.emitting, 0), end):
            shadow.finished(fin.seq, end)
        clock = end
    return [(pred[i][0], first[i] - pred[i][1]) for i in first]


def test_shadow_of_an_engine_on_its_profile_predicts_within_2_percent_at_light_load() -> None:
    shadow = Shadow(H100)
    got = _engine_run(rate=2.0, n=60, seed=1, shadow=shadow)
    assert len(got) == 60
    for p, a in got:
        assert p == pytest.approx(a, rel=0.02)  # decodes alongside grow their KV
    assert shadow.synced_steps == 0 and shadow.live == 0


def test_shadow_under_load_stays_in_step_and_predicts_the_median_within_10_percent() -> None:
    shadow = Shadow(H100)
    got = _engine_run(rate=20.0, n=200, seed=2, shadow=shadow)
    errors = sorted(abs(p - a) / a for p, a in got)
    assert shadow.synced_steps == 0  # never behind an engine on its own profile
    assert errors[len(errors) // 2] <= 0.10
    print("median", errors[len(errors) // 2], "p90", errors[int(0.9 * len(errors))])


def test_a_shadow_behind_its_engine_catches_up_at_the_first_token() -> None:
    slow = Shadow(H100, time_scale=10.0)  # thinks each step lasts 10x what it does
    slow.add(1, list(range(3000)), 4, 0.0)
    slow.first_token(1, 0.06)
    assert slow.synced_steps >= 1
    state = slow.state(0.06)
    assert state.ahead_tokens == 0 and state.decoding == 1
    slow.finished(1, 0.07)
    assert slow.live == 0 and slow.state(0.07).running == 0


def _answer_each(shadow: Shadow, start: float, n: int, late: float) -> float:
    """``n`` requests one at a time (each ends before the next), each first token ``late``
    after an engine keeping its profile's time would send it (what a shadow that learnt no
    overhead predicts); the clock after."""
    t = start
    for i in range(n):
        seq = int(start * 1e5) + i + 1  # (a sequence id is > 0)
        prompt = [seq, *range(300)]
        shadow.add(seq, prompt, 2, t)
        ontime = Shadow(H100).add(seq, prompt, 2, t)
        shadow.first_token(seq, t + ontime + late)
        shadow.finished(seq, t + ontime + late + 0.01)
        t += 0.025
    return t


def test_the_overhead_is_the_median_lateness_of_the_last_first_tokens() -> None:
    shadow = Shadow(H100)
    t = _answer_each(shadow, 0.0, 40, late=0.003)
    assert shadow.state(t).overhead_s == pytest.approx(0.003, abs=1e-9)
    pred = shadow.add(999, list(range(200)), 2, t)
    assert pred == pytest.approx(Shadow(H100).add(999, list(range(200)), 2, t) + 0.003)


def test_an_overhead_driven_negative_comes_back_when_first_tokens_are_on_time() -> None:
    """A burst of first tokens far earlier than the shadow predicted drives the overhead
    negative; the idle engine's wait is then clamped at 0, and the lateness of a first token
    on time must still read 0 (it read as early by the overhead itself, which then held)."""
    shadow = Shadow(H100)
    t = _answer_each(shadow, 0.0, 31, late=-0.04)  # (an early token: late < 0)
    assert shadow.state(t).overhead_s < -0.03
    t = _answer_each(shadow, t, 16, late=0.0)
    assert shadow.state(t).overhead_s == pytest.approx(0.0, abs=1e-9)


def test_a_bursts_lateness_does_not_outlive_it() -> None:
    """First tokens 30 ms late in a burst; then none for longer than the overhead's age (a
    node that looks slow is sent nothing that would correct it): the prior again."""
    shadow = Shadow(H100)
    t = _answer_each(shadow, 0.0, 12, late=0.03)
    assert shadow.state(t).overhead_s == pytest.approx(0.03)
    assert shadow.state(t + 2 * OVERHEAD_AGE_S).overhead_s == H100.admission_s


def test_batch_state_round_trips_and_refuses_bad_figures() -> None:
    s = Shadow(H100)
    s.add(1, list(range(500)), 8, 0.0)
    state = s.state(0.001)
    back = BatchState.unpack(state.pack())
    assert back.ahead_tokens == state.ahead_tokens and back.step_tokens == 8192
    with pytest.raises(ValueError, match=r"batch\.ahead_s"):
        replace(state, ahead_s=float("nan"))
    with pytest.raises(ValueError, match="bytes"):
        BatchState.unpack(b"x")


def test_ttft_grows_with_the_work_ahead_and_ages_as_it_drains() -> None:
    s = Shadow(H100)
    idle = s.state(0.0)
    s.add(1, list(range(4000)), 8, 0.0)
    s.add(2, list(range(10**6, 10**6 + 4000)), 8, 0.0)
    busy = s.state(0.0)
    assert sum(ttft_parts(busy, 500, 0)) > sum(ttft_parts(idle, 500, 0)) + 0.05
    later = aged(busy, 10.0)
    # drained: its work ahead gone, its decodes (which the report still shows) riding along
    assert sum(ttft_parts(later, 500, 0)) == pytest.approx(sum(ttft_parts(idle, 500, 0)),
                                                           abs=0.005)
    more = aged(busy, 0.0, added_tokens=2000, added=1)
    assert sum(ttft_parts(more, 500, 0)) > sum(ttft_parts(busy, 500, 0))


def test_a_node_reporting_a_batch_is_priced_by_its_ttft_not_a_fifo_queue() -> None:
    s = Shadow(H100)
    for i in range(8):  # eight requests decoding: a FIFO model prices eight services
        s.add(i, list(range(i * 10**5, i * 10**5 + 300)), 200, 0.0)
    state = s.state(0.5)
    speed = SpeedReport(0.01, 2e-5, 0.006, 1.2)  # 1.2 s per request served
    node = NodeInfo("a", True, 0, 0.0, 8.0, speed, batch=state)
    ttft = predict_ttft(RouteInput(2000, 4), node, 4096.0)
    assert ttft < 0.1  # batched in: one prefill and a step's residual, not 8 x 1.2 s
    assert ttft == pytest.approx(sum(ttft_parts(state, 2000, 0)))


def test_a_batching_node_buys_a_copy_only_once_the_rent_paid_reaches_its_ttft_price() -> None:
    """Ski rental on a batching engine: the copy costs this node's TTFT for the whole prompt
    beyond the forward's (and what its prefill delays the batch); the forward now is rent
    still to pay. A round trip as long as the copy's price bought at the first forward under
    the FIFO rule; here the copy is bought only once the rent paid before reaches it."""
    s = Shadow(H100)
    for i in range(4):
        s.add(i, list(range(i * 10**5, i * 10**5 + 300)), 200, 0.0)
    state = s.state(0.5)
    speed = SpeedReport(0.004, 8e-5, 0.007, 0.05)
    req = RouteInput(3000, 1)
    mine = NodeInfo("self", True, 0, 0.0, 4.0, speed, batch=state)
    warm = replace(mine, cached_tokens=2900)
    scale = RouterConfig().context_scale
    saved = predict_ttft(req, mine, scale) - predict_ttft(req, warm, scale)
    holder = NodeInfo("h", False, 2900, 0.6 * saved, 0.0, speed, batch=state)
    router = Router(RouterConfig(policy=Policy.COST))
    fresh = router.rank(req, [mine, holder], random.Random(0), Placement(("h",), 256))
    assert fresh[0].node_id == "h" and fresh[0].placement is Tag.HIT  # rented, not bought
    extra = saved + batch_externality(req, mine, scale) - batch_externality(req, warm, scale)
    price = max(predict_ttft(req, mine, scale) - predict_ttft(req, holder, scale), extra)
    short = router.rank(req, [mine, holder], random.Random(0),
                        Placement(("h",), 256, rent_s=0.99 * price))
    assert short[0].node_id == "h"
    paid = router.rank(req, [mine, holder], random.Random(0),
                       Placement(("h",), 256, rent_s=price))
    assert paid[0].is_self and paid[0].placement is Tag.LOCAL_COPY


def test_an_unchanged_batch_is_left_out_of_load_reports_and_peers_keep_the_last_one() -> None:
    """A batching node's batch rides its message to a peer when that peer's copy changed
    materially (or is ``BATCH_REFRESH_ROUNDS`` rounds old); the messages between leave it
    out, and the peer keeps the last one it got, aged from its arrival (``PeerLoads``)."""
    c = TwinCluster(2, seed=0)
    c.run_for(3.0)
    s = Shadow(H100)
    s.add(1, list(range(3000)), 8, c.now)
    c.deliver("n0", LoadChanged(1, 1, 0, 1 << 20, batch=s.state(c.now)))
    c.run_for(1.5)
    peers = c.nodes["n1"]._parts.peers
    seen = peers.info("n0", 0, c.now)
    assert seen is not None and seen.batch is not None
    est = c.nodes["n1"]._parts.gossip.estimates["n0"]
    assert est.load is not None and est.load.batch is None  # the latest message left it out
    first = peers._batches["n0"].at
    interval = c.nodes["n0"].config.gossip.interval_s
    c.run_for(BATCH_REFRESH_ROUNDS * interval)
    assert peers._batches["n0"].at > first  # refreshed, unchanged as it is
    assert worth_sending(None, s.state(c.now), c.now, interval)
    assert not worth_sending((s.state(c.now), c.now), s.state(c.now), c.now, interval)


def test_a_queue_that_drains_within_half_a_round_is_news_until_the_next_announcement() -> None:
    """A cold prompt queued at an idle H100 drains well within half a gossip round (0.25 s),
    so against a round it is no news; but a delta-mode node announces its next round
    ``announce_gap_s`` (50 ms) later, and until then a peer pricing it from the idle report
    would predict its TTFT tens of ms short: measured against that horizon it is sent."""
    c = TwinCluster(2, seed=0)
    gossip = c.nodes["n0"].config.gossip
    s = Shadow(H100)
    s.add(1, list(range(6000)), 8, 0.0)
    queued = s.state(0.0)  # its prompt in the step under way, 0.12 s long
    idle = replace(queued, running=0, decoding=0, decode_kv=0, ahead_tokens=0, kv_used=0,
                   ahead_s=0.0, residual_s=0.0, free_s=0.0)  # the same rate
    assert not worth_sending((idle, 0.0), queued, 0.0, gossip.interval_s)
    horizon = c.nodes["n0"]._parts.gossip.dissemination._report_horizon()
    assert horizon == gossip.announce_gap_s < gossip.interval_s
    assert worth_sending((idle, 0.0), queued, 0.0, gossip.interval_s, horizon)


def test_scaled_stretches_every_time_a_profile_holds() -> None:
    """A time-scaled engine's profile as its node's shadow sees it: every time in seconds
    (the step's terms, admission, a prefill's own cost, a cold adapter's load) S times
    longer; capacities and the context untouched."""
    cited = {**H100.citations, **{k: "test" for k in ("admission_s", "prefill_seq_s",
                                                      "lora_load_s")}}
    base = replace(H100, admission_s=0.002, prefill_seq_s=0.001, lora_load_s=0.5,
                   citations=cited)
    s = scaled(base, 300.0)
    for name in ("step_base_s", "prefill_token_s", "prefill_attn_s", "decode_seq_s",
                 "decode_kv_s", "admission_s", "prefill_seq_s", "lora_load_s"):
        assert getattr(s, name) == pytest.approx(300.0 * getattr(base, name)), name
    assert (s.kv_blocks, s.step_tokens, s.context_length) == (
        base.kv_blocks, base.step_tokens, base.context_length)
    with pytest.raises(ValueError, match="time_scale"):
        scaled(base, 0.0)
