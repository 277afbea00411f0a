"""Sessions: a request naming an earlier one in ``after`` is never sent before it finished, in
closed and open loop; against a reference model over random chains and completion orders."""

from __future__ import annotations

import io
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixmesh.workload import trace
from radixmesh.workload.request import Request
from radixmesh.workload.schedule import Sessions


def chains(lengths: list[int], order_seed: int) -> list[Request]:
    """Sessions of the given lengths, interleaved at random (order kept within each)."""
    rng = random.Random(order_seed)
    left = {s: n for s, n in enumerate(lengths) if n > 0}
    out: list[Request] = []
    step = dict.fromkeys(left, 0)
    while left:
        s = rng.choice(sorted(left))
        k = step[s]
        out.append(Request(id=f"s{s}/{k}", prompt="p", after=f"s{s}/{k - 1}" if k else None))
        step[s] += 1
        left[s] -= 1
        if not left[s]:
            del left[s]
    return out


class Replay:
    """The reference: a request may go once the request it names in ``after`` finished."""

    def __init__(self, reqs: list[Request], finish_seed: int) -> None:
        self.reqs = reqs
        self.index = {r.id: i for i, r in enumerate(reqs)}
        self.sessions = Sessions(reqs)
        self.rng = random.Random(finish_seed)
        self.running: list[int] = []
        self.finished: set[int] = set()
        self.sent: list[int] = []

    def send(self, i: int) -> None:
        after = self.reqs[i].after
        assert after is None or self.index[after] in self.finished
        self.running.append(i)
        self.sent.append(i)

    def finish_one(self) -> list[int]:
        """Any running request may finish first; returns those held for it (open loop)."""
        done = self.running.pop(self.rng.randrange(len(self.running)))
        self.finished.add(done)
        return self.sessions.finish(done)

    def sent_all_once(self) -> bool:
        return sorted(self.sent) == list(range(len(self.reqs)))


LENGTHS = st.lists(st.integers(0, 6), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(LENGTHS, st.integers(0, 1000), st.integers(1, 6), st.integers(0, 1000))
def test_closed_loop_sends_everything_once_never_before_its_predecessor_finished(
    lengths: list[int], order_seed: int, clients: int, finish_seed: int
) -> None:
    run = Replay(chains(lengths, order_seed), finish_seed)
    while len(run.sessions) or run.running:
        while len(run.running) < clients and (i := run.sessions.take()) is not None:
            run.send(i)
        assert run.running, "nothing runs, yet requests are left: a deadlock"
        run.finish_one()
    assert run.sent_all_once()
    # with one client, the list's order is kept (the paper's one-at-a-time schedule)
    if clients == 1:
        assert run.sent == list(range(len(run.reqs)))


@settings(max_examples=200, deadline=None)
@given(LENGTHS, st.integers(0, 1000), st.integers(0, 1000))
def test_open_loop_holds_an_arrival_until_its_predecessor_finished(
    lengths: list[int], order_seed: int, finish_seed: int
) -> None:
    run = Replay(chains(lengths, order_seed), finish_seed)
    for i in range(len(run.reqs)):  # arrivals in order, completions interleaved at random
        if run.sessions.arrive(i):
            run.send(i)
        while run.running and run.rng.random() < 0.5:
            for j in run.finish_one():
                run.send(j)
    while run.running:
        for j in run.finish_one():
            run.send(j)
    assert run.sent_all_once()


def test_independent_requests_go_at_once_in_order() -> None:
    reqs = [Request(id=str(i), prompt="p") for i in range(5)]
    sessions = Sessions(reqs)
    assert [sessions.take() for _ in range(6)] == [0, 1, 2, 3, 4, None]
    assert all(Sessions(reqs).arrive(i) for i in range(5))


def test_the_next_free_request_goes_while_a_turn_waits() -> None:
    reqs = [Request(id="a0", prompt="p"), Request(id="a1", prompt="p", after="a0"),
            Request(id="b0", prompt="p")]  # fmt: skip
    sessions = Sessions(reqs)
    assert sessions.take() == 0
    assert sessions.take() == 2  # a1 waits for a0; b0 does not
    assert sessions.take() is None and len(sessions) == 1
    assert sessions.finish(0) == []
    assert sessions.take() == 1


def test_a_dropped_predecessor_is_no_dependency_a_later_one_is_an_error() -> None:
    dropped = [Request(id="t1", prompt="p", after="t0")]  # t0 did not fit the context
    assert Sessions(dropped).take() == 0
    backwards = [Request(id="t1", prompt="p", after="t0"), Request(id="t0", prompt="p")]
    with pytest.raises(ValueError, match="comes after it"):
        Sessions(backwards)
    with pytest.raises(ValueError, match="itself"):
        Request(id="x", prompt="p", after="x")


def test_traces_carry_after_and_reject_a_bad_one() -> None:
    reqs = [Request(id="a", prompt="p"), Request(id="b", prompt="q", after="a")]
    buf = io.StringIO()
    trace.write(reqs, buf)
    assert trace.read(io.StringIO(buf.getvalue())) == reqs
    with pytest.raises(trace.TraceError, match="after"):
        trace.read(io.StringIO('{"id": "b", "prompt": "q", "after": [1]}\n'))
    # an integer id (ids may be line numbers) names the request as a string
    assert trace.read(io.StringIO('{"id": 2, "prompt": "q", "after": 1}\n'))[0].after == "1"
