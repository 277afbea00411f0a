"""Request decisions the shells used to make, now the core's: sampling the forward protocol
cannot carry stays here, a prompt's later samples follow its first (sample affinity), and a
server's core answers its own bugs and stale events with the request's next step."""

from __future__ import annotations

import random

import pytest

from radixmesh.core.events import (
    AcceptForward,
    CoreFailed,
    ExecuteLocally,
    Forward,
    ForwardArrived,
    ForwardFailed,
    ForwardRefused,
    Log,
    RequestArrived,
    RequestDone,
    Tick,
)
from radixmesh.core.node import NodeCore
from radixmesh.core.router import Policy, RouterConfig
from radixmesh.testing import TwinCluster


def warm(policy: Policy = Policy.PAPER) -> TwinCluster:
    c = TwinCluster(3, router=RouterConfig(policy=policy), seed=11)
    c.run_for(2.0)
    return c


def cached_at(c: TwinCluster, node: str, blocks: int = 64) -> tuple[int, ...]:
    rng = random.Random(5)
    chain = tuple(rng.getrandbits(64) for _ in range(blocks))
    c.change_cache(node, list(chain))
    c.run_for(1.0)
    return chain


def test_sampling_that_is_not_plain_runs_where_it_entered() -> None:
    c = warm()
    chain = cached_at(c, "n1")
    [routed] = c.deliver("n0", RequestArrived(1, chain, 1024, 0, 4))
    assert isinstance(routed, Forward) and routed.peer_id == "n1"  # the holder, when plain
    [kept] = c.deliver("n0", RequestArrived(2, chain, 1024, 0, 4, plain=False))
    assert kept == ExecuteLocally(2, "local", 0)


def test_later_samples_go_where_the_first_went_or_stay_when_it_stayed() -> None:
    c = warm()
    [there] = c.deliver("n0", RequestArrived(1, (), 128, 0, 4, sample_of="n2"))
    assert isinstance(there, Forward) and there.peer_id == "n2"
    [here] = c.deliver("n0", RequestArrived(2, (), 128, 0, 4, sample_of="n0"))
    assert here == ExecuteLocally(2, "local", 0)
    # the first sample's node refuses: the sample falls back here, like a target
    assert c.deliver("n0", ForwardRefused(1, "n2", 0.0)) == [ExecuteLocally(1, "fallback", 0)]


def test_sample_affinity_outranks_an_experiment_target() -> None:
    c = warm()
    [action] = c.deliver("n0", RequestArrived(1, (), 128, 0, 4, target="n1", sample_of="n2"))
    assert isinstance(action, Forward) and action.peer_id == "n2"


def test_serve_gives_a_stale_failure_its_next_step_handle_does_not() -> None:
    c = warm()
    n0 = c.nodes["n0"]
    assert n0.handle(ForwardFailed(9, "n1", "reset", 0), c.now) == []  # stale: ignored
    actions = n0.serve(ForwardFailed(9, "n1", "reset", 0), c.now)
    assert actions[-1] == ExecuteLocally(9, "fallback", 0)
    assert any(isinstance(a, Log) and a.level == "error" for a in actions)
    # events no shell awaits a step for are left as they are
    assert n0.serve(RequestDone(9), c.now) == []


class Broken(Exception):
    pass


def test_serve_answers_a_core_bug_with_core_failed_and_the_request_still_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c = warm()
    n0: NodeCore = c.nodes["n0"]

    def boom(*_: object) -> None:
        raise Broken("a bug")

    monkeypatch.setattr(n0._parts.routing, "candidates", boom)
    with pytest.raises(Broken):
        n0.handle(RequestArrived(1, (), 128, 0, 4), c.now)  # tests and the simulator see it
    actions = n0.serve(RequestArrived(2, (), 128, 0, 4), c.now)
    [failed] = [a for a in actions if isinstance(a, CoreFailed)]
    assert failed.event == "RequestArrived" and "Broken: a bug" in failed.error
    assert actions[-1] == ExecuteLocally(2, "fallback", 0)
    monkeypatch.setitem(n0._handlers, ForwardArrived, boom)
    answer = n0.serve(ForwardArrived(3, 128, 0, 4, None), c.now)
    assert isinstance(answer[0], CoreFailed) and answer[-1] == AcceptForward(3)
    monkeypatch.setitem(n0._handlers, Tick, boom)
    [only] = n0.serve(Tick(), c.now + 5.0)  # no request concerned: just the report
    assert isinstance(only, CoreFailed) and only.event == "Tick"
