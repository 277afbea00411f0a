"""Engines sharing one machine's cores (``sim/compute.py``): processor sharing, alone and in
a run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixmesh.core.config import GossipConfig
from radixmesh.core.router import Policy, RouterConfig
from radixmesh.sim import costs
from radixmesh.sim.clock import EventLoop
from radixmesh.sim.compute import SharedCompute
from radixmesh.sim.runner import SimSpec, run
from radixmesh.sim.shell import ClusterConfig
from radixmesh.sim.tokens import byte_tokenize
from radixmesh.workload.request import Request


def _finish_times(cores: float, jobs: list[tuple[float, float]]) -> dict[int, tuple[float, float]]:
    """Start each (start time, work) job on a machine of ``cores``; job -> (end, elapsed)."""
    loop = EventLoop()
    compute = SharedCompute(loop, cores)
    done: dict[int, tuple[float, float]] = {}
    for i, (t, work) in enumerate(jobs):
        def begin(i: int = i, work: float = work) -> None:
            def end(elapsed: float) -> None:
                done[i] = (loop.now, elapsed)
            compute.start(work, end)
        loop.at(t, begin)
    loop.run()
    return done


def test_requests_alone_run_at_full_speed_and_share_the_cores_beyond_them() -> None:
    # one core, two requests of 1 s together: each at half speed, both end at 2 s
    done = _finish_times(1.0, [(0.0, 1.0), (0.0, 1.0)])
    assert done[0] == pytest.approx((2.0, 2.0)) and done[1] == pytest.approx((2.0, 2.0))
    # two cores, two requests: no slowdown
    done = _finish_times(2.0, [(0.0, 1.0), (0.0, 1.0)])
    assert done[0] == pytest.approx((1.0, 1.0))
    # one core: a 1 s request alone for 0.5 s, then shared with a 0.25 s one (each at half
    # speed): the short one ends at 1.0 (elapsed 0.5), the long one has 0.25 s left at 1.0
    # and runs alone again: ends at 1.25
    done = _finish_times(1.0, [(0.0, 1.0), (0.5, 0.25)])
    assert done[1] == pytest.approx((1.0, 0.5))
    assert done[0] == pytest.approx((1.25, 1.25))


def test_a_cancelled_request_never_ends_and_the_others_speed_up() -> None:
    loop = EventLoop()
    compute = SharedCompute(loop, 1.0)
    ended: list[tuple[str, float]] = []
    compute.start(1.0, lambda e: ended.append(("a", e)))
    key = compute.start(1.0, lambda e: ended.append(("b", e)))
    loop.at(0.5, compute.cancel, key)  # a and b each did 0.25 s; a has 0.75 s left, alone
    loop.run()
    assert ended == [("a", pytest.approx(1.25))]
    assert compute.running == 0
    compute.cancel(key)  # twice: nothing


@pytest.mark.parametrize("cores", [0.0, -1.0, float("nan")])
def test_a_machine_needs_a_positive_number_of_cores(cores: float) -> None:
    with pytest.raises(ValueError):
        SharedCompute(EventLoop(), cores)
    with pytest.raises(ValueError):
        ClusterConfig(nodes=2, cost=costs.resolve("cpu-tiny"), shared_cores=cores)


def _reference(cores: float, jobs: list[tuple[float, float]]) -> list[float]:
    """Processor sharing by small time steps: each job's end time."""
    dt = 5e-4
    left = [w for _, w in jobs]
    end = [-1.0] * len(jobs)
    t = 0.0
    while any(e < 0 for e in end):
        active = [i for i, (s, _) in enumerate(jobs) if s <= t + 1e-12 and end[i] < 0]
        rate = 1.0 if len(active) <= cores else cores / len(active)
        for i in active:
            left[i] -= rate * dt
            if left[i] <= 1e-12:
                end[i] = t + dt
        t += dt
    return end


@settings(max_examples=40, deadline=None)
@given(
    cores=st.sampled_from([0.5, 1.0, 2.0]),
    jobs=st.lists(
        st.tuples(
            st.integers(0, 20).map(lambda k: k / 20), st.integers(1, 20).map(lambda k: k / 20)
        ),
        min_size=1,
        max_size=5,
    ),
)
def test_end_times_match_processor_sharing_by_small_steps(
    cores: float, jobs: list[tuple[float, float]]
) -> None:
    done = _finish_times(cores, jobs)
    ref = _reference(cores, jobs)
    for i, (start, work) in enumerate(jobs):
        end, elapsed = done[i]
        assert end == pytest.approx(ref[i], abs=5e-3)
        assert elapsed == pytest.approx(end - start)
        assert elapsed >= work - 1e-9  # never faster than alone


# ------------------------------------------------------------------------- in a run
def _config(policy: str, **kw: object) -> ClusterConfig:
    base = ClusterConfig(
        nodes=4,
        cost=costs.resolve("cpu-tiny"),
        router=RouterConfig(policy=Policy.parse(policy)),
        gossip=GossipConfig.for_interval(0.1),
        seed=3,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def _simulate(policy: str, reqs: list[Request], clients: int, **kw: object):  # type: ignore[no-untyped-def]
    tokenize, _ = byte_tokenize()
    spec = SimSpec(name=policy, cluster=_config(policy, **kw), concurrency=clients)
    return run(spec, reqs, tokenize)


def test_one_request_at_a_time_is_not_slowed_by_a_shared_machine(
    make_reqs: Callable[..., list[Request]],
) -> None:
    reqs = make_reqs(30, groups=3)
    alone = _simulate("none", reqs, 1)
    shared = _simulate("none", reqs, 1, shared_cores=1.0)
    assert [r.latency_s for r in shared.records] == pytest.approx(
        [r.latency_s for r in alone.records]
    )


def test_concurrent_requests_on_a_shared_machine_take_longer_and_report_what_they_took(
    make_reqs: Callable[..., list[Request]],
) -> None:
    reqs = make_reqs(60, groups=3)
    own = _simulate("none", reqs, 4)
    shared = _simulate("none", reqs, 4, shared_cores=1.0)
    assert shared.summary["errors"] == 0 and len(shared.records) == 60
    # four nodes busy at once on one core: each request's service stretches, up to 4x
    ratio = shared.summary["mean_latency_s"] / own.summary["mean_latency_s"]
    assert 2.0 < ratio <= 4.0 + 1e-6
    # the service a node reports (and learns its speed from) is the stretched one
    for rec in shared.records:
        assert rec.server_timing is not None
        assert rec.latency_s >= rec.server_timing["service"] - 1e-9
    services = [r.server_timing["service"] for r in shared.records if r.server_timing]
    alone = [r.server_timing["service"] for r in own.records if r.server_timing]
    assert sum(services) > 2.0 * sum(alone)


def test_a_crash_releases_its_share_of_the_machine(
    make_reqs: Callable[..., list[Request]],
) -> None:
    from radixmesh.sim.network import Fault, NetworkConfig

    reqs = make_reqs(40, groups=2)
    net = NetworkConfig(faults=(Fault(node=1, crash_s=0.05),))
    res = _simulate("cost", reqs, 4, shared_cores=1.0, network=net)
    ok = [r for r in res.records if r.status == 200]
    # the crashed node's clients fail (its requests were its entry's); every other request
    # is answered, none by the crashed node, and the run ends (no share left running)
    assert len(ok) == 30 and all(r.status == 503 for r in res.records if r.status != 200)
    assert {r.served_by for r in ok} <= {"n0", "n2", "n3"}


def test_open_loop_load_is_sized_by_the_shared_capacity() -> None:
    from radixmesh.sim.sweep import capacity_rate

    cost = costs.resolve("cpu-tiny")
    own = capacity_rate(cost, 4, 1000.0, 8)
    assert capacity_rate(cost, 4, 1000.0, 8, shared_cores=1.0) == pytest.approx(own / 4)
    assert capacity_rate(cost, 4, 1000.0, 8, shared_cores=8.0) == pytest.approx(own)
