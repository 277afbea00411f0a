"""Bounded admission in front of a batching engine whose queue the node cannot see (an
external vLLM): the node's queue wait and token cap divide by the requests the engine serves
at once, measured by Little's law (``OwnLoad.streams``), not by the requests streaming.

Real vLLM CPU at 16 in flight (two engines, two nodes, 1-token answers) showed the defect:
each request took ~2.5-3 s inside an engine that ran all of them together, no request streamed
before it finished (``inflight`` ~0), and the nodes read 8-12 x 3 s of queued work and
answered 429 to 11 of 200 requests (139 of 200 on a loaded box; docs/reliability.md).
"""

from __future__ import annotations

import random

import pytest

from radixmesh.core.blocks import Fingerprint
from radixmesh.core.config import AdmissionConfig, NodeConfig
from radixmesh.core.events import LoadChanged, RejectRequest, RequestArrived, RequestServed, Tick
from radixmesh.core.node import NodeCore
from radixmesh.core.shadow_state import BatchState

FP = Fingerprint("test-model", "bytes", 16)
ADM = AdmissionConfig(max_queue_wait_s=30.0)  # max_queue_tokens 0: derived from the rate


def node_serving(service_s: float, every_s: float, until: float = 20.0) -> NodeCore:
    """A lone node whose engine finished a 1,200-token request every ``every_s`` seconds,
    each ``service_s`` long (with an invisible queue: its wait inside the engine included)."""
    node = NodeCore(NodeConfig(node_id="solo", address="mem://solo", fingerprint=FP,
                               incarnation=1, seeds=("mem://seed",), admission=ADM),
                    random.Random(0), now=0.0)
    node.handle(Tick(), 0.0)
    t = every_s
    while t <= until:
        node.handle(RequestServed(1200, 0, service_s - 0.1, 1, 0.1, service_s), t)
        t += every_s
    return node


def rejected(node: NodeCore, depth: int, now: float) -> bool:
    node.handle(LoadChanged(depth, 0, 0, 6144, depth * 1200, depth), now)
    actions = node.handle(RequestArrived(1, (), 1200, 0, 1), now)
    return any(isinstance(a, RejectRequest) for a in actions)


def test_a_batching_engine_with_an_invisible_queue_is_not_full_at_its_batch() -> None:
    """Eight at once, 2.8 s each (a completion every 0.35 s): 12 outstanding are ~4 s of
    work, not 12 x 2.8 = 34 s (over the 30 s bound: a 429 before)."""
    node = node_serving(2.8, 0.35)
    assert not rejected(node, 12, 20.0)
    assert node.streams(20.0) == pytest.approx(8.0, rel=0.05)  # 12 outstanding


def test_a_serial_engine_still_fills_at_depth_times_service() -> None:
    """One at a time (a completion per service time): streams ~1 (read at a completion), and
    33 queued requests of 1 s are over the 30 s bound as before."""
    node = node_serving(1.0, 1.0)
    assert node.streams(20.0) == pytest.approx(1.0, abs=0.1)
    assert rejected(node, 33, 20.0)
    assert node.metrics()["admission_full_wait"] == 1


def test_streams_fall_back_to_one_once_the_engine_went_quiet() -> None:
    node = node_serving(2.8, 0.35)
    node.handle(LoadChanged(12, 0, 0, 6144, 12 * 1200, 12), 200.0)
    assert node.streams(200.0) == pytest.approx(1.0)


def served_together(n: int, service_s: float, at: float) -> NodeCore:
    """A lone node whose engine finished ``n`` requests of ``service_s`` together at ``at``."""
    node = node_serving(service_s, at + 1.0, until=0.0)  # nothing served yet
    for _ in range(n):
        node.handle(RequestServed(1200, 0, service_s - 0.1, 1, 0.1, service_s), at)
    return node


def test_a_burst_of_long_requests_is_not_read_as_many_streams() -> None:
    """16 requests of 10 s ending together: Little's law over 2.5 s read 70 streams and let
    100 queued requests (~62 s of work) in under a 30 s bound. Read over two services and
    capped by what is outstanding, the wait is bounded again."""
    node = served_together(16, 10.0, 10.0)
    assert node.streams(10.0) <= 16.0
    assert rejected(node, 100, 10.0)


@pytest.mark.parametrize("service_s", [10.0, 20.0])
def test_a_serial_engine_of_long_requests_reads_one_stream(service_s: float) -> None:
    """One at a time, requests as long as the rate's window or longer: read at every
    completion (where a decayed count peaks) the engine serves one at a time, not 1.6-4.5."""
    node = node_serving(service_s, service_s, until=10 * service_s)
    node.handle(LoadChanged(5, 1, 0, 6144, 5 * 1200, 5), 0.0)  # work outstanding throughout
    t = service_s
    while t <= 10 * service_s:
        assert node.streams(t) == pytest.approx(1.0, abs=0.05), t
        t += service_s


def test_streams_never_exceed_the_requests_outstanding() -> None:
    node = node_serving(2.8, 0.35)  # reads ~8 with 12 outstanding
    node.handle(LoadChanged(3, 0, 0, 6144, 3 * 1200, 3), 20.0)
    assert node.streams(20.0) == pytest.approx(3.0)


def shadow(ahead_s: float, waiting: int) -> BatchState:
    """An H100-like engine's batch as its node's shadow reports it: ``waiting`` requests not
    admitted yet, ``ahead_s`` of their prompt compute to come."""
    return BatchState(0.006, 1.7e-5, 7e-10, 3e-4, 4e-8, 8192, 1024, 467_280, running=64,
                      waiting=waiting, decoding=60, decode_kv=60 * 2000,
                      ahead_tokens=int(ahead_s / 1.7e-5), kv_used=64 * 2000, ahead_s=ahead_s,
                      residual_s=0.01, free_s=0.05, rate=200.0)


def rejected_with(node: NodeCore, depth: int, batch: BatchState, rid: int) -> bool:
    node.handle(LoadChanged(depth, 0, 0, 6144, depth * 1200, depth, batch=batch), 0.0)
    actions = node.handle(RequestArrived(rid, (), 1200, 0, 1), 0.0)
    return any(isinstance(a, RejectRequest) for a in actions)


def test_a_node_with_its_engines_batch_bounds_the_shadows_wait() -> None:
    """Before any completion (Little's law reads one stream) 300 requests outstanding on a
    batching engine read as 300 x the prior service, over the 30 s bound: 16 emulated H100s at
    160 % of their planned capacity answered 429 on their first requests. With the engine's
    batch the wait is the shadow's: 0.5 s of prompt work ahead has room, 40 s is full."""
    cold = node_serving(1.0, 1.0, until=0.0)  # nothing served yet
    assert rejected(cold, 300, 0.0)  # the FIFO reading without a batch: as before
    assert not rejected_with(cold, 300, shadow(0.5, 40), rid=2)
    assert rejected_with(cold, 300, shadow(40.0, 2400), rid=3)
    assert cold.metrics()["admission_full_wait"] == 1  # the shadow's 40 s (the first: tokens)
    assert cold.metrics()["admission_full_tokens"] == 1
