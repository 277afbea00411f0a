"""The core link model (core/link.py) and the one duration grammar (core/units.py)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixmesh.core.link import REST, LinkConfig, Partition, RegionDelays, Wire, separated
from radixmesh.core.units import parse_duration

seconds = st.floats(0.0, 10.0)
probability = st.floats(0.0, 1.0)
seeds = st.integers(0, 2**32)
nodes = st.integers(0, 20)


# ------------------------------------------------------------------------------ LinkConfig
def test_defaults_are_a_perfect_link_that_draws_nothing() -> None:
    link, rng = LinkConfig(), random.Random(1)
    state = rng.getstate()
    assert not link.active and link.copies(rng) == (0.0,) and not link.lost(rng)
    assert not link.duplicated(rng) and link.sample_delay(rng) == 0.0
    assert rng.getstate() == state  # a fault that is off costs no random draw


@pytest.mark.parametrize(
    "kwargs",
    [
        {"delay_s": -0.1},
        {"jitter_s": -1.0},
        {"reorder_window_s": -1.0},
        {"delay_s": math.nan},
        {"jitter_s": math.inf},
        {"loss": 1.5},
        {"duplicate": -0.1},
        {"reorder": math.nan},
    ],
)
def test_config_is_validated(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        LinkConfig(**kwargs)


def test_draw_order_is_the_documented_one() -> None:
    link = LinkConfig(delay_s=0.1, jitter_s=0.2, loss=0.3, duplicate=0.4)
    rng, mirror = random.Random(7), random.Random(7)
    got = [link.copies(rng) for _ in range(200)]
    expected: list[tuple[float, ...]] = []
    for _ in range(200):
        if mirror.random() < 0.3:
            expected.append(())
            continue
        first = 0.1 + 0.2 * mirror.random()
        if mirror.random() < 0.4:
            expected.append((first, 0.1 + 0.2 * mirror.random()))
        else:
            expected.append((first,))
    assert got == expected


@given(seeds, seconds, probability, probability)
@settings(max_examples=50)
def test_loss_zero_delivers_everything(seed: int, delay: float, dup: float, reorder: float
                                       ) -> None:
    link = LinkConfig(delay_s=delay, jitter_s=0.01, duplicate=dup, reorder=reorder)
    rng = random.Random(seed)
    assert all(link.copies(rng) for _ in range(100))
    assert not any(link.lost(rng) for _ in range(100))


@given(seeds)
@settings(max_examples=20)
def test_loss_one_delivers_nothing(seed: int) -> None:
    link, rng = LinkConfig(loss=1.0, duplicate=1.0), random.Random(seed)
    assert not any(link.copies(rng) for _ in range(100))


@given(seeds, seconds, seconds, probability, seconds)
@settings(max_examples=100)
def test_delay_is_within_its_bounds(seed: int, delay: float, jitter: float, reorder: float,
                                    window: float) -> None:
    link = LinkConfig(delay_s=delay, jitter_s=jitter, reorder=reorder, reorder_window_s=window)
    rng = random.Random(seed)
    for _ in range(50):
        d = link.sample_delay(rng)
        assert delay <= d <= delay + jitter + window
    if reorder == 0:
        plain = LinkConfig(delay_s=delay, jitter_s=jitter)
        assert all(delay <= plain.sample_delay(rng) <= delay + jitter for _ in range(50))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_loss_and_duplicate_rates_are_respected(p: float) -> None:
    rng, n = random.Random(42), 20_000
    link = LinkConfig(loss=p, duplicate=p)
    lost = sum(link.lost(rng) for _ in range(n))
    dup = sum(link.duplicated(rng) for _ in range(n))
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(lost - n * p) < 5 * sigma and abs(dup - n * p) < 5 * sigma
    copies = [len(link.copies(rng)) for _ in range(n)]
    # delivered at all: 1 - p; of those, duplicated: p.
    assert abs(copies.count(0) - n * p) < 5 * sigma
    delivered = n - copies.count(0)
    assert abs(copies.count(2) - delivered * p) < 5 * math.sqrt(delivered * p * (1 - p)) + 1


def test_reorder_holds_back_some_messages() -> None:
    link = LinkConfig(delay_s=0.01, reorder=0.5, reorder_window_s=1.0)
    rng = random.Random(3)
    late = sum(link.sample_delay(rng) > 0.01 for _ in range(2000))
    assert 850 < late < 1150
    assert LinkConfig(reorder=0.5).active and LinkConfig(jitter_s=0.1).active


def test_same_seed_same_decisions() -> None:
    link = LinkConfig(delay_s=0.01, jitter_s=0.01, loss=0.2, duplicate=0.2, reorder=0.2)
    a, b = random.Random(5), random.Random(5)
    assert [link.copies(a) for _ in range(500)] == [link.copies(b) for _ in range(500)]


# ------------------------------------------------------------------------------ partitions
@given(st.lists(st.frozensets(nodes, max_size=5), max_size=4), nodes, nodes)
def test_partitions_are_symmetric_and_reflexive(groups: list[frozenset[int]], a: int, b: int
                                                ) -> None:
    disjoint, seen = [], set()
    for g in groups:
        disjoint.append(g - seen)
        seen |= g
    p = Partition(tuple(disjoint))
    assert p.separates(a, b) == p.separates(b, a)
    assert not p.separates(a, a)
    assert p.separates(a, b) == (p.group_of(a) != p.group_of(b))
    assert p.cut_off(a) == (p.group_of(a) != REST)


def test_partition_groups_and_rest() -> None:
    p = Partition.of({"a", "b"}, ["c"])
    assert p.separates("a", "c") and p.separates("a", "z") and p.separates("c", "z")
    assert not p.separates("a", "b") and not p.separates("y", "z")
    assert p.group_of("a") == 1 and p.group_of("c") == 2 and p.group_of("z") == REST
    healed: Partition[str] = Partition(())
    assert not healed.separates("a", "c") and not healed.cut_off("a")


def test_partition_window() -> None:
    p = Partition((frozenset({0}),), start_s=1.0, end_s=2.0)
    assert not p.separates(0, 1, 0.999) and p.separates(0, 1, 1.0)
    assert p.separates(1, 0, 1.999) and not p.separates(0, 1, 2.0)
    assert p.cut_off(0, 1.5) and not p.cut_off(0, 2.5)
    later = Partition((frozenset({1}),), start_s=3.0, end_s=4.0)
    assert separated([p, later], 0, 1, 1.5) and separated([p, later], 1, 2, 3.5)
    assert not separated([p, later], 0, 1, 2.5) and not separated([], 0, 1)


@pytest.mark.parametrize("start,end", [(-1.0, 1.0), (2.0, 2.0), (3.0, 1.0)])
def test_partition_window_is_validated(start: float, end: float) -> None:
    with pytest.raises(ValueError):
        Partition((frozenset({0}),), start, end)


def test_overlapping_groups_are_refused() -> None:
    with pytest.raises(ValueError, match="two groups"):
        Partition.of({1, 2}, {2, 3})


# ------------------------------------------------------------------------------ regions
def test_region_links_take_the_matrix_delay() -> None:
    regions = RegionDelays(("us", "eu"), ((0.001, 0.04), (0.05, 0.002)))
    links = regions.links(LinkConfig(delay_s=9.0, jitter_s=0.01, loss=0.1))
    assert [[link.delay_s for link in row] for row in links] == [[0.001, 0.04], [0.05, 0.002]]
    assert all(link.jitter_s == 0.01 and link.loss == 0.1 for row in links for link in row)


@pytest.mark.parametrize(
    "names,matrix",
    [
        ((), ()),
        (("a", "b"), ((0.0, 1.0),)),
        (("a", "b"), ((0.0, 1.0), (1.0,))),
        (("a",), ((-1.0,),)),
        (("a",), ((math.nan,),)),
    ],
)
def test_region_matrix_is_validated(names: tuple[str, ...],
                                    matrix: tuple[tuple[float, ...], ...]) -> None:
    with pytest.raises(ValueError):
        RegionDelays(names, matrix)


# ------------------------------------------------------------------------------ durations
@pytest.mark.parametrize(
    "text,seconds_",
    [
        ("2ms", 0.002), ("0.5s", 0.5), ("1.5", 1.5), (".5", 0.5), ("250us", 250e-6),
        ("250µs", 250e-6), ("250μs", 250e-6), ("2m", 120.0), (" 3 ms ", 0.003),
        ("1e-3", 0.001), ("1e-3s", 0.001), ("1E3ms", 1.0), ("1e+2", 100.0), ("0", 0.0),
        (0.1, 0.1), (3, 3.0),
    ],
)
def test_duration_spellings(text: str | float, seconds_: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds_)


@pytest.mark.parametrize(
    "bad", ["", "fast", "2 parsecs", "-1", "-1ms", "1h", "2MS", "ms", "1..2s", "5.", True, -0.1,
            math.nan, None],
)
def test_duration_rejects_with_a_clear_error(bad: object) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(bad)  # type: ignore[arg-type]


@given(st.floats(0.0, 1e6), st.sampled_from([("us", 1e-6), ("ms", 1e-3), ("s", 1.0),
                                             ("m", 60.0), ("", 1.0)]))
def test_duration_round_trips_numbers(value: float, unit: tuple[str, float]) -> None:
    assert parse_duration(f"{value!r}{unit[0]}") == pytest.approx(value * unit[1], rel=1e-12)


def test_wire_draws_as_the_link_and_nothing_across_a_partition() -> None:
    link = LinkConfig(delay_s=0.01, jitter_s=0.002, loss=0.3, duplicate=0.2)
    wire: Wire[str] = Wire(random.Random(5), lambda a, b: link)
    mirror = random.Random(5)
    for _ in range(50):
        assert wire.copies("a", "b") == link.copies(mirror)
    wire.partition({"a"})
    state = wire.rng.getstate()
    assert wire.separated("a", "b") and wire.copies("a", "b") == () and wire.copies("b", "a") == ()
    assert wire.rng.getstate() == state  # decided without a draw
    assert wire.copies("b", "c") == link.copies(mirror)  # the rest still talk
    wire.heal()
    assert not wire.separated("a", "b") and wire.copies("a", "b") == link.copies(mirror)
