"""One entry point from flags to a request sequence: source × skew × schedule.

Sources: the MMLU directory (``mmlu_dir``), a JSONL ``trace`` (replayed as is: its own order,
entries and times), or the synthetic MMLU-shaped generator. Then uniform or skewed sampling
(seeded), then the schedule (round-robin entries; Poisson times for open-loop runs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from radixmesh.workload import mmlu, schedule, skew, synthetic, trace
from radixmesh.workload.request import Request


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    requests: int | None = 1000  # None = every question once (uniform only)
    skewed: bool = False
    seed: int = 0
    mmlu_dir: str | None = None
    trace: str | None = None
    synthetic_scale: float = 1.0  # multiplies synthetic prompt lengths
    synthetic_groups: int = 57  # number of synthetic groups (MMLU has 57 subjects)
    hot_fraction: float = 0.2
    hot_share: float = 0.8
    schedule: schedule.Schedule = schedule.Schedule.SEQUENTIAL
    rate: float | None = None  # requests/s for the Poisson schedule

    @property
    def source(self) -> str:
        if self.trace:
            return "trace"
        return "mmlu" if self.mmlu_dir else "synthetic"


Fits = Callable[[Request], bool]


def groups_for(spec: WorkloadSpec, fits: Fits | None = None) -> dict[str, list[Request]]:
    """The source's questions by group; with ``fits``, only requests it accepts (e.g. prompts
    within the engine's context), dropping groups left empty."""
    if spec.mmlu_dir:
        groups = mmlu.load_groups(spec.mmlu_dir)
    else:
        groups = synthetic.synthetic_groups(
            seed=spec.seed, scale=spec.synthetic_scale, groups=spec.synthetic_groups
        )
    if fits is None:
        return groups
    kept = {g: [r for r in reqs if fits(r)] for g, reqs in groups.items()}
    return {g: reqs for g, reqs in kept.items() if reqs}


def sample(spec: WorkloadSpec, groups: dict[str, list[Request]]) -> list[Request]:
    if spec.skewed:
        if spec.requests is None:
            raise ValueError("a skewed workload needs a request count")
        return skew.skewed(groups, spec.requests, spec.seed, spec.hot_fraction, spec.hot_share)
    return skew.uniform(groups, spec.requests, spec.seed)


def build(spec: WorkloadSpec, nodes: int, fits: Fits | None = None) -> list[Request]:
    if spec.trace:
        reqs: Sequence[Request] = trace.load(spec.trace)
        if fits is not None:
            reqs = [r for r in reqs if fits(r)]
        if spec.requests is not None:
            reqs = reqs[: spec.requests]
        return schedule.round_robin(reqs, nodes)
    reqs = sample(spec, groups_for(spec, fits))
    return schedule.apply(reqs, spec.schedule, nodes, spec.rate, spec.seed)
