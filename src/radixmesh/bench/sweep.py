"""Sweeps: flag lists → the cartesian product of :class:`RunSpec`, and the named sweeps.

``paper`` reproduces §4–5 (Tables 1–3, Figs 2–4) plus the baselines, in priority order (the
runs the headline targets need come first, so a sweep cut short still answers them).
``quick`` is a CI-sized version: few requests, a small synthetic workload, the main policies.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from radixmesh.bench.spec import RunSpec
from radixmesh.workload import Schedule

ABUNDANT_CACHE = 200_000  # tokens/node: every MMLU prefix fits (51 fitting subjects: 81k)
PRESSURE_CACHE = 20_000  # ≈ a quarter of all subjects' prefixes per node


def fmt_s(seconds: float) -> str:
    if seconds >= 1 and float(seconds).is_integer():
        return f"{int(seconds)}s"
    return f"{seconds * 1000:g}ms"


def run_name(s: RunSpec) -> str:
    parts = [s.policy, s.skew, f"d{fmt_s(s.net_delay_s)}", f"g{fmt_s(s.gossip_interval_s)}",
             f"c{s.cache_tokens}", f"n{s.nodes}"]  # fmt: skip
    if s.workload.rate:
        parts.append(f"r{s.workload.rate:g}")
    if s.concurrency > 1:
        parts.append(f"k{s.concurrency}")
    return "-".join(parts)


@dataclass(frozen=True, slots=True)
class SweepAxes:
    policies: Sequence[str] = ("none", "paper", "cost")
    net_delays_s: Sequence[float] = (0.002,)
    gossip_intervals_s: Sequence[float] = (0.5,)
    skews: Sequence[str] = ("uniform",)
    cache_tokens: Sequence[int] = (ABUNDANT_CACHE,)
    nodes: Sequence[int] = (4,)
    rates: Sequence[float | None] = (None,)
    concurrency: Sequence[int] = (1,)


def point_key(s: RunSpec) -> str:
    """The run's name without its policy: runs of one sweep point share it."""
    return run_name(s).split("-", 1)[1]


def paired(specs: Sequence[RunSpec]) -> list[RunSpec]:
    """Mark every run to run beside the other policies of its sweep point (lockstep key =
    the point); ``radixmesh.bench.runner`` batches them, paired in time."""
    return [replace(s, lockstep=point_key(s)) for s in specs]


def expand(axes: SweepAxes, base: RunSpec) -> list[RunSpec]:
    out: list[RunSpec] = []
    product = itertools.product(
        axes.skews, axes.net_delays_s, axes.gossip_intervals_s, axes.cache_tokens,
        axes.nodes, axes.rates, axes.concurrency, axes.policies,
    )  # fmt: skip
    for skew, delay, gossip, cache, nodes, rate, conc, policy in product:
        w = replace(
            base.workload,
            skewed=skew == "skewed",
            rate=rate,
            schedule=Schedule.POISSON if rate else Schedule.SEQUENTIAL,
        )
        spec = replace(
            base, policy=policy, workload=w, net_delay_s=delay, gossip_interval_s=gossip,
            cache_tokens=cache, nodes=nodes, concurrency=conc,
        )  # fmt: skip
        out.append(replace(spec, name=run_name(spec)))
    return out


def _mk(base: RunSpec, group: str, policy: str, **kw: object) -> RunSpec:
    skewed = bool(kw.pop("skewed", False))
    requests = kw.pop("requests", base.workload.requests)
    w = replace(base.workload, skewed=skewed, requests=requests)  # type: ignore[arg-type]
    spec = replace(base, policy=policy, workload=w, group=group, **kw)  # type: ignore[arg-type]
    return replace(spec, name=run_name(spec))


def _together(key: str, runs: list[RunSpec]) -> list[RunSpec]:
    """Mark ``runs`` to run interleaved (lockstep) as one batch; names get ``@key``."""
    return [replace(r, lockstep=key, name=f"{r.name}@{key}") for r in runs]


def paper_sweep(base: RunSpec, with_sglang: bool = True) -> list[RunSpec]:
    """The paper's experiments (+ oracle, sglang and simple baselines), most important first.

    Each comparison runs *interleaved*: the clusters of one batch (e.g. none, cost, paper,
    oracle) are all up, and request i goes to each of them in turn, one at a time — the paper's
    schedule for every cluster, under the same background load for all, so the paired ratios
    survive a shared, noisy machine. Every configuration gets ``--requests`` but ``paper`` under
    a slow network, and the poll, baseline and open-loop groups (0.3× as many)."""
    n = base.workload.requests or 1000
    third = max(60, n * 3 // 10)
    pols4 = ("none", "cost", "paper", "oracle")
    gateways = ("none", "cost", "sglang", "smg") if with_sglang else ("none", "cost")
    runs = _together("uniform", [_mk(base, "t1", p) for p in pols4])
    runs += _together("skewed", [_mk(base, "skew", p, skewed=True) for p in pols4])
    runs += _together("pressure", [_mk(base, "pressure", p, cache_tokens=PRESSURE_CACHE)
                                   for p in pols4])  # fmt: skip
    for key, delay in (("d200ms", 0.2), ("d1s", 1.0)):
        # paper forwards whatever the network costs (~2 s a request at 1 s): fewer requests
        runs += _together(key, [
            _mk(base, "delay", "none", net_delay_s=delay),
            _mk(base, "delay", "cost", net_delay_s=delay),
            _mk(base, "delay", "paper", net_delay_s=delay, requests=third),
        ])  # fmt: skip
    runs += _together("sglang", [_mk(base, "sglang", p) for p in gateways])
    for k in (4, 16):  # closed loop: the batch's clusters run their k clients at the same time
        runs += _together(f"k{k}", [_mk(base, f"k{k}", p, concurrency=k) for p in gateways])
    # the paper's Δpoll sweep: pure polling (announcements would spread every change within
    # 50 ms whatever Δpoll is, and the sweep would measure nothing)
    runs += _together("poll", [_mk(base, "poll", "paper", gossip_interval_s=g, requests=third,
                                   gossip_announce_s=None)
                               for g in (0.02, 0.1, 2.0, 300.0)])  # fmt: skip
    simple = ("none", "random", "round_robin", "least_loaded")
    runs += _together("baselines", [_mk(base, "baselines", p, requests=third) for p in simple])
    runs += _together("open", [_mk_open(base, p, rate=OPEN_RATE, requests=third)
                               for p in ("none", "cost", "paper")])  # fmt: skip
    return runs


# Open-loop arrivals of the paper sweep, sized for the 2-core box: three 4-node clusters up at
# once share 2 cores (~0.67 core each); an MMLU request costs a tiny node ~0.3-1 s of CPU at
# the hit rates seen there, so ~1 req/s saturates a cluster and 0.5 req/s keeps it near half.
OPEN_RATE = 0.5


def _mk_open(base: RunSpec, policy: str, rate: float, requests: int) -> RunSpec:
    w = replace(base.workload, requests=requests, rate=rate, schedule=Schedule.POISSON)
    spec = replace(base, policy=policy, workload=w, group="open")
    return replace(spec, name=run_name(spec))


def quick_sweep(base: RunSpec) -> list[RunSpec]:
    """CI-sized: none/paper/cost/oracle paired on a small synthetic workload (the CLI
    defaults it to 32 requests over 6 groups at 0.2x MMLU length), gossip every 100 ms;
    interleaved one at a time, or, with a rate, on one shared open-loop arrival schedule."""
    pols = ("none", "paper", "cost", "oracle")
    if base.workload.rate:
        runs = [_mk_open(base, p, rate=base.workload.rate, requests=base.workload.requests or 32)
                for p in pols]  # fmt: skip
        runs = [replace(r, gossip_interval_s=0.1) for r in runs]
        runs = [replace(r, name=run_name(r)) for r in runs]
    else:
        runs = [_mk(base, "t1", p, gossip_interval_s=0.1) for p in pols]
    return [replace(r, lockstep="quick") for r in runs]


SWEEPS = {"paper": paper_sweep, "quick": quick_sweep}  # bench --sweep NAME
