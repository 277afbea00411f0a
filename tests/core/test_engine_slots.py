"""A batching engine's slots in the router's queue model (``NodeInfo.slots``): a queue waits
only past them; with one slot every figure is what it was before batching engines."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixmesh.core.cost_model import NodeInfo, RouteInput, mesh_cost, predict_wait
from radixmesh.core.estimators import SpeedReport

SPEED = SpeedReport(0.01, 1e-4, 0.005, 0.2)  # mean service 0.2 s


def node(depth: float, slots: int, util: float = 0.5) -> NodeInfo:
    return NodeInfo("n", True, 0, 0.0, depth, SPEED, utilization=util, slots=slots)


def test_a_queue_waits_only_past_the_slots() -> None:
    assert predict_wait(node(3, 4)) == 0.0  # a free slot: it starts at once
    assert predict_wait(node(4, 4)) == 0.0
    # 6 in a 4-slot engine: 2 wait; a new one is third in line, a slot frees every 0.2 / 4 s
    assert predict_wait(node(6, 4)) == pytest.approx(3 * 0.2 / 4)
    assert node(6, 4).waiting == 2 and node(3, 4).waiting == 0


@given(st.floats(0, 500), st.floats(0, 1))
def test_one_slot_is_the_fifo_model_exactly(depth: float, util: float) -> None:
    one = node(depth, 1, util)
    assert predict_wait(one) == depth * SPEED.mean_service_s
    req = RouteInput(prompt_tokens=900, max_tokens=16)
    service = SPEED.service_s(900, 0, 16, 8192.0)
    arrivals = util / SPEED.mean_service_s
    fifo = service * depth + arrivals * service * service / 2.0 + depth * 0.2 + service
    assert mesh_cost(req, [one], 8192.0)[0] == pytest.approx(fifo, rel=1e-12)


@given(st.integers(0, 300), st.integers(1, 64))
def test_more_slots_never_wait_longer(depth: int, slots: int) -> None:
    assert predict_wait(node(depth, slots + 1)) <= predict_wait(node(depth, slots)) + 1e-12
    req = RouteInput(prompt_tokens=500, max_tokens=8)
    assert (mesh_cost(req, [node(depth, slots + 1)], 8192.0)[0]
            <= mesh_cost(req, [node(depth, slots)], 8192.0)[0] + 1e-12)
