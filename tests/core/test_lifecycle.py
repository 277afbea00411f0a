"""The request lifecycle: which peer next, when to stop, route labels, resuming after a death.

Checked against a reference model that states the rules directly: the peers tried are the
candidates ahead of self, at most ``max_peer_attempts`` of them; unknown peers are tried but
not sent; a failure after acceptance continues locally after the tokens already streamed.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from radixmesh.core.config import ForwardConfig
from radixmesh.core.events import Abort, ExecuteLocally, Forward, RejectRequest, RequestArrived
from radixmesh.core.lifecycle import Lifecycle
from radixmesh.core.router import Candidate, Tag

KNOWN = {"a": "h-a:1", "b": "h-b:1", "c": "h-c:1", "d": "h-d:1"}  # "x" has no address


def cands(order: list[str]) -> list[Candidate]:
    return [Candidate(p, p == "me", 16 if p == "me" else 32, 0.1, None) for p in order]


def arrived(rid: int = 1) -> RequestArrived:
    return RequestArrived(rid, (1, 2), 64, 16, 8)


def lifecycle(attempts: int = 2) -> Lifecycle:
    return Lifecycle(ForwardConfig(max_peer_attempts=attempts), KNOWN.get)


def test_first_choice_peer_is_forwarded_then_done() -> None:
    lc = lifecycle()
    [fwd] = lc.start(arrived(), cands(["a", "me"]))
    assert fwd == Forward(1, "a", "h-a:1", None, 32, "forwarded")
    assert lc.is_current(1, "a", "accepted")
    lc.accepted(1)
    assert lc.is_current(1, "a", "done")
    assert lc.done(1, None).route == "forwarded"
    assert len(lc) == 0 and lc.counters.routes == {"forwarded": 1}


def test_refusals_walk_the_candidates_then_run_locally_as_fallback() -> None:
    lc = lifecycle(attempts=2)
    lc.start(arrived(), cands(["a", "b", "c", "me"]))
    assert lc.refused(1) == [Forward(1, "b", "h-b:1", None, 32, "fallback")]
    assert lc.refused(1) == [ExecuteLocally(1, "fallback", 16, 0)]  # c is past the limit


def test_unknown_peers_count_as_tries_but_are_never_sent() -> None:
    lc = lifecycle(attempts=2)
    assert lc.start(arrived(), cands(["x", "x2", "a", "me"])) == [
        ExecuteLocally(1, "fallback", 16, 0)
    ]
    assert lc.counters.unknown_peer == 2


def test_a_failure_after_acceptance_continues_locally_after_the_streamed_tokens() -> None:
    lc = lifecycle()
    lc.start(arrived(), cands(["a", "b", "me"]))
    lc.accepted(1)
    assert lc.failed(1, tokens_so_far=5) == [ExecuteLocally(1, "fallback", 16, 5)]  # never b


def test_stale_events_are_recognised_and_counted() -> None:
    lc = lifecycle()
    lc.start(arrived(), cands(["a", "b", "me"]))
    assert not lc.is_current(1, "b", "refused")  # not b's try
    assert not lc.is_current(1, None, "done")  # not running locally
    assert not lc.is_current(2, "a", "failed")  # no such request
    assert lc.counters.stale == 3


def test_cancel_aborts_what_runs_and_forgets_the_request() -> None:
    lc = lifecycle()
    lc.start(arrived(1), cands(["a", "me"]))
    lc.start(arrived(2), cands(["me", "a"]))
    assert lc.cancel(1) == [Abort(1, "a")]
    assert lc.cancel(2) == [Abort(2, None)]
    assert lc.cancel(2) == [] and len(lc) == 0
    assert lc.counters.cancelled == 2


# ------------------------------------------------------------------- reference model
def reference(order: list[str], outcomes: list[tuple[str, int]], attempts: int) -> list[object]:
    """The rules, stated directly: the actions one request produces."""
    ahead = order[: order.index("me")][:attempts]
    out: list[object] = []
    fell_back = False
    for peer in ahead:
        if peer not in KNOWN:
            fell_back = True
            continue
        out.append(("forward", peer, "fallback" if fell_back else "forwarded"))
        kind, tokens = outcomes.pop(0) if outcomes else ("done", 0)
        if kind == "done":
            return out
        fell_back = True
        if kind == "accepted-failed":
            out.append(("local", "fallback", tokens))
            return out
    out.append(("local", "fallback" if fell_back else "local", 0))
    return out


def drive(order: list[str], outcomes: list[tuple[str, int]], attempts: int) -> list[object]:
    lc = lifecycle(attempts)
    actions = list(lc.start(arrived(), cands(order)))
    seen: list[object] = []
    queue = list(outcomes)
    while actions:
        action = actions.pop(0)
        if isinstance(action, ExecuteLocally):
            seen.append(("local", action.route, action.resume_after))
            break
        assert isinstance(action, Forward)
        assert lc.peers_with_blocks() == [action.peer_id]  # the current try's only
        seen.append(("forward", action.peer_id, action.route))
        kind, tokens = queue.pop(0) if queue else ("done", 0)
        if kind == "done":
            lc.accepted(1)
            break
        if kind == "refused":
            actions = list(lc.refused(1))
        elif kind == "failed":
            actions = list(lc.failed(1, 0))
        else:
            lc.accepted(1)
            actions = list(lc.failed(1, tokens))
    assert lc.done(1, None).route == seen[-1][-2 if seen[-1][0] == "local" else -1]
    assert lc.peers_with_blocks() == []  # no try holds a peer's blocks once it is done
    return seen


peers = st.lists(st.sampled_from(["a", "b", "c", "d", "x", "y"]), unique=True, max_size=5)
outcome = st.tuples(
    st.sampled_from(["done", "refused", "failed", "accepted-failed"]), st.integers(0, 7)
)


@settings(max_examples=300, deadline=None)
@given(
    peers,
    st.integers(0, 5),
    st.lists(outcome, max_size=6),
    st.integers(0, 4),
)
def test_lifecycle_matches_the_reference_model(
    before: list[str], self_at: int, outcomes: list[tuple[str, int]], attempts: int
) -> None:
    order = list(before)
    order.insert(min(self_at, len(order)), "me")
    expected = reference(list(order), list(outcomes), attempts)
    assert drive(order, outcomes, attempts) == expected
    forwards = [a for a in expected if isinstance(a, tuple) and a[0] == "forward"]
    assert len(forwards) <= attempts


def test_a_full_node_tries_peers_past_itself_then_rejects() -> None:
    lc = Lifecycle(ForwardConfig(max_peer_attempts=2), KNOWN.get, min_retry_after_s=1.0)
    [fwd] = lc.start(arrived(), cands(["me", "a", "b", "c"]), full_for_s=4.0)
    assert fwd == Forward(1, "a", "h-a:1", None, 32, "forwarded")  # below self in the ranking
    assert lc.refused(1) == [Forward(1, "b", "h-b:1", None, 32, "fallback")]
    assert lc.refused(1) == [RejectRequest(1, 4.0)]  # c is past the limit; never self
    assert len(lc) == 0 and lc.counters.rejected == 1
    [only] = lc.start(arrived(2), cands(["me"]), full_for_s=0.2)
    assert only == RejectRequest(2, 1.0)  # no peer at all; at least the minimum back-off


def test_a_full_node_still_finishes_what_a_dead_peer_started() -> None:
    lc = lifecycle()
    lc.start(arrived(), cands(["a", "me"]), full_for_s=9.0)
    lc.accepted(1)
    assert lc.failed(1, tokens_so_far=3) == [ExecuteLocally(1, "fallback", 16, 3)]


def test_forwards_in_flight_are_tracked_per_peer_until_the_try_ends() -> None:
    lc = lifecycle(attempts=2)
    lc.start(arrived(1), cands(["a", "b", "me"]))
    lc.start(arrived(2), cands(["a", "me"]))
    assert lc.forwards_sent == 2 and lc.forwards_since("a", 0) == 2
    assert lc.forwards_since("a", 1) == 1  # only the one sent after forward #1
    assert lc.blocks_at("a", (1, 2, 3)) == 2 and lc.blocks_at("b", (1, 2)) == 0  # its prompt's
    lc.release(1)  # refused: the try no longer counts (before the request is ranked again)
    lc.release(1)  # ... once
    assert lc.forwards_since("a", 0) == 1 and lc.blocks_at("a", (1, 2)) == 2  # request 2's
    lc.refused(1)  # request 1 moves on to b
    assert lc.forwards_since("a", 0) == 1 and lc.forwards_since("b", 0) == 1
    assert sorted(lc.peers_with_blocks()) == ["a", "b"]
    lc.accepted(2)
    assert lc.forwards_since("a", 0) == 1  # streaming: still in the peer's queue
    lc.done(2, None)
    lc.cancel(1)
    assert lc.forwards_since("a", 0) == 0 and lc.forwards_since("b", 0) == 0
    assert lc.peers_with_blocks() == [] and lc.blocks_at("a", (1, 2)) == 0


def test_forwards_of_prompts_shorter_than_a_block_end_cleanly() -> None:
    lc = lifecycle()
    for rid in (1, 2):  # no block hashes: nothing to hold at the peer, two forwards to it
        lc.start(RequestArrived(rid, (), 8, 0, 1), cands(["a", "me"]))
    lc.done(1, None)
    assert lc.peers_with_blocks() == ["a"] and lc.forwards_since("a", 0) == 1
    lc.done(2, None)
    assert lc.peers_with_blocks() == [] and lc.forwards_since("a", 0) == 0


def test_placement_tags_are_counted_when_a_peer_accepts_or_execution_starts_here() -> None:
    def tagged(order: list[str], tag: Tag) -> list[Candidate]:
        return [
            Candidate(p, p == "me", 32, 0.1, None, tag if p == order[0] else Tag.SECOND_COPY)
            for p in order
        ]

    lc = lifecycle()
    (offer,) = lc.start(arrived(1), tagged(["a", "me"], Tag.REPLICA))
    assert lc.counters.placements == {}  # offered only: a refusal would not place it there
    lc.accepted(1)
    (here,) = lc.start(arrived(2), tagged(["me", "a"], Tag.HIT))
    lc.start(arrived(3), tagged(["b", "me"], Tag.HIT))
    (fallback,) = lc.refused(3)  # falls back here: the self candidate's tag counts
    assert lc.counters.placements == {"replica": 1, "hit": 1, "second_copy": 1}
    # each action carries its choice's tag (the runtime's x-radixmesh-placement header)
    assert isinstance(offer, Forward) and offer.placement == "replica"
    assert isinstance(here, ExecuteLocally) and here.placement == "hit"
    assert isinstance(fallback, ExecuteLocally) and fallback.placement == "second_copy"
    (untagged,) = lc.start(arrived(4), cands(["me"]))  # a policy that places nothing
    assert isinstance(untagged, ExecuteLocally) and untagged.placement is None
