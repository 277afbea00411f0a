"""Differential test: the runtime shell and the simulator shell, one script, the same actions.

Theory of operation
-------------------
Both shells interpret the same ``NodeCore``; this test checks that they *feed* it the same
events for the same world, so that a decision made in one is the decision made in the other.
``shell_twins.py`` runs one script on both (the simulator's ``SimCluster``; ``NodeService``s
on a virtual clock over the in-memory peer transport, on the simulator's engine).

``NodeCore.handle`` is wrapped to record every request event each core gets and the request
actions it answers (``Forward`` with its peer, route, expected cached tokens and placement;
``ExecuteLocally``; ``AcceptForward`` / ``RefuseForward``); each core's sequence must be the
same in both shells. Engines, configurations and random streams are the same by construction,
so a difference is a shell that reports something differently (a cached-prefix count, an
order of events). What it found is in ``git log``: the simulator sent ``ForwardArrived`` a
cached prefix of 0 unless the sender set ``beat_s``; the runtime reported load before the
queued request's tokens, and after a request ended but before it left the queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from radixmesh.core.events import (
    AcceptForward,
    Event,
    ExecuteLocally,
    Forward,
    ForwardAccepted,
    ForwardArrived,
    ForwardFailed,
    ForwardRefused,
    RefuseForward,
    RejectRequest,
    RequestArrived,
    RequestDone,
)
from radixmesh.core.node import NodeCore
from radixmesh.core.router_config import Policy
from radixmesh.runtime.transport import ForwardFailure
from radixmesh.testing.memtransport import MemoryNet
from shell_twins import Crash, N, RuntimeMesh, run_runtime, run_simulator, script

# ----------------------------------------------------------------------------- the trace
Trace = list[tuple[Any, ...]]


def _action(a: object) -> tuple[Any, ...] | None:
    if isinstance(a, Forward):
        return ("Forward", a.peer_id, a.route, a.expected_cached, a.placement)
    if isinstance(a, ExecuteLocally):
        return ("ExecuteLocally", a.route, a.expected_cached, a.resume_after, a.placement)
    if isinstance(a, AcceptForward | RefuseForward | RejectRequest):
        return (type(a).__name__,)
    return None


def _event(e: Event) -> tuple[Any, ...] | None:
    if isinstance(e, RequestArrived):
        return ("RequestArrived", e.prompt_tokens, e.local_cached, e.max_tokens)
    if isinstance(e, ForwardArrived):
        return ("ForwardArrived", e.prompt_tokens, e.cached_tokens, e.max_tokens,
                e.beat_s is None)
    if isinstance(e, ForwardAccepted | ForwardRefused | ForwardFailed):
        return (type(e).__name__, e.peer_id)
    if isinstance(e, RequestDone):  # a forward's TTFT as the peer's timings place it: both
        ttft = None if e.forward_ttft_s is None else round(e.forward_ttft_s, 6)  # shells alike
        return ("RequestDone", e.error, ttft)
    return None


@pytest.fixture
def record(monkeypatch: pytest.MonkeyPatch) -> Callable[[], Trace]:
    """Wraps ``NodeCore.handle``; returns a function giving (and clearing) the trace."""
    trace: Trace = []
    original = NodeCore.handle

    def handle(self: NodeCore, event: Event, now: float) -> list[Any]:
        actions = original(self, event, now)
        seen = _event(event)
        if seen is not None:
            done = tuple(x for x in map(_action, actions) if x is not None)
            trace.append((self.node_id, *seen, done))
        return actions

    monkeypatch.setattr(NodeCore, "handle", handle)

    def take() -> Trace:
        out = list(trace)
        trace.clear()
        return out

    return take


def by_node(trace: Trace, node: str) -> tuple[Trace, list[tuple[Any, ...]]]:
    """What ``node``'s core saw and did, in order; the acceptances of its forwards apart,
    sorted: with no delay on the wire, when an answer comes back at the instant it was
    sent is the transport's business (the simulator queues it, in memory it is at once)."""
    rows = [row[1:] for row in trace if row[0] == node]
    accepted = sorted(row for row in rows if row[0] == "ForwardAccepted")
    return [row for row in rows if row[0] != "ForwardAccepted"], accepted


def _requests(trace: Trace) -> Iterator[tuple[Any, ...]]:
    return (row for row in trace if row[1] != "RequestDone")


CASES = [  # policy, seed, burst, crash, prefix families, events the case must reach
    (Policy.COST, 0, 1, None, 4, set()), (Policy.COST, 1, 1, None, 4, set()),
    (Policy.COST, 2, 4, None, 4, set()), (Policy.PAPER, 0, 1, None, 4, set()),
    (Policy.LEAST_LOADED, 3, 4, None, 4, set()),
    (Policy.COST, 5, 3, (4, 1), 4, {"ForwardFailed", "ForwardRefused"}),  # fallback, busy
    (Policy.ROUND_ROBIN, 6, 3, (3, 2), 4, set()),
    # one prefix, bursts: a request finds the blocks a queued one computes (QueuedBlocks)
    (Policy.COST, 7, 4, None, 1, set()), (Policy.LEAST_LOADED, 9, 4, None, 1, set()),
]


@pytest.mark.parametrize(("policy", "seed", "burst", "crash", "families", "seen"), CASES)
def test_runtime_and_simulator_make_the_same_decisions(
        record: Callable[[], Trace], policy: Policy, seed: int, burst: int, crash: Crash,
        families: int, seen: set[str]) -> None:
    rounds = script(seed, burst=burst, crash=crash, families=families)
    run_simulator(rounds, policy, crash)
    simulated = record()
    run_runtime(rounds, policy, crash)
    served = record()
    for node in (f"n{i}" for i in range(N)):  # each core's own sequence (nodes interleave
        assert by_node(served, node) == by_node(simulated, node), node  # at one instant)
    kinds = {row[-1][0][0] for row in _requests(simulated) if row[-1]}
    assert {"Forward", "ExecuteLocally", "AcceptForward"} <= kinds  # the script decides things
    assert seen <= {row[1] for row in simulated}  # ... and reaches the paths it is for


def test_memory_transport_partitions_and_failures() -> None:
    """The in-memory transport's failures are the ones the runtime's HTTP client reports."""
    async def main() -> None:
        mesh = RuntimeMesh(script(0, rounds=1), Policy.COST)
        net: MemoryNet = mesh.net
        a, b = mesh.services[0], mesh.services[1]
        rejected = b.core.metrics()["messages_rejected"]
        assert await a.peers.send_gossip(b.address, b"x", "n1") is True  # delivered ...
        assert b.core.metrics()["messages_rejected"] == rejected + 1  # ... and refused there
        net.partition({a.address})
        assert await a.peers.send_gossip(b.address, b"x", "n1") is False
        assert b.core.metrics()["messages_rejected"] == rejected + 1
        with pytest.raises(ForwardFailure) as cut:
            await a.peers.open_forward(b.address, "n1", b"")
        net.heal()
        with pytest.raises(ForwardFailure) as bad:
            await a.peers.open_forward(b.address, "n1", b"not msgpack")
        with pytest.raises(ForwardFailure) as nobody:
            await a.peers.open_forward("10.9.9.9:1", "n9", b"")
        assert (cut.value.reason, bad.value.reason, nobody.value.reason) == (
            "partitioned", "http_400", "connect")
        await mesh.stop()

    asyncio.run(main())
