"""The faults: each injects one failure into a running keyed cluster and measures what it cost.

Every fault sends real completions and checks the paper's claim (§3) that failures cost only
time: 0 client-visible failures and every answer equal to the single-node greedy reference.
Fault-specific criteria (views converge, push-back fires, old estimates dropped) are recorded
as checks; criteria about elapsed time are marked ``timing`` (reported, not asserted in CI).

Faults use disjoint prompt groups so one fault's cache contents never steer another's routing.

The faults of the mesh itself are here (a forward target killed, stopped or cut mid-stream, a
restart, gossip loss, a partition, a slow node); those of an adversary (hostile peer messages,
a node with the wrong key, the cache side channel) are :mod:`radixmesh.chaos.attacks`'s, and
:mod:`radixmesh.chaos.suite` runs them all in order. Both use the helpers here (``tally``,
``latency``, ``sum_metric``, prompt groups).
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from radixmesh.chaos.env import ChaosEnv
from radixmesh.chaos.load import ClientOutcome, Prompt
from radixmesh.chaos.report import FaultResult
from radixmesh.results.run_summary import percentile


@dataclass(frozen=True, slots=True)
class FaultPlan:
    requests: int = 12  # client requests per fault (per level for gossip loss)
    concurrency: int = 3
    loss_levels: tuple[float, ...] = (0.0, 0.5)
    duplicate: float = 0.2
    partition_hold_s: float = 1.5  # > suspect (4 Δpoll), < dead
    slow_delay_s: float = 0.4
    converge_timeout_s: float = 15.0
    wrong_key: bool = False  # start a second cluster with a misconfigured node (slow: ~20 s)

    @classmethod
    def quick(cls) -> FaultPlan:
        return cls()

    @classmethod
    def full(cls) -> FaultPlan:
        return cls(requests=40, concurrency=4, loss_levels=(0.0, 0.1, 0.25, 0.5),
                   partition_hold_s=3.0, wrong_key=True)


# ------------------------------------------------------------------------------- helpers
def tally(env: ChaosEnv, r: FaultResult, outcomes: Sequence[ClientOutcome]) -> None:
    """Count requests, client-visible failures and lost/wrong answers into ``r``."""
    r.requests += len(outcomes)
    failed = [o for o in outcomes if not o.ok]
    r.failures += len(failed)
    lost = env.lost(outcomes)
    r.lost += len(lost)
    for o in failed[:3]:
        r.note(f"failure: {o.error}")
    routes = Counter(o.route or "none" for o in outcomes)
    served = Counter(o.served_by or "none" for o in outcomes)
    r.figures.setdefault("routes", {})
    r.figures.setdefault("served_by", {})
    for key, counts in (("routes", routes), ("served_by", served)):
        bucket = r.figures[key]
        assert isinstance(bucket, dict)
        for name, n in counts.items():
            bucket[name] = bucket.get(name, 0) + n


def latency(outcomes: Sequence[ClientOutcome], q: float) -> float | None:
    """The ``q``-th percentile latency of the successful outcomes."""
    return percentile([o.latency_s for o in outcomes if o.ok], q)


def _share(outcomes: Sequence[ClientOutcome], node_id: str) -> float:
    return sum(o.served_by == node_id for o in outcomes) / max(1, len(outcomes))


def _node_id(env: ChaosEnv, i: int) -> str:
    return env.cluster.nodes[i].node_id


def sum_metric(env: ChaosEnv, prefix: str) -> float:
    """Every running node's samples whose name starts with ``prefix``, summed."""
    total = 0.0
    for n in env.cluster.nodes:
        if n.running:
            total += sum(v for k, v in env.metrics(n.index).items() if k.startswith(prefix))
    return total


def _prompts(env: ChaosEnv, groups: Sequence[int], n: int, skip: int = 0) -> list[Prompt]:
    """``n`` prompts interleaved from ``groups`` (after the first ``skip`` of each)."""
    pools = [env.groups[g % len(env.groups)][skip:] for g in groups]
    out: list[Prompt] = []
    i = 0
    while len(out) < n and any(i < len(p) for p in pools):
        out.extend(p[i] for p in pools if i < len(p))
        i += 1
    return out[:n]


# ------------------------------------------------------------------------------- faults
def kill_forward_target(env: ChaosEnv, plan: FaultPlan, sig: int = signal.SIGKILL,
                        stream: bool = False) -> FaultResult:
    """kill -9 (or SIGSTOP: a hung node) of the peer that requests are being forwarded to.

    ``stream``: clients stream (SSE) 48 tokens each, so the kill lands mid-generation; a
    forward that dies after streaming some tokens must finish locally, seamlessly.
    """
    hung = sig == signal.SIGSTOP
    name = "hung forward target (SIGSTOP)" if hung else "kill -9 of the forward target"
    r = FaultResult(name + (", streaming clients" if stream else ""))
    entry, target = 0, (2 if hung else 1) % len(env.cluster)
    group = _kill_group(env, hung, stream)
    base, load = _forwarding_baseline(env, r, entry, target, group, plan.requests)
    _load_with_kill(env, plan, r, (entry, target, sig), base, load)
    if hung:
        env.cluster.kill(target, signal.SIGCONT)
        t = env.wait_converged(plan.converge_timeout_s)
        r.check(t is not None, "after SIGCONT the hung node rejoined and views converged")
        r.figures["rejoin_s"] = t
    elif stream:  # the next faults need every node (the plain kill has its own restart fault)
        env.cluster.restart(target)
    r.check(r.failures == 0, "0 client-visible failures")
    r.check(r.lost == 0, "every answer equals the single-node greedy output")
    return r


def _kill_group(env: ChaosEnv, hung: bool, stream: bool) -> list[Prompt]:
    """The prompt group of one kill variant: streaming clients ask for 48 tokens, the others
    send the API's plain (non-streamed) request."""
    group = env.groups[6 if stream else 1 if hung else 0]
    if stream:
        return [Prompt(p.id + "-sse", p.text, 48, True) for p in group]
    return [Prompt(p.id, p.text, p.max_tokens, stream=False) for p in group]


def _forwarding_baseline(env: ChaosEnv, r: FaultResult, entry: int, target: int,
                         group: Sequence[Prompt], requests: int
                         ) -> tuple[list[ClientOutcome], list[Prompt]]:
    """Warm ``target`` with the group's prefix and check that ``entry`` forwards to it.

    Returns the baseline outcomes and the prompts of the load to run under the fault.
    """
    warm, probe, load = group[:2], group[2:5], list(group[5:5 + requests])
    env.references([*probe, *load])
    env.warm(target, warm)
    r.check(env.wait_view(entry, target), "the entry node learned the target's cache")
    base = env.send(lambda _: env.url(entry), probe, 1)
    tally(env, r, base)
    tid = _node_id(env, target)
    r.check(sum(o.served_by == tid for o in base) >= 2,
            "before the fault, requests for the target's prefix were forwarded to it")
    return base, load


def _load_with_kill(env: ChaosEnv, plan: FaultPlan, r: FaultResult,
                    who: tuple[int, int, int], base: Sequence[ClientOutcome],
                    load: Sequence[Prompt]) -> None:
    """Send ``load`` through the entry; signal the target once a third of it has finished.

    ``who`` is (entry, target, signal).
    """
    entry, target, sig = who
    stop_after = max(1, len(load) // 3)
    fault_t: list[float] = []
    done: list[int] = []

    def on_done(i: int, _: ClientOutcome) -> None:
        done.append(i)
        if not fault_t and len(done) >= stop_after:  # the others are still in flight
            env.cluster.kill(target, sig)
            fault_t.append(time.monotonic())

    failures0 = _forward_failures(env, entry)
    t0 = time.monotonic()
    outs = env.send(lambda _: env.url(entry), load, plan.concurrency, on_done=on_done)
    tally(env, r, outs)
    _latency_bound(r, env, base, outs, t0, fault_t)
    after = _forward_failures(env, entry)
    r.figures["entry_forward_failures"] = {
        k: v - failures0.get(k, 0.0) for k, v in after.items() if v != failures0.get(k, 0.0)}


def _forward_failures(env: ChaosEnv, i: int) -> dict[str, float]:
    """Failed forwards of node ``i`` by reason (``disconnected`` after ``accepted`` = the peer
    died mid-request; ``timeout``; ``connect``; ...)."""
    prefix = 'radixmesh_forward_failures_total{reason="'
    return {k[len(prefix):-2]: v for k, v in env.metrics(i).items() if k.startswith(prefix)}


def _latency_bound(r: FaultResult, env: ChaosEnv, base: Sequence[ClientOutcome],
                   outs: Sequence[ClientOutcome], t0: float, fault_t: Sequence[float]) -> None:
    if not fault_t:
        r.check(False, "the fault was injected during the load")
        return
    at = fault_t[0] - t0
    hit = [o for o in outs if o.t_start <= at <= o.t_start + o.latency_s]
    after = [o for o in outs if o.t_start > at]
    p50 = latency(base, 50) or 0.0
    worst = max((o.latency_s for o in hit + after), default=0.0)
    # A fallback costs at most one forward timeout plus one local execution (and some noise).
    bound = env.config.forward_timeout + max(0.25, 2 * (latency(base, 100) or 0.0))
    routes = Counter(o.route for o in hit + after)
    r.figures.update({
        "baseline_p50_s": p50, "in_flight_at_fault": len(hit), "worst_latency_after_s": worst,
        "added_latency_s": max(0.0, worst - p50), "bound_s": bound,
        "routes_after_fault": dict(routes),
        "forward_timeout_s": env.config.forward_timeout,
    })
    r.note(f"{len(hit)} in flight at the fault; worst latency after it {worst:.2f}s "
           f"(baseline p50 {p50:.2f}s, forward timeout {env.config.forward_timeout:g}s)")
    r.check(worst <= bound, "added latency bounded by the forward timeout "
            "(+ a local re-execution)", timing=True)


def restart_new_incarnation(env: ChaosEnv, plan: FaultPlan, target: int = 1) -> FaultResult:
    """Restart a node (it was killed or is running): every peer must drop its old estimate."""
    r = FaultResult("restart with a new incarnation")
    observers = [n.index for n in env.cluster.nodes if n.index != target and n.running]
    before = {i: env.peer_entry(i, target) for i in observers}
    old_inc = {i: (e or {}).get("incarnation") for i, e in before.items()}
    old_blocks = {i: (e or {}).get("view_blocks", 0) for i, e in before.items()}
    r.figures["old_view_blocks"] = old_blocks
    r.check(any(b for b in old_blocks.values()),
            "before the restart, peers still held an estimate of the old incarnation")
    t0 = time.monotonic()
    env.cluster.restart(target)  # waits until every node sees the new incarnation alive
    r.figures["restart_s"] = round(time.monotonic() - t0, 2)
    truth = env.meshes([target])[target]
    for i in observers:
        e = env.peer_entry(i, target) or {}
        r.check(e.get("incarnation") not in (None, old_inc[i]),
                f"{_node_id(env, i)} sees the new incarnation")
        r.check(e.get("view_blocks") == truth.get("blocks"),
                f"{_node_id(env, i)} dropped the old estimate ({old_blocks[i]} blocks -> "
                f"{e.get('view_blocks')}, truth {truth.get('blocks')})")
    probe = env.groups[0][2:2 + max(3, plan.requests // 4)]
    outs = env.send(lambda _: env.url(observers[0]), probe, 1)
    tally(env, r, outs)
    tid = _node_id(env, target)
    r.check(not any(o.served_by == tid and o.route == "forwarded" for o in outs),
            "no request is forwarded to the restarted node on the strength of its old cache")
    r.check(r.failures == 0 and r.lost == 0, "0 failures, every answer correct")
    return r


def gossip_loss(env: ChaosEnv, plan: FaultPlan, loss: float, groups: Sequence[int]
                ) -> FaultResult:
    """Loss + duplication + reordering (jitter > Δpoll) on every gossip message."""
    jitter = 2 * env.delta_poll
    r = FaultResult(f"gossip loss {loss:.0%}, duplication {plan.duplicate:.0%}, "
                    f"reordering (jitter {jitter:g}s)")
    n = len(env.cluster)
    prompts = _prompts(env, groups, plan.requests)
    env.references(prompts)
    replays0 = sum_metric(env, "radixmesh_peer_auth_rejected_replayed")
    dropped0 = sum_metric(env, "radixmesh_netem_dropped_loss")
    env.set_netem(loss=loss, duplicate=plan.duplicate, jitter=jitter)
    try:
        # Paced, so views (lossy as they are) have time to steer later requests of a group.
        outs = env.send(lambda i: env.url(i % n), prompts, 2, pace_s=env.delta_poll)
        time.sleep(4 * env.delta_poll)  # let the lossy gossip run a few more rounds
    finally:
        env.set_netem(loss=0.0, duplicate=0.0, jitter=0.0)
    tally(env, r, outs)
    t = env.wait_converged(plan.converge_timeout_s)
    r.figures.update({
        "converge_after_loss_stops_s": t,
        "gossip_dropped": sum_metric(env, "radixmesh_netem_dropped_loss") - dropped0,
        "duplicates_refused_as_replays": sum_metric(
            env, "radixmesh_peer_auth_rejected_replayed") - replays0,
    })
    r.note(f"views converged {t:.2f}s after the loss stopped" if t is not None
           else "views did NOT converge")
    r.check(r.failures == 0, "0 client-visible failures")
    r.check(r.lost == 0, "outputs identical to a single node's greedy output")
    r.check(t is not None, "views converge after the loss stops")
    return r


def partition_halves(env: ChaosEnv, plan: FaultPlan, groups: Sequence[int]) -> FaultResult:
    """Split the cluster in two; both halves keep serving; measure convergence after healing."""
    n = len(env.cluster)
    first = list(range(max(1, n // 2)))
    second = [i for i in range(n) if i not in first]
    r = FaultResult(f"partition into two halves {first} | {second}")
    prompts = _prompts(env, groups, plan.requests)
    env.references(prompts)
    env.cluster.split(first, second)
    t_split = time.monotonic()
    try:
        outs = env.send(lambda i: env.url(i % n), prompts, plan.concurrency)
        served = Counter(o.served_by for o in outs if o.ok)
        for half in (first, second):
            ids = {_node_id(env, i) for i in half}
            r.check(any(served[x] for x in ids), f"half {sorted(ids)} kept serving")
        rest = plan.partition_hold_s - (time.monotonic() - t_split)
        if rest > 0:
            time.sleep(rest)
        views = env.meshes([first[0]])[first[0]]["peers"]
        r.figures["states_seen_across_partition"] = {
            p["node_id"]: p["state"] for p in views if p["node_id"] in
            {_node_id(env, i) for i in second}}
    finally:
        env.cluster.heal()
    t_heal = time.monotonic()
    t = env.wait_converged(plan.converge_timeout_s)
    tally(env, r, outs)
    held = t_heal - t_split
    r.figures.update({"partition_held_s": round(held, 2), "converge_after_heal_s": t,
                      "delta_poll_s": env.delta_poll})
    r.note(f"held {held:.1f}s; views converged {t:.2f}s after healing "
           f"(= {t / env.delta_poll:.1f} Δpoll)" if t is not None else "views did NOT converge")
    r.check(r.failures == 0 and r.lost == 0, "0 failures, every answer correct")
    r.check(t is not None, "views converge after healing")
    r.check(t is not None and t <= 2 * env.delta_poll, "converged within 2 Δpoll", timing=True)
    return r


def _pushed_back(env: ChaosEnv, node: int) -> float:
    """Push-backs started plus forwards refused as busy by ``node`` (its core's counters)."""
    m = env.metrics(node)
    names = ("pushback_started", "forwards_refused_busy", "forwards_refused_slower")
    return sum(m.get(f"radixmesh_core_{name}_total", 0.0) for name in names)


def slow_node(env: ChaosEnv, plan: FaultPlan, groups: tuple[int, int]) -> FaultResult:
    """A node's engine becomes slow: push-back fires, traffic moves away, then comes back."""
    r = FaultResult(f"slow node (engine +{plan.slow_delay_s:g}s per request) -> push-back")
    entry, slow = 0, 1 % len(env.cluster)
    sid = _node_id(env, slow)
    hot, later = env.groups[groups[0]], env.groups[groups[1]]
    burst = hot[5:5 + max(plan.requests, 12)]
    env.references([*hot[2:5], *burst, *later[2:6]])
    env.warm(slow, hot[:2])
    r.check(env.wait_view(entry, slow), "the entry node learned the slow node's cache")
    before = env.send(lambda _: env.url(entry), hot[2:5], 1)
    tally(env, r, before)
    pushbacks0 = _pushed_back(env, slow)
    env.admin(slow, "/admin/engine-delay", {"seconds": plan.slow_delay_s})
    try:
        during = env.send(lambda _: env.url(entry), burst, 2 * env.config.pushback_threshold)
    finally:
        env.admin(slow, "/admin/engine-delay", {"seconds": 0.0})
    tally(env, r, during)
    pushbacks = _pushed_back(env, slow) - pushbacks0
    half = len(during) // 2
    early, late = _share(during[:half], sid), _share(during[half:], sid)
    time.sleep(2.5 * env.delta_poll + 1.0)  # push-back (1 s) expires and is gossiped away
    env.warm(slow, later[:2])
    r.check(env.wait_view(entry, slow), "the recovered node's new cache reached the entry node")
    after = env.send(lambda _: env.url(entry), later[2:6], 1)
    tally(env, r, after)
    back = _share(after, sid)
    r.figures.update({"share_before": _share(before, sid), "share_first_half": early,
                      "share_second_half": late, "share_after_recovery": back,
                      "pushback_started_or_refused": pushbacks})
    r.note(f"share served by the slow node: before {_share(before, sid):.0%}, while slow "
           f"{early:.0%} -> {late:.0%}, after recovery {back:.0%}; push-back started or "
           f"forwards refused as busy {pushbacks:g}x")
    r.check(pushbacks > 0, "the slow node pushed back (gossip) or refused forwards (busy)")
    r.check(late < _share(before, sid), "traffic moved away from the slow node")
    r.check(back >= 0.5, "traffic came back after it recovered")
    r.check(r.failures == 0 and r.lost == 0, "0 failures, every answer correct")
    return r


__all__ = ["FaultPlan", "gossip_loss", "kill_forward_target", "latency", "partition_halves",
           "restart_new_incarnation", "slow_node", "sum_metric", "tally"]
