"""Arrivals, output lengths, think time and warm-up of the bench harness."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import statistics
from functools import partial
from pathlib import Path

import pytest

from radixmesh.bench import plan, replay, runner
from radixmesh.bench.folder import Results
from radixmesh.bench.replay import Replay
from radixmesh.bench.runner import Runner, RunResult, summary_entry
from radixmesh.bench.spec import RunSpec
from radixmesh.results.records import Record
from radixmesh.workload import Request, WorkloadSpec, schedule
from radixmesh.workload.build import build_counted
from radixmesh.workload.lengths import OutputLengths
from radixmesh.workload.schedule import Schedule
from test_cli_flags import command_args

bench_args = partial(command_args, "bench")  # `radixmesh bench ARGS...`'s flags


def reqs(n: int) -> list[Request]:
    return [Request(id=str(i), prompt="p") for i in range(n)]


# ----------------------------------------------------------------------------- arrivals
def test_poisson_times_are_the_ones_drawn_before_bursty_existed() -> None:
    got = [r.t for r in schedule.poisson(reqs(50), 4, 3.0, seed=5)]
    rng = random.Random("poisson/5")  # the reference: n - 1 gaps, scaled to (n - 1) / rate
    gaps = [rng.expovariate(1.0) for _ in range(49)]
    scale, t, want = 49 / 3.0 / sum(gaps), 0.0, [0.0]
    for g in gaps:
        t += g * scale
        want.append(t)
    assert got == pytest.approx(want)


@pytest.mark.parametrize("cv", [1.0, 2.0, 4.0])
def test_bursty_offers_the_rate_with_the_gaps_coefficient_of_variation(cv: float) -> None:
    timed = schedule.bursty(reqs(20_000), 4, rate=5.0, cv=cv, seed=1)
    times = [r.t or 0.0 for r in timed]
    assert times[-1] == pytest.approx((len(times) - 1) / 5.0)  # exactly the rate asked for
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(cv, rel=0.1)
    assert [r.entry for r in timed[:8]] == [0, 1, 2, 3, 0, 1, 2, 3]  # entries round-robin


def test_timed_schedules_and_their_description() -> None:
    bursty = schedule.apply(reqs(30), Schedule.BURSTY, 2, 2.0, seed=0, cv=3.0)
    assert bursty == schedule.bursty(reqs(30), 2, 2.0, 3.0, 0)
    with pytest.raises(ValueError, match="not timed"):
        schedule.timed(reqs(3), 2, 1.0, 0, Schedule.SEQUENTIAL)
    with pytest.raises(ValueError, match="cv"):
        schedule.bursty(reqs(3), 2, 1.0, 0.0, 0)
    said = schedule.describe(bursty, rate=2.0, arrivals=Schedule.BURSTY, cv=3.0)
    assert said["schedule"] == "bursty" and said["arrival_cv"] == 3.0
    assert said["schedule_text"].startswith("open loop, bursty (gamma, CV 3) 2 req/s")


def test_arrivals_flag_sweeps_poisson_and_bursty_for_rates_and_loads() -> None:
    specs = plan.specs_from_args(bench_args("--policy", "none,cost", "--load", "0.8", "--rate", "2",
                                            "--arrivals", "poisson,bursty", "--arrival-cv", "2.5"))
    kinds = {s.name: s.workload.schedule for s in specs}
    assert kinds["none-uniform-d2ms-g500ms-c200000-n4-L0.8-bursty"] is Schedule.BURSTY
    assert kinds["cost-uniform-d2ms-g500ms-c200000-n4-L0.8"] is Schedule.POISSON
    assert kinds["none-uniform-d2ms-g500ms-c200000-n4-r2-bursty"] is Schedule.BURSTY
    assert len(specs) == 8 and {s.workload.arrival_cv for s in specs} == {2.5}
    bursty = [s for s in specs if s.name.endswith("r2-bursty")]
    assert len({s.lockstep for s in bursty}) == 1  # the policies share one arrival schedule
    planned = Runner("/tmp/radixmesh-test-arrivals", log=lambda m: None).plan(bursty[0])
    assert planned.schedule["schedule"] == "bursty"


def test_every_policy_and_arrival_schedule_of_a_point_meets_one_measured_rate() -> None:
    specs = plan.specs_from_args(bench_args("--policy", "none,cost,smg,oracle", "--load",
                                            "0.5,0.8", "--arrivals", "poisson,bursty"))
    keys = {(s.workload.load, runner._rate_key(s)) for s in specs}
    assert len(keys) == 2 and len({k for _, k in keys}) == 2  # one per load, not per policy


class _Measured(replay.CapacityProbe):
    async def _measure(self, http: object, r: Replay) -> float:  # type: ignore[override]
        return {"none": 120.0, "smg": 150.0, "oracle": 170.0}[r.spec.policy]


class _Spec:  # what the probe reads of a replay
    def __init__(self, policy: str) -> None:
        self.spec = RunSpec(name=policy, policy=policy)


def _probed(policies: list[str], earlier: float | None) -> _Measured:
    probe = _Measured([], 1, 0.8, earlier)
    pairs = [(_Spec(p), []) for p in policies]
    asyncio.run(probe.apply(None, pairs))  # type: ignore[arg-type]
    return probe


def test_a_later_batch_is_timed_at_the_earlier_batchs_capacity() -> None:
    assert _probed(["none", "smg"], None).rate == pytest.approx(0.8 * 120.0)  # none's
    assert _probed(["smg", "oracle"], None).rate == pytest.approx(0.8 * 160.0)  # the median
    later = _probed(["smg", "oracle"], 120.0)
    assert later.rate == pytest.approx(0.8 * 120.0) and later.throughput["oracle"] == 170.0


# ----------------------------------------------------------------------------- lengths
def test_output_length_spellings() -> None:
    assert OutputLengths.parse("64") == OutputLengths("fixed", 64.0)
    assert OutputLengths.parse("uniform:16:256") == OutputLengths("uniform", 16.0, 256.0)
    assert OutputLengths.parse("lognormal:128:0.8:cap=512").cap == 512
    assert OutputLengths.parse("exponential:100").text() == "exponential mean 100 tokens"
    for bad in ("0", "lognormal:64", "uniform:9:3", "gamma:3:1", "x", "lognormal:1:-1"):
        with pytest.raises(ValueError, match=r"max.tokens"):
            OutputLengths.parse(bad)


@pytest.mark.parametrize("text", ["uniform:16:256", "lognormal:128:0.8", "exponential:100"])
def test_drawn_lengths_have_the_stated_mean_and_stay_in_bounds(text: str) -> None:
    lengths = OutputLengths.parse(text)
    drawn = [lengths.apply(r, seed=3).max_tokens for r in reqs(20_000)]
    want = {"uniform": 136.0, "lognormal": 128.0, "exponential": 100.0}[lengths.kind]
    assert statistics.fmean(drawn) == pytest.approx(want, rel=0.05)
    assert min(drawn) >= 1 and max(drawn) <= lengths.cap
    again = [lengths.apply(r, seed=3).max_tokens for r in reversed(reqs(20_000))]
    assert again[::-1] == drawn  # by seed and id alone: the order of the workload is moot


def test_a_workload_sends_the_drawn_lengths_and_admission_sees_them() -> None:
    spec = WorkloadSpec(kind="chat", requests=40, max_tokens="uniform:1:200", seed=2)
    seen: list[int] = []

    def admit(r: Request) -> Request | str:
        seen.append(r.max_tokens)
        return r if r.max_tokens <= 100 else "too_long"

    kept, drops = build_counted(spec, 4, admit)
    lengths = spec.output_lengths
    assert lengths is not None and len(set(seen)) > 10
    assert all(r.max_tokens <= 100 for r in kept) and drops.dropped["too_long"] > 0
    assert not drops.truncated  # a drawn length is no shortened prompt
    assert all(r.max_tokens == lengths.apply(r, 2).max_tokens for r in kept)
    with pytest.raises(ValueError, match=r"max.tokens"):
        WorkloadSpec(max_tokens="lognormal")


# ----------------------------------------------------------------------------- think time
def test_a_later_turn_waits_its_users_think_time_after_the_answer(monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    spec = RunSpec(name="r", policy="none", time_scale=1.0,
                   workload=WorkloadSpec(kind="chat", think_s=2.0, seed=4))
    slept: list[float] = []

    async def fake_sleep(s: float) -> None:
        slept.append(s)

    monkeypatch.setattr(replay.asyncio, "sleep", fake_sleep)
    monkeypatch.setattr(replay.time, "perf_counter", lambda: 100.0)
    r = Replay.__new__(Replay)
    r.spec, r.answered = spec, {"c0/t0": 99.5}
    turn = Request(id="c0/t1", prompt="p", after="c0/t0")
    asyncio.run(r._think(turn))
    asyncio.run(r._think(Request(id="c1/t0", prompt="p")))  # a first turn: no wait
    wait = 99.5 + schedule.think_time("c0/t1", 2.0, 4) - 100.0  # answered 0.5 s ago
    assert slept == ([pytest.approx(wait)] if wait > 0 else [])
    assert schedule.think_time("c0/t1", 0.0, 4) == 0.0
    draws = [schedule.think_time(str(i), 2.0, 4) for i in range(20_000)]
    assert statistics.fmean(draws) == pytest.approx(2.0, rel=0.05)


# ----------------------------------------------------------------------------- warm-up
def _rec(seq: int, t_send: float, ok: bool = True) -> Record:
    return Record(run="r", policy="none", seq=seq, id=str(seq), group=None, entry=0,
                  entry_node="n0", t_send=t_send, t_done=t_send + 1, latency_s=1.0 + seq,
                  served_by="n0", error=None if ok else "x")  # fmt: skip


def test_warm_up_requests_are_sent_and_kept_but_left_out_of_the_figures() -> None:
    spec = RunSpec(name="r", policy="none", warmup_requests=3)
    assert [spec.is_warmup(i, 0.0) for i in range(5)] == [True] * 3 + [False] * 2
    by_time = RunSpec(name="r", policy="none", warmup_s=10.0)
    assert by_time.is_warmup(99, 9.9) and not by_time.is_warmup(0, 10.0)
    recs = [_rec(i, float(i)) for i in range(10)]
    for r in recs:
        r.warmup = spec.is_warmup(r.seq, r.t_send)
    entry = summary_entry(RunResult(spec, records=recs, node_ids=["n0"]))
    assert entry["requests"] == 7 and entry["warmup"]["excluded"] == 3
    assert entry["mean_latency_s"] == pytest.approx(statistics.fmean(range(4, 11)))
    assert "3 warm-up requests excluded" in entry["schedule_text"]
    with pytest.raises(ValueError, match="exclude-warmup"):
        RunSpec(name="r", policy="none", warmup_requests=-1)
    args = bench_args("--exclude-warmup", "30s")
    assert plan.base_spec(args).warmup_s == 30.0
    assert plan.base_spec(bench_args()).warmup_requests == 0


def test_the_report_reads_no_warm_up_record(tmp_path: Path) -> None:
    out = tmp_path
    recs = [_rec(0, 0.0), _rec(1, 1.0)]
    recs[0].warmup = True
    (out / "requests.jsonl").write_text("".join(json.dumps(r.to_json()) + "\n" for r in recs))
    (out / "summary.json").write_text(json.dumps({"runs": []}))
    assert [r.seq for r in Results.load(out).records["r"]] == [1]
