"""The engine loop on a virtual clock: each step is planned to last profile.step_s(step) × the
time scale (plus a fault's extra delay), the loop sleeps exactly until the planned end, and lag
is what a late wake-up adds — all measured on the injected clock, never the wall's."""

from __future__ import annotations

import asyncio

import pytest

from radixmesh.core.profile import resolve
from radixmesh.core.scheduler import Finished, Step
from radixmesh.emulate.events import Faults
from radixmesh.emulate.loop import EngineLoop, Sink, next_token
from radixmesh.testing import VirtualClock


def drive(scale: float, late: float = 0.0, delay: float = 0.0
          ) -> tuple[EngineLoop, VirtualClock, list[tuple[Step, float, float]]]:
    """Three requests through a loop on a virtual clock; (loop, clock, [(step, planned, took)])."""
    async def main() -> tuple[EngineLoop, VirtualClock, list[tuple[Step, float, float]]]:
        clock = VirtualClock(100.0, late)
        loop = EngineLoop(resolve("h100-llama3-8b"), faults=Faults(token_delay_s=delay),
                          time_scale=scale, clock=clock, sleep=clock.sleep)
        sink: Sink = asyncio.Queue()
        prompts = [list(range(40, 40 + n)) for n in (300, 1200, 50)]
        for i, prompt in enumerate(prompts):
            loop.submit(prompt, 20, frozenset(), sink, i)
        steps = []
        while loop.in_flight:
            before = clock.now
            step = await loop.step_once()
            steps.append((step, loop.counters.last_planned_s[-1], clock.now - before))
        items = [sink.get_nowait() for _ in range(sink.qsize())]
        done = [item for _, item in items if isinstance(item, Finished)]
        assert sorted(f.seq for f in done) == [1, 2, 3]
        for index, prompt in enumerate(prompts):  # the tokens are the deterministic rule's
            out = [tok for i, tok in items if i == index and isinstance(tok, int)]
            seq = list(prompt)
            for tok in out:
                assert tok == next_token(seq)
                seq.append(tok)
            assert len(out) == 20
        return loop, clock, steps

    return asyncio.run(main())


@pytest.mark.parametrize("scale", [1.0, 0.25, 3.0])
def test_a_step_lasts_the_profiles_step_time_times_the_scale(scale: float) -> None:
    loop, _, steps = drive(scale)
    profile = loop.profile
    assert len(steps) >= 20 and any(s.prefills for s, _, _ in steps)
    for step, planned, took in steps:
        assert planned == pytest.approx(profile.step_s(step) * scale, rel=1e-12)
        assert took == pytest.approx(planned, abs=1e-9)
    c = loop.counters
    assert c.steps == len(steps)
    assert c.busy_s == pytest.approx(sum(p for _, p, _ in steps))
    assert c.lag_s == pytest.approx(0.0, abs=1e-9)


def test_late_wake_ups_are_counted_as_lag() -> None:
    loop, _, steps = drive(1.0, late=0.002)
    assert loop.counters.lag_s == pytest.approx(0.002 * len(steps))
    assert loop.counters.busy_s == pytest.approx(sum(p for _, p, _ in steps))


def test_scale_zero_runs_as_fast_as_it_can_and_a_delay_adds_to_every_step() -> None:
    _, _, steps = drive(0.0)
    assert all(planned == 0.0 for _, planned, _ in steps)
    _, _, steps = drive(0.0, delay=0.01)
    assert all(planned == pytest.approx(0.01) for _, planned, _ in steps)


def test_a_negative_scale_is_refused() -> None:
    with pytest.raises(ValueError, match="time_scale"):
        EngineLoop(resolve("h100-llama3-8b"), faults=Faults(), time_scale=-1.0)


def test_a_cold_lora_adapter_stalls_its_step_for_the_profiles_load_time() -> None:
    """One slot, two adapters: the resident one (the first listed) runs at the profile's
    speed; the other first waits lora_load_s × scale, and then evicts the first."""
    from dataclasses import replace

    base = resolve("h100-llama3-8b")
    prof = replace(base, adapters=("a", "b"), lora_slots=1, lora_load_s=0.5,
                   citations={**base.citations, "lora_load_s": "test"})

    async def main() -> list[float]:
        clock = VirtualClock(100.0)
        loop = EngineLoop(prof, faults=Faults(), time_scale=2.0, clock=clock, sleep=clock.sleep)
        sink: Sink = asyncio.Queue()
        extra = []
        for lora in ("a", "b", "b", "a"):
            loop.submit(list(range(40, 140)), 1, frozenset(), sink, 0, lora=lora)
            step = await loop.step_once()
            extra.append(loop.counters.last_planned_s[-1] - loop.planned_s(step))
        assert loop.counters.lora_loads == 2
        return extra

    assert asyncio.run(main()) == pytest.approx([0.0, 1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="citation"):
        replace(base, lora_slots=1, lora_load_s=0.5)
