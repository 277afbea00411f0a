"""``Holdings``: a node advertises what its engine caches and what its queued requests will
compute, and nothing else once neither holds a block."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from radixmesh.core.cache_summary import Holdings, LocalSummary


def test_queued_blocks_are_advertised_until_the_request_leaves() -> None:
    held = Holdings(LocalSummary(1024))
    assert held.cache_changed([1, 2], [])
    assert held.queue_changed([1, 2, 3, 4], True)  # 3 and 4: only the queue has them
    assert held.summary.hashes() == {1, 2, 3, 4}
    assert held.queued_only() == {3, 4}
    version = held.summary.version
    assert held.cache_changed([3, 4], [])  # its answer: the engine caches them now, and the
    assert held.summary.version == version  # peers should hear soon (of the shorter queue)
    assert held.queued_only() == frozenset()  # though the summary did not change
    assert not held.cache_changed([3, 4], [])  # already cached: nothing to tell
    assert not held.queue_changed([1, 2, 3, 4], False)  # it left: the engine still has them
    assert held.summary.hashes() == {1, 2, 3, 4}


def test_a_request_that_leaves_uncached_takes_its_blocks_with_it() -> None:
    held = Holdings(LocalSummary(1024))
    held.queue_changed([5, 6], True)
    held.queue_changed([5, 7], True)  # a second request sharing block 5
    assert held.queue_changed([5, 6], False)  # cancelled: 6 goes, 5 stays for the other
    assert held.summary.hashes() == {5, 7}
    assert held.queue_changed([5, 7], False)
    assert held.summary.hashes() == frozenset()


def test_an_evicted_block_a_queued_request_computes_stays_advertised() -> None:
    held = Holdings(LocalSummary(1024))
    held.cache_changed([8, 9], [])
    held.queue_changed([8, 9], True)
    assert held.queued_only() == frozenset()  # the engine has them
    assert not held.cache_changed([], [8, 9])  # evicted, but the queued request brings them back
    assert held.summary.hashes() == {8, 9} and held.queued_only() == {8, 9}
    assert held.queue_changed([8, 9], False)  # failed before its prefill: gone for good
    assert held.summary.hashes() == frozenset()


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("cache"), st.sets(st.integers(0, 11), max_size=4),
                  st.sets(st.integers(0, 11), max_size=4)),
        st.tuples(st.just("join"), st.lists(st.integers(0, 11), max_size=5, unique=True),
                  st.just(set())),
        st.tuples(st.just("leave"), st.integers(0, 50), st.just(set())),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(_ops)
def test_the_summary_is_the_engines_cache_and_the_queues_blocks(ops: list[tuple]) -> None:  # type: ignore[type-arg]
    """Against a plain reference (the engine's set; the queued requests as a list): after any
    sequence of cache changes and requests joining and leaving, the summary holds exactly
    the union, and ``queued_only`` what the engine lacks of it."""
    held = Holdings(LocalSummary(1 << 16))
    engine: set[int] = set()
    queue: list[list[int]] = []
    for op, a, b in ops:
        if op == "cache":
            added, removed = sorted(a), sorted(b - a)
            engine -= set(removed)
            engine |= set(added)
            held.cache_changed(added, removed)
        elif op == "join":
            queue.append(list(a))
            held.queue_changed(a, True)
        elif queue:
            request = queue.pop(a % len(queue))
            held.queue_changed(request, False)
        queued = {h for request in queue for h in request}
        assert held.summary.hashes() == engine | queued
        assert held.queued_only() == queued - engine
