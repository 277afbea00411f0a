"""One entry point from flags to a request sequence: source × skew × schedule, with drops.

Sources: the MMLU directory (``mmlu_dir``), a JSONL ``trace`` (its own order and entries; its
lines' arrival times ``t`` unless ``rate`` asks for Poisson arrivals instead), the synthetic
MMLU-shaped generator, or one of the generated workloads of ``kind`` chat / rag / agentic /
hotprefix (:mod:`radixmesh.workload.generated`; their own order and sharing, ``mmlu_dir`` only
lends them text). Then uniform or skewed sampling (seeded; MMLU and synthetic only), then the
schedule (round-robin entries unless a request names one; Poisson times for open-loop runs).
``load`` asks for Poisson arrivals at that fraction of a capacity the runner measures first, so
the request list is built untimed and timed later (:func:`radixmesh.workload.schedule.poisson`).

Admission: an ``admit`` function sees every candidate request (every question of the source,
or every trace line until ``requests`` are kept) and returns the request to send — itself or a
shortened copy — or the reason it is dropped. :class:`Drops` counts what happened, per reason
and per group, so a summary can say exactly which workload ran.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from radixmesh.workload import (
    agentic,
    chat,
    generated,
    hotprefix,
    mmlu,
    rag,
    schedule,
    skew,
    synthetic,
    trace,
)
from radixmesh.workload.corpus import Corpus
from radixmesh.workload.lengths import OutputLengths
from radixmesh.workload.request import Request
from radixmesh.workload.schedule import DEFAULT_CV, Entry

WORKLOADS = ("mmlu", *generated.KINDS)  # "mmlu": MMLU with mmlu_dir, else its synthetic shape


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
    rate: float | None = None  # requests/s for the Poisson schedule (traces too)
    kind: str = "mmlu"  # one of WORKLOADS
    load: float | None = None  # Poisson at this fraction of the measured capacity (runner)
    entry: Entry = Entry.GIVEN  # RANDOM: every request's entry drawn at random
    arrival_cv: float = DEFAULT_CV  # bursty schedule: the gaps' coefficient of variation
    max_tokens: str = ""  # output lengths (workload/lengths.py spelling); "" = the workload's
    think_s: float = 0.0  # mean think time before a session's next turn (exponential); 0 = none

    def __post_init__(self) -> None:
        if not self.arrival_cv > 0 or not self.think_s >= 0:
            raise ValueError("arrival_cv must be > 0 and think_s >= 0")
        self.output_lengths  # noqa: B018 -- refused here, naming --max-tokens
        if self.kind not in WORKLOADS:
            raise ValueError(f"unknown workload {self.kind!r}; choose from {', '.join(WORKLOADS)}")
        if self.generated and (self.skewed or self.trace or self.requests is None):
            raise ValueError(f"workload {self.kind!r} takes a request count, no skew and no trace")
        if self.load is not None and (self.load <= 0 or self.rate):
            raise ValueError("load is a fraction of capacity > 0, exclusive with a fixed rate")

    @property
    def arrivals(self) -> schedule.Schedule:
        """How open-loop arrivals at a rate or load come: the schedule if it is a timed one
        (poisson, bursty), else Poisson."""
        return self.schedule if self.schedule.timed else schedule.Schedule.POISSON

    @property
    def output_lengths(self) -> OutputLengths | None:
        return OutputLengths.parse(self.max_tokens) if self.max_tokens else None

    @property
    def generated(self) -> bool:
        return self.kind in generated.KINDS

    @property
    def source(self) -> str:
        if self.trace:
            return "trace"
        if self.generated:
            return self.kind
        return "mmlu" if self.mmlu_dir else "synthetic"


Fits = Callable[[Request], bool]
Admit = Callable[[Request], "Request | str"]  # the request to send, or why it is dropped
TOO_LONG = "too_long"


def admit_fitting(fits: Fits) -> Admit:
    """An ``admit`` that drops (reason ``too_long``) what ``fits`` rejects."""
    return lambda r: r if fits(r) else TOO_LONG


@dataclass(slots=True)
class Drops:
    """What admission did to the candidate requests: examined, dropped per reason and group,
    shortened per group."""

    examined: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    by_group: dict[str, Counter[str]] = field(default_factory=dict)
    truncated: Counter[str] = field(default_factory=Counter)

    def note(self, req: Request, outcome: Request | str) -> Request | None:
        self.examined += 1
        group = req.group or "-"
        if isinstance(outcome, str):
            self.dropped[outcome] += 1
            self.by_group.setdefault(outcome, Counter())[group] += 1
            return None
        if outcome is not req and (outcome.prompt, outcome.messages) != (req.prompt, req.messages):
            self.truncated[group] += 1  # shortened (a drawn output length is no shortening)
        return outcome

    @property
    def total(self) -> int:
        return sum(self.dropped.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "examined": self.examined,
            "total": self.total,
            "by_reason": dict(sorted(self.dropped.items())),
            "by_group": {k: dict(sorted(v.items())) for k, v in sorted(self.by_group.items())},
            "truncated": sum(self.truncated.values()),
            "truncated_by_group": dict(sorted(self.truncated.items())),
        }

    def text(self) -> str:
        """One line for the start of a run."""
        if not self.total and not self.truncated:
            return f"all {self.examined} candidate prompts kept"
        parts = [f"dropped {self.total} of {self.examined} candidate prompts"]
        for reason, n in sorted(self.dropped.items()):
            top = self.by_group[reason].most_common(5)
            more = "" if len(self.by_group[reason]) <= 5 else ", ..."
            parts.append(f"{reason}: {n} ({', '.join(f'{g} {k}' for g, k in top)}{more})")
        if self.truncated:
            parts.append(f"truncated to fit: {sum(self.truncated.values())}")
        return "; ".join(parts)


def _source_groups(spec: WorkloadSpec) -> dict[str, list[Request]]:
    if spec.mmlu_dir:
        return mmlu.load_groups(spec.mmlu_dir)
    return synthetic.synthetic_groups(
        seed=spec.seed, scale=spec.synthetic_scale, groups=spec.synthetic_groups
    )


def groups_for(spec: WorkloadSpec, fits: Fits | None = None) -> dict[str, list[Request]]:
    """The source's questions by group; with ``fits``, only requests it accepts (e.g. prompts
    within the engine's context), dropping groups left empty."""
    groups = _source_groups(spec)
    return groups if fits is None else admitted(groups, admit_fitting(fits), Drops())


def admitted(
    groups: dict[str, list[Request]], admit: Admit, drops: Drops
) -> dict[str, list[Request]]:
    """``groups`` after ``admit`` (counted in ``drops``), without groups left empty."""
    kept: dict[str, list[Request]] = {}
    for g, reqs in groups.items():
        mine = [k for r in reqs if (k := drops.note(r, admit(r))) is not None]
        if mine:
            kept[g] = mine
    return kept


def sample(spec: WorkloadSpec, groups: dict[str, list[Request]]) -> list[Request]:
    if spec.skewed:
        if spec.requests is None:
            raise ValueError("a skewed workload needs a request count")
        return skew.skewed(groups, spec.requests, spec.seed, spec.hot_fraction, spec.hot_share)
    return skew.uniform(groups, spec.requests, spec.seed)


def build(spec: WorkloadSpec, nodes: int, fits: Fits | None = None) -> list[Request]:
    admit: Admit = (lambda r: r) if fits is None else admit_fitting(fits)
    return build_counted(spec, nodes, admit)[0]


def build_counted(spec: WorkloadSpec, nodes: int, admit: Admit) -> tuple[list[Request], Drops]:
    """The request sequence and what admission dropped or shortened on the way (each
    request with its drawn output length first, when ``spec.max_tokens`` states one)."""
    drops = Drops()
    lengths = spec.output_lengths
    if lengths is not None:
        admit = _with_lengths(admit, lengths, spec.seed)
    if spec.trace:
        return entries(spec, _from_trace(spec, nodes, admit, drops), nodes), drops
    if spec.generated:
        reqs = _generated(spec, nodes, admit, drops)
    else:
        reqs = sample(spec, admitted(_source_groups(spec), admit, drops))
    reqs = entries(spec, reqs, nodes)
    if spec.load is not None:  # timed once the runner has measured the capacity
        return schedule.round_robin(reqs, nodes), drops
    return schedule.apply(reqs, spec.schedule, nodes, spec.rate, spec.seed, spec.arrival_cv), drops


def _with_lengths(admit: Admit, lengths: OutputLengths, seed: int) -> Admit:
    return lambda r: admit(lengths.apply(r, seed))


def entries(spec: WorkloadSpec, reqs: list[Request], nodes: int) -> list[Request]:
    """``reqs`` with the entry nodes ``spec.entry`` asks for (GIVEN: as they are)."""
    if spec.entry is Entry.RANDOM:
        return schedule.random_entries(reqs, nodes, spec.seed)
    return reqs


_CORPORA: dict[str | None, Corpus] = {}


def corpus_for(mmlu_dir: str | None) -> Corpus:
    """The generated workloads' text (MMLU sentences, else seeded words), loaded once."""
    if mmlu_dir not in _CORPORA:
        _CORPORA[mmlu_dir] = Corpus.for_dir(mmlu_dir)
    return _CORPORA[mmlu_dir]


def _generated(spec: WorkloadSpec, nodes: int, admit: Admit, drops: Drops) -> list[Request]:
    reqs = generate(spec.kind, spec.requests or 0, spec.seed,
                              corpus_for(spec.mmlu_dir), spec.synthetic_scale, nodes)  # fmt: skip
    return [k for r in reqs if (k := drops.note(r, admit(r))) is not None]


def _from_trace(spec: WorkloadSpec, nodes: int, admit: Admit, drops: Drops) -> list[Request]:
    reqs: list[Request] = []
    for r in trace.load(spec.trace or ""):
        if spec.requests is not None and len(reqs) >= spec.requests:
            break
        kept = drops.note(r, admit(r))
        if kept is not None:
            reqs.append(kept)
    check_times(reqs, spec.trace or "")
    if spec.rate:
        return schedule.timed(reqs, nodes, spec.rate, spec.seed, spec.arrivals, spec.arrival_cv)
    return schedule.round_robin(reqs, nodes)


def check_times(reqs: list[Request], name: str) -> None:
    """A trace's arrival times: on every line or none, and non-decreasing."""
    timed = [r.t for r in reqs if r.t is not None]
    if timed and len(timed) != len(reqs):
        raise trace.TraceError(f"{name}: 't' on {len(timed)} of {len(reqs)} lines (all or none)")
    for a, b in pairwise(reqs):
        if a.t is not None and b.t is not None and b.t < a.t:
            raise trace.TraceError(f"{name}: request {b.id!r} arrives before the one above it")


def generate(
    kind: str, n: int, seed: int, corpus: Corpus, scale: float = 1.0, nodes: int = 1
) -> list[Request]:
    """``n`` requests of workload ``kind`` (see the module docstring)."""
    if scale <= 0:
        raise ValueError("scale must be > 0")
    if kind == "chat":
        return chat.requests(n, seed, corpus, scale, nodes)
    if kind == "rag":
        return rag.requests(n, seed, corpus, scale)
    if kind == "agentic":
        return agentic.requests(n, seed, corpus, scale)
    if kind == "hotprefix":
        return hotprefix.requests(n, seed, corpus, scale)
    raise ValueError(f"unknown workload {kind!r}; choose from {', '.join(generated.KINDS)}")
