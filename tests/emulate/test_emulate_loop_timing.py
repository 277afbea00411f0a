"""The engine loop on a virtual clock: each step is planned to last profile.step_s(step) × the
time scale (plus a fault's extra delay), the loop sleeps exactly until the planned end, and lag
is what a late wake-up adds — all measured on the injected clock, never the wall's."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import aiohttp
import pytest

from radixmesh.core.profile import Profile, resolve
from radixmesh.core.scheduler import Finished, Step
from radixmesh.emulate.events import Faults
from radixmesh.emulate.loop import EngineLoop, TokenSink, next_token
from radixmesh.testing import VirtualClock


def drive(scale: float, late: float = 0.0, delay: float = 0.0
          ) -> tuple[EngineLoop, VirtualClock, list[tuple[Step, float, float]]]:
    """Three requests through a loop on a virtual clock; (loop, clock, [(step, planned, took)])."""
    async def main() -> tuple[EngineLoop, VirtualClock, list[tuple[Step, float, float]]]:
        clock = VirtualClock(100.0, late)
        loop = EngineLoop(resolve("h100-llama3-8b"), faults=Faults(token_delay_s=delay),
                          time_scale=scale, clock=clock, sleep=clock.sleep)
        sink: TokenSink = asyncio.Queue()
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
    base = resolve("h100-llama3-8b")
    prof = replace(base, adapters=("a", "b"), lora_slots=1, lora_load_s=0.5,
                   citations={**base.citations, "lora_load_s": "test"})

    async def main() -> list[float]:
        clock = VirtualClock(100.0)
        loop = EngineLoop(prof, faults=Faults(), time_scale=2.0, clock=clock, sleep=clock.sleep)
        sink: TokenSink = asyncio.Queue()
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


def _admitting(admission_s: float) -> Profile:
    base = resolve("h100-llama3-8b")
    return replace(base, admission_s=admission_s,
                   citations={**base.citations, "admission_s": "test"})


@pytest.mark.parametrize(("admission", "scale"), [(0.0, 1.0), (0.03, 1.0), (0.03, 2.5)])
def test_a_request_joins_the_scheduler_after_the_profiles_admission_time(
        admission: float, scale: float) -> None:
    """The first token comes admission_s × scale after arrival plus the prefill step; the
    admission is the request's own wait, never a step's time."""
    prof = _admitting(admission)

    async def main() -> tuple[float, float, float]:
        clock = VirtualClock(100.0)
        loop = EngineLoop(prof, faults=Faults(), time_scale=scale, clock=clock,
                          sleep=clock.sleep)
        sink: TokenSink = asyncio.Queue()
        arrived = clock()
        await loop.admission()
        loop.submit(list(range(40, 340)), 2, frozenset(), sink, 0)
        step = await loop.step_once()
        assert sink.qsize() == 1  # the first token, at the end of the prefill step
        return clock() - arrived, loop.counters.last_planned_s[-1], prof.step_s(step) * scale

    took, planned, step_s = asyncio.run(main())
    assert planned == pytest.approx(step_s, rel=1e-12)
    assert took == pytest.approx(admission * scale + step_s, rel=1e-12)
    assert took == pytest.approx(prof.ttft_s(300) * scale, rel=1e-12)


def test_the_http_side_awaits_the_admission_before_submitting() -> None:
    """The emulated server waits the loop's admission once per HTTP request, then submits."""
    from radixmesh.emulate.server import EmulatedEngine

    async def main() -> list[tuple[str, float]]:
        engine = EmulatedEngine(_admitting(0.02), time_scale=0.5)
        events: list[tuple[str, float]] = []

        async def sleep(seconds: float) -> None:
            events.append(("sleep", seconds))
            await asyncio.sleep(0)

        submit = engine.loop.submit

        def submitted(*args: Any, **kwargs: Any) -> int:
            events.append(("submit", len(args[0])))
            return submit(*args, **kwargs)

        engine.loop._sleep = sleep  # type: ignore[method-assign]
        engine.loop.submit = submitted  # type: ignore[method-assign]
        await engine.start()
        try:
            async with aiohttp.ClientSession() as http:
                body = {"model": engine.model, "prompt": "hello", "max_tokens": 2}
                async with http.post(engine.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
        finally:
            await engine.stop()
        return events

    events = asyncio.run(main())
    assert events[:2] == [("sleep", pytest.approx(0.01)), ("submit", 5)]


def test_a_late_wake_up_is_taken_from_the_next_step_not_carried_on() -> None:
    """Steps back to back keep to the profile's timeline: each ends late by the clock's
    lateness (counted as lag) but the sum of the steps is the planned sum, not the planned
    sum plus every lateness."""
    loop, _, steps = drive(1.0, late=0.002)
    planned = sum(p for _, p, _ in steps)
    took = sum(t for _, _, t in steps)
    assert took < planned + 0.002 * 4  # drifted once per idle restart at most, never per step
    assert loop.counters.lag_s == pytest.approx(0.002 * len(steps))


def test_a_prefill_step_lasts_its_per_sequence_cost_longer() -> None:
    """prefill_seq_s: each prefill chunk in a step adds it to the step's planned time."""
    base = resolve("h100-llama3-8b")
    prof = replace(base, prefill_seq_s=0.004, citations={**base.citations, "prefill_seq_s": "t"})

    async def main() -> list[tuple[Step, float]]:
        clock = VirtualClock(100.0)
        loop = EngineLoop(prof, faults=Faults(), clock=clock, sleep=clock.sleep)
        sink: TokenSink = asyncio.Queue()
        for i in range(3):
            loop.submit(list(range(40 + i, 440 + i)), 3, frozenset(), sink, i)
        out = []
        while loop.in_flight:
            step = await loop.step_once()
            out.append((step, loop.counters.last_planned_s[-1]))
        return out

    steps = asyncio.run(main())
    assert any(len(s.prefills) == 3 for s, _ in steps) and any(not s.prefills for s, _ in steps)
    for step, planned in steps:
        assert planned == pytest.approx(base.step_s(step) + 0.004 * len(step.prefills))


def test_a_request_submitted_during_a_late_wake_up_gets_no_less_than_its_prefill() -> None:
    """A step straight after another is planned from that one's planned end, so a late
    wake-up shortens it; a request submitted meanwhile joins it, and that step cannot have
    begun before the request came: its first token comes no sooner than its prefill alone
    after its submit (review finding: 9.27 ms against a 10.96 ms prefill, 4 ms late)."""
    prof = resolve("h100-llama3-8b")

    async def main() -> tuple[float, float]:
        clock = VirtualClock(100.0)
        loop = EngineLoop(prof, faults=Faults(), clock=clock, sleep=clock.sleep)
        a: TokenSink = asyncio.Queue()
        b: TokenSink = asyncio.Queue()
        loop.submit(list(range(40, 340)), 50, frozenset(), a, 0)
        await loop.step_once()  # A's prefill
        await loop.step_once()  # A's first decode: the timeline is set
        clock.now = (loop._timeline or clock.now) + 0.004  # the loop wakes 4 ms late
        submitted = clock.now
        loop.submit(list(range(1000, 1300)), 2, frozenset(), b, 0)
        while b.qsize() == 0:
            await loop.step_once()
        return clock.now - submitted, prof.ttft_s(300)

    ttft, prefill_alone = asyncio.run(main())
    assert ttft >= prefill_alone - 1e-9
