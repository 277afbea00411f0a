"""One point of a ``radixmesh sim`` sweep: the parsed flags -> workload, cluster configs, runs.

Shared by the sweep command (:mod:`radixmesh.sim.cli`), the experiments of docs/scale.md and
``--validate``: the same flags build the same requests (the benchmark's prompt filter and seeded
order), tokenizer, network and cluster configuration, so every entry point simulates the same
runs. ``auto`` settings scale with N: delta gossip every 0.5 s and the byte tokenizer up to
``AUTO_EPIDEMIC_ABOVE`` nodes, epidemic gossip every 1 s and word counts above.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from radixmesh.core.byte_tokenizer import ByteTokenizer
from radixmesh.core.config import ForwardConfig, GossipMode, PushbackConfig
from radixmesh.core.profile import Profile
from radixmesh.core.profile import resolve as resolve_profile
from radixmesh.core.profile_mix import parse_profiles
from radixmesh.core.router import Policy, RouterConfig
from radixmesh.core.units import parse_duration
from radixmesh.options import gossip_config
from radixmesh.results.run_summary import Slo
from radixmesh.sim import costs
from radixmesh.sim.gateway import GATEWAY_KINDS, GatewayConfig
from radixmesh.sim.network import (
    NetworkConfig,
    parse_fault,
    parse_partition,
    parse_regions,
)
from radixmesh.sim.runner import SimResult, SimSpec
from radixmesh.sim.runner import run as run_sim
from radixmesh.sim.shell import ClusterConfig
from radixmesh.sim.tokens import TOKENIZERS, Tokenize
from radixmesh.workload import WorkloadSpec, build, schedule
from radixmesh.workload.build import entries, groups_for, sample
from radixmesh.workload.request import Request
from radixmesh.workload.schedule import Entry

AUTO_EPIDEMIC_ABOVE = 32  # nodes: above this, auto gossip mode is epidemic with Δpoll 1 s


def split_csv(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def auto_mode(nodes: int, mode: str) -> GossipMode:
    if mode == "auto":
        return GossipMode.EPIDEMIC if nodes > AUTO_EPIDEMIC_ABOVE else GossipMode.DELTA
    return GossipMode.parse(mode)


def tokenizer_for(args: argparse.Namespace, nodes: int) -> tuple[Tokenize, str]:
    name = args.tokenizer
    if name == "auto":
        name = "words" if nodes > AUTO_EPIDEMIC_ABOVE else "bytes"
    return TOKENIZERS[name]()


def auto_interval(nodes: int, text: str) -> float:
    if text == "auto":
        return 1.0 if nodes > AUTO_EPIDEMIC_ABOVE else 0.5
    return parse_duration(text)


def network_config(args: argparse.Namespace, delay_s: float) -> NetworkConfig:
    regions: tuple[str, ...] = ()
    matrix: tuple[tuple[float, ...], ...] = ()
    if args.regions:
        if not args.region_delays:
            raise ValueError("--regions needs --region-delays")
        regions, matrix = parse_regions(args.regions, args.region_delays)
    return NetworkConfig(
        delay_s=delay_s,
        jitter_s=parse_duration(args.net_jitter),
        loss=args.net_loss,
        regions=regions,
        region_delay_s=matrix,
        partitions=tuple(parse_partition(t) for t in args.partition),
        faults=tuple(parse_fault(t) for t in args.crash),
    )


def mean_prompt_tokens(requests: list[Request], tokenize: Any) -> float:
    sample = requests[:: max(1, len(requests) // 200)] or requests
    return sum(len(tokenize(r)) for r in sample) / max(1, len(sample))


def capacity_rate(
    cost: costs.CostModel,
    nodes: int,
    prompt_tokens: float,
    max_tokens: int,
    shared_cores: float | None = None,
    node_costs: Sequence[costs.CostModel] = (),
) -> float:
    """Requests/s the cluster serves if a typical request finds 85% of its prompt cached
    (on ``shared_cores`` cores when the nodes share a machine). Under mixed hardware, what
    ``none``'s even spread sustains: every node gets 1/N of the arrivals, so the slowest node
    saturates first (N x its rate), as the bench's capacity, measured with ``none``, does. A
    profiled (batching) node's rate is :func:`batched_rate`; a legacy cost model serves one
    request at a time."""
    if node_costs:
        rates = [capacity_rate(c, 1, prompt_tokens, max_tokens) for c in node_costs]
        return len(rates) * min(rates)
    cached = int(prompt_tokens * 0.85)
    if cost.profile is not None and shared_cores is None:
        return nodes * batched_rate(cost.profile, int(prompt_tokens), cached, max_tokens)
    service = cost.service_s(int(prompt_tokens) - cached, cached, max_tokens)
    servers = nodes if shared_cores is None else min(float(nodes), shared_cores)
    return servers / service


def batched_rate(profile: Profile, prompt: int, cached: int, max_tokens: int) -> float:
    """Requests/s one batching engine sustains within the default TPOT SLO: the largest batch
    ``b`` (up to ``max_running`` and what its KV pool holds) whose decode step stays within
    ``Slo().tpot_s``, each request's prefill (``prompt - cached`` new tokens) and ``max_tokens``
    batch-``b`` decode steps shared ``b`` ways. A planning figure (the loads' 100 %), not a
    measurement: the simulation then shows what the engine does at that rate."""
    context = prompt + max_tokens // 2
    kv_fit = profile.kv_blocks * profile.block_size // max(1, prompt + max_tokens)
    b = max(1, min(profile.max_running, kv_fit))
    while b > 1 and profile.tpot_s(b, context) > Slo().tpot_s:
        b -= 1
    new = max(0, prompt - cached)
    prefill = profile.prefill_token_s * new + profile.prefill_attn_s * new * (cached + new / 2)
    per_request = prefill + max_tokens * profile.tpot_s(b, context) / b
    return 1.0 / per_request


def profile_costs(text: str, nodes: int) -> tuple[costs.CostModel, ...]:
    """``--profiles NAME:COUNT,...`` (the bench's syntax and parser) -> each node's cost
    model, in node order; ``()`` for an empty text (every node runs ``--cost-model``)."""
    if not text:
        return ()
    names = parse_profiles(text, nodes)
    made = {n: costs.from_profile(resolve_profile(n)) for n in set(names)}
    return tuple(made[n] for n in names)


def cluster_cost(args: argparse.Namespace, node_costs: Sequence[costs.CostModel]
                 ) -> costs.CostModel:  # fmt: skip
    """The cluster's cost model: ``--cost-model``, or under ``--profiles`` the first node's
    (the priors' and forward overhead's source), named after the mix."""
    if not node_costs:
        return costs.resolve(args.cost_model)
    return replace(node_costs[0], name=f"profiles:{args.profiles}")


def requests_for(args: argparse.Namespace, skewed: bool, nodes: int) -> list[Request]:
    """The workload in the paper's order, round-robin entries unless random ones are asked
    for (``--entry``; times added later)."""
    spec = WorkloadSpec(
        kind=getattr(args, "workload", None) or "mmlu",
        requests=args.requests,
        skewed=skewed,
        seed=args.seed,
        mmlu_dir=args.mmlu_dir,
        trace=args.trace,
        synthetic_scale=args.synthetic_scale,
        synthetic_groups=args.synthetic_groups,
        entry=getattr(args, "entry", Entry.GIVEN),
    )
    fits = _fits(args.max_context)
    if spec.trace or spec.generated:
        reqs = build(spec, nodes, fits)
    else:  # as workload.build, with the question pool generated once per process
        drawn = entries(spec, sample(spec, _groups(spec, args.max_context)), nodes)
        reqs = schedule.round_robin(drawn, nodes)
    if args.max_tokens is not None:
        reqs = [replace(r, max_tokens=args.max_tokens) for r in reqs]
    return reqs


_GROUPS: dict[tuple[object, ...], dict[str, list[Request]]] = {}


def _groups(spec: WorkloadSpec, max_context: int | None) -> dict[str, list[Request]]:
    key = (spec.mmlu_dir, spec.seed, spec.synthetic_scale, spec.synthetic_groups, max_context)
    if key not in _GROUPS:
        _GROUPS.clear()
        _GROUPS[key] = groups_for(spec, _fits(max_context))
    return _GROUPS[key]


def _fits(max_context: int | None) -> Callable[[Request], bool] | None:
    """The benchmark's filter: prompts (in the built-in engine's byte tokens) that leave room
    for the output in a ``max_context`` window; None keeps everything."""
    if max_context is None:
        return None
    encode = ByteTokenizer().encode
    return lambda r: len(encode(r.text)) + r.max_tokens + 8 < max_context


def _label(
    policy: str, nodes: int, delay: float, interval: float, skew: str, many: dict[str, bool]
) -> str:
    parts = [policy]
    if many["nodes"]:
        parts.append(f"n{nodes}")
    if many["delay"]:
        parts.append(f"d{delay * 1000:g}ms")
    if many["interval"]:
        parts.append(f"poll{interval * 1000:g}ms")
    if many["skew"]:
        parts.append(skew)
    return "/".join(parts)


def parse_policies(text: str) -> list[str]:
    """``--policy``: the routers' policies, ``cache_aware`` and ``smg`` (a centralized
    gateway in front of ``none`` nodes, ``sim/gateway.py``), comma-separated, checked."""
    names = split_csv(text)
    for name in names:
        if name not in GATEWAY_KINDS:
            Policy.parse(name)  # (raises with the choices)
    return names


def sweep_point(
    args: argparse.Namespace,
    cost: costs.CostModel,
    policies: list[str],
    nodes: int,
    delays: list[float],
    skew: str,
    many: dict[str, bool],
) -> list[SimResult]:
    tokenize, tok_fp = tokenizer_for(args, nodes)
    mode = auto_mode(nodes, args.gossip_mode)
    intervals = [auto_interval(nodes, t) for t in split_csv(args.gossip_interval)]
    node_costs = profile_costs(getattr(args, "profiles", ""), nodes)
    if node_costs:
        cost = cluster_cost(args, node_costs)
    requests, rate = _arrivals(args, cost, nodes, skew, tokenize, node_costs)
    results = []
    for delay, interval, policy in itertools.product(delays, intervals, policies):
        name = _label(policy, nodes, delay, interval, skew, many)
        cluster = _cluster_config(args, cost, policy, nodes, delay, interval, mode, tok_fp)
        cluster = replace(cluster, node_costs=node_costs)
        spec = _run_spec(args, name, cluster, skew)
        if not args.quiet:
            extra = f", {rate:.1f} req/s" if rate else ""
            _say(
                f"[sim] {name}: {nodes} nodes, {len(requests)} requests, gossip "
                f"{mode.value} every {interval:g}s{extra}"
            )
        res = run_sim(spec, requests, tokenize, None if args.quiet else _progress)
        if not args.quiet:
            _report_speed(res)
        results.append(res)
    return results


def _arrivals(
    args: argparse.Namespace, cost: costs.CostModel, nodes: int, skew: str, tokenize: Tokenize,
    node_costs: Sequence[costs.CostModel] = (),
) -> tuple[list[Request], float | None]:  # fmt: skip
    """The point's requests, with Poisson arrival times under ``--schedule poisson`` (at
    ``--rate``, else ``--load`` x the estimated capacity), and that rate (None otherwise)."""
    requests = requests_for(args, skew == "skewed", nodes)
    if args.schedule == "sequential" or not requests:
        return requests, None
    max_tokens = requests[0].max_tokens
    rate = args.rate or args.load * capacity_rate(
        cost, nodes, mean_prompt_tokens(requests, tokenize), max_tokens, args.shared_cores,
        node_costs,
    )
    if args.schedule == "bursty":
        return schedule.bursty(requests, nodes, rate, args.arrival_cv, args.seed), rate
    return schedule.poisson(requests, nodes, rate, args.seed), rate


def _bound(load_bound: float | None) -> float | None:
    """The load bound, None (off) for None or a negative number (the old spelling of off)."""
    return None if load_bound is None or load_bound < 0 else load_bound


def _cluster_config(
    args: argparse.Namespace,
    cost: costs.CostModel,
    policy: str,
    nodes: int,
    delay: float,
    interval: float,
    mode: GossipMode,
    tok_fp: str,
) -> ClusterConfig:
    gateway = GatewayConfig(kind=policy) if policy in GATEWAY_KINDS else None
    return ClusterConfig(
        nodes=nodes,
        cost=cost,
        gateway=gateway,
        router=RouterConfig(
            policy=Policy.NONE if gateway is not None else Policy.parse(policy),
            context_scale=cost.context_scale if args.tuned_priors else 4096.0,
            load_bound=_bound(args.load_bound),
        ),
        gossip=gossip_config(interval, mode, args.gossip_fanout, args.gossip_announce),
        pushback=PushbackConfig(queue_threshold=args.pushback_threshold),
        network=network_config(args, delay),
        cache_tokens=args.cache_tokens,
        forward=ForwardConfig(silence_timeout_s=parse_duration(args.forward_timeout)),
        seeds=args.seeds,
        seed=args.seed,
        tokenizer=tok_fp,
        service_noise=args.service_noise or 0.0,
        tuned_priors=args.tuned_priors,
        shared_cores=args.shared_cores,
        decisions=getattr(args, "decisions", False),
    )


def _run_spec(args: argparse.Namespace, name: str, cluster: ClusterConfig, skew: str) -> SimSpec:
    return SimSpec(
        name=name,
        cluster=cluster,
        workload=_workload_label(args),
        skew=skew,
        schedule=args.schedule,
        concurrency=cluster.nodes if args.concurrency == "nodes" else int(args.concurrency),
        warmup_s=parse_duration(args.warmup) if args.warmup else None,
        excluded=getattr(args, "exclude_warmup", None) or (0, 0.0),
    )


def _workload_label(args: argparse.Namespace) -> str:
    kind = getattr(args, "workload", None) or "mmlu"
    if args.trace:
        return "trace"
    if kind != "mmlu":
        return kind
    return "mmlu" if args.mmlu_dir else "synthetic"


def _report_speed(res: SimResult) -> None:
    s = res.summary["sim"]
    _say(
        f"[sim]   {s['events']:,} events in {s['wall_s']:.1f}s wall = "
        f"{s['events_per_s']:,.0f} events/s ({s['virtual_s']:.1f}s virtual)"
    )


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _progress(done: int, total: int) -> None:
    print(
        f"\r[sim]   {done}/{total} requests",
        end="\n" if done == total else "",
        file=sys.stderr,
        flush=True,
    )
