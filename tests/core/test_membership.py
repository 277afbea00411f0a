"""The membership table: alive/suspect/dead transitions, silence timeouts, seeds."""

from __future__ import annotations

import pytest

from radixmesh.core.membership import (
    TRANSITIONS,
    IllegalTransition,
    MemberEvent,
    Membership,
    MemberState,
    next_state,
)

A, S, D = MemberState.ALIVE, MemberState.SUSPECT, MemberState.DEAD


@pytest.mark.parametrize(
    ("state", "event", "expected"),
    [
        (A, MemberEvent.HEARD, A),
        (A, MemberEvent.SILENT_SUSPECT, S),
        (A, MemberEvent.FORWARD_FAILED, S),
        (S, MemberEvent.HEARD, A),
        (S, MemberEvent.SILENT_DEAD, D),
        (D, MemberEvent.HEARD, A),
    ],
)
def test_table(state: MemberState, event: MemberEvent, expected: MemberState) -> None:
    assert next_state(state, event) is expected


def test_illegal_transitions_raise() -> None:
    illegal = [(s, e) for s in MemberState for e in MemberEvent if (s, e) not in TRANSITIONS]
    assert (D, MemberEvent.SILENT_SUSPECT) in illegal
    for state, event in illegal:
        with pytest.raises(IllegalTransition):
            next_state(state, event)


def test_silence_makes_suspect_then_dead_and_speech_revives() -> None:
    m = Membership("me", seeds=("seed:1",))
    m.add("p", "p:1", 1, now=0.0)
    assert m.expire(1.9, 2.0, 10.0) == []
    [t] = m.expire(2.0, 2.0, 10.0)
    assert (t.old, t.new) == (A, S)
    assert m.expire(5.0, 2.0, 10.0) == []  # already suspect: nothing new
    [t] = m.expire(10.0, 2.0, 10.0)
    assert (t.old, t.new) == (S, D)
    t2 = m.heard("p", 11.0)
    assert t2 is not None and (t2.old, t2.new) == (D, A)
    assert m.count(A) == 1 and m.count(D) == 0


def test_long_silence_jumps_straight_to_dead() -> None:
    m = Membership("me")
    m.add("p", "p:1", 1, now=0.0)
    [t] = m.expire(50.0, 2.0, 10.0)
    assert (t.old, t.new) == (A, D)


def test_heard_never_moves_last_heard_backwards() -> None:
    m = Membership("me")
    m.add("p", "p:1", 1, now=5.0)
    m.heard("p", 3.0)
    member = m.get("p")
    assert member is not None and member.last_heard == 5.0


def test_seeds_deduplicated_and_resolved() -> None:
    m = Membership("me", seeds=("a:1", "b:1", "a:1"))
    assert m.seeds == ["a:1", "b:1"]
    m.add("x", "a:1", 1, 0.0)
    assert m.address_known("a:1")
    m.resolve_seed("a:1")
    assert m.seeds == ["b:1"]
