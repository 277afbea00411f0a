"""The faults: each injects one failure into a running keyed cluster and measures what it cost.

Every fault sends real completions and checks the paper's claim (§3) that failures cost only
time: 0 client-visible failures and every answer equal to the single-node greedy reference.
Fault-specific criteria (views converge, push-back fires, old estimates dropped) are recorded
as checks; criteria about elapsed time are marked ``timing`` (reported, not asserted in CI).

Faults use disjoint prompt groups so one fault's cache contents never steer another's routing.

Why one file over 400 lines: every fault shares the same few helpers (``tally``, metric sums,
prompt groups) and ``run_all`` orders them so each leaves the cluster healthy for the next;
kept together, the fault sequence reads top to bottom in one place.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from radixmesh.chaos.env import HOP, ChaosEnv
from radixmesh.chaos.load import Outcome, Prompt, closed_loop
from radixmesh.chaos.report import FaultResult
from radixmesh.core.auth import ClusterKey, sign
from radixmesh.core.headers import HEADER_AUTH
from radixmesh.results.summary import percentile
from radixmesh.runtime.metrics import parse_samples, sample_sum
from radixmesh.runtime.peer_auth import GOSSIP_PURPOSE, forward_purpose


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
def tally(env: ChaosEnv, r: FaultResult, outcomes: Sequence[Outcome]) -> None:
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


def _lat(outcomes: Sequence[Outcome], q: float) -> float | None:
    return percentile([o.latency_s for o in outcomes if o.ok], q)


def _share(outcomes: Sequence[Outcome], node_id: str) -> float:
    return sum(o.served_by == node_id for o in outcomes) / max(1, len(outcomes))


def _node_id(env: ChaosEnv, i: int) -> str:
    return env.cluster.nodes[i].node_id


def _sum_metric(env: ChaosEnv, prefix: str) -> float:
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
                         ) -> tuple[list[Outcome], list[Prompt]]:
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
                    who: tuple[int, int, int], base: Sequence[Outcome],
                    load: Sequence[Prompt]) -> None:
    """Send ``load`` through the entry; signal the target once a third of it has finished.

    ``who`` is (entry, target, signal).
    """
    entry, target, sig = who
    stop_after = max(1, len(load) // 3)
    fault_t: list[float] = []
    done: list[int] = []

    def on_done(i: int, _: Outcome) -> None:
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


def _latency_bound(r: FaultResult, env: ChaosEnv, base: Sequence[Outcome],
                   outs: Sequence[Outcome], t0: float, fault_t: Sequence[float]) -> None:
    if not fault_t:
        r.check(False, "the fault was injected during the load")
        return
    at = fault_t[0] - t0
    hit = [o for o in outs if o.t_start <= at <= o.t_start + o.latency_s]
    after = [o for o in outs if o.t_start > at]
    p50 = _lat(base, 50) or 0.0
    worst = max((o.latency_s for o in hit + after), default=0.0)
    # A fallback costs at most one forward timeout plus one local execution (and some noise).
    bound = env.config.forward_timeout + max(0.25, 2 * (_lat(base, 100) or 0.0))
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
    replays0 = _sum_metric(env, "radixmesh_peer_auth_rejected_replayed")
    dropped0 = _sum_metric(env, "radixmesh_netem_dropped_loss")
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
        "gossip_dropped": _sum_metric(env, "radixmesh_netem_dropped_loss") - dropped0,
        "duplicates_refused_as_replays": _sum_metric(
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


Case = tuple[str, str, bytes, dict[str, str], int]  # what, path, body, headers, expected status


def hostile_peer_messages(env: ChaosEnv) -> FaultResult:
    """Unauthenticated, forged, tampered, stale and replayed peer messages: all refused."""
    r = FaultResult("hostile peer messages (no auth, wrong key, tampered, stale, replayed)")
    if not env.key:
        r.check(False, "the cluster runs without a key: nothing to test")
        return r
    cases = _hostile_cases(ClusterKey.from_text(env.key), time.time())
    rejected0 = _sum_metric(env, "radixmesh_peer_auth_rejected_total")
    _post_cases(env.url(0), r, cases)
    rejected = _sum_metric(env, "radixmesh_peer_auth_rejected_total") - rejected0
    expected_rejections = sum(1 for c in cases if c[4] in (401, 403))
    r.figures["rejections_counted"] = rejected
    r.check(rejected == expected_rejections,
            f"every refusal counted in /metrics ({rejected:g} of {expected_rejections})")
    t = env.wait_converged(env.delta_poll * 20)
    r.check(t is not None, "the mesh kept converging")
    r.note(f"{expected_rejections} hostile messages refused and counted; genuine accepted once")
    return r


def _hostile_cases(key: ClusterKey, now: float) -> list[Case]:
    """Every hostile message, in order (the genuine one just before its replays)."""
    wrong = ClusterKey.from_text("not-the-cluster-key-at-all")
    body = b"\x93\x01\x01\xc0"  # authentic-looking bytes; the codec rejects them after auth
    n = [0]

    def nonce() -> bytes:
        n[0] += 1
        return n[0].to_bytes(16, "big")

    good = sign(key, GOSSIP_PURPOSE, "attacker", body, now, nonce())
    fwd_body = b'{"prompt_ids":[1,2,3],"sampling":{"max_tokens":1}}'
    return [
        ("gossip, no header", "/peer/gossip", body, {}, 401),
        ("gossip, garbage header", "/peer/gossip", body, {HEADER_AUTH: "v1;x"}, 401),
        ("gossip, wrong key", "/peer/gossip", body,
         {HEADER_AUTH: sign(wrong, GOSSIP_PURPOSE, "a", body, now, nonce())}, 403),
        ("gossip, tampered body", "/peer/gossip", body + b"\x00",
         {HEADER_AUTH: sign(key, GOSSIP_PURPOSE, "a", body, now, nonce())}, 403),
        ("gossip, stale (2 min old)", "/peer/gossip", body,
         {HEADER_AUTH: sign(key, GOSSIP_PURPOSE, "a", body, now - 120, nonce())}, 403),
        ("gossip, genuine", "/peer/gossip", body, {HEADER_AUTH: good}, 204),
        ("gossip, replayed", "/peer/gossip", body, {HEADER_AUTH: good}, 403),
        ("gossip body replayed to /peer/forward", "/peer/forward", body,
         {HEADER_AUTH: good}, 403),
        ("forward, no header", "/peer/forward", fwd_body, {}, 401),
        ("forward, wrong key", "/peer/forward", fwd_body, {HEADER_AUTH: sign(
            wrong, forward_purpose("/peer/forward"), "a", fwd_body, now, nonce())}, 403),
        ("link, no header", "/peer/link", b"", {}, 401),
        ("link, wrong key", "/peer/link", b"", {HEADER_AUTH: sign(
            wrong, forward_purpose("/peer/link"), "a", b"", now, nonce())}, 403),
        ("forward's token replayed to /peer/link", "/peer/link", b"", {HEADER_AUTH: sign(
            key, forward_purpose("/peer/forward"), "a", b"", now, nonce())}, 403),
    ]


def _post_cases(url: str, r: FaultResult, cases: Sequence[Case]) -> None:
    """POST each case to ``url``; a status other than the expected one is a failure."""
    with httpx.Client(timeout=10.0, trust_env=False) as client:
        for what, path, data, headers, expect in cases:
            status = client.post(url + path, content=data, headers=headers).status_code
            r.requests += 1
            r.failures += status != expect
            r.check(status == expect, f"{what}: HTTP {status} (expected {expect})")


def wrong_key_node(env: ChaosEnv, plan: FaultPlan) -> FaultResult:
    """A second 3-node cluster in which n2 was given another cluster key (misconfiguration).

    n0 and n1 must form a mesh and never admit n2; n2's gossip is refused (unknown key) and
    counted; every node still answers its own clients; nothing is forwarded to n2.
    """
    import os

    from radixmesh.runtime.cluster import LocalCluster

    r = FaultResult("node configured with the wrong cluster key")
    cfg = env.config
    child_env = dict(os.environ, RADIXMESH_CLUSTER_KEY=env.key or "k" * 32)
    cluster = LocalCluster(3, cfg.options(), env=child_env,
                           per_node={2: {"cluster_key": "a-different-cluster-key-xxxxxxxx"}})
    try:
        cluster.start(wait=False)
        r.check(_wait_pair(cluster, 0, 1, 120.0), "n0 and n1 formed a mesh")
        time.sleep(10 * cfg.gossip_interval)  # plenty of rounds for n2 to try
        for i in (0, 1):
            seen = {p["node_id"]: p["state"] for p in cluster.mesh(i)["peers"]}
            r.check(seen.get("n2") != "alive", f"n{i} never admitted n2 ({seen.get('n2')})")
        refused = _metric_sum(cluster, (0, 1), "radixmesh_peer_auth_rejected_unknown_key_total")
        refused_by_n2 = _metric_sum(cluster, (2,), "radixmesh_peer_auth_rejected_unknown_key_total")
        r.figures.update({"refused_by_n0_n1": refused, "refused_by_n2": refused_by_n2})
        r.check(refused > 0 and refused_by_n2 > 0, "both sides refused and counted the other's "
                f"gossip ({refused:g} at n0+n1, {refused_by_n2:g} at n2)")
        prompts = env.groups[7][:max(6, plan.requests // 2)]
        env.references(prompts)
        outs = asyncio.run(closed_loop(lambda i: cluster.url(i % 3), prompts, env.model, 2))
        tally(env, r, outs)
        r.check(not any(o.served_by == "n2" and o.route == "forwarded" for o in outs),
                "nothing was forwarded to n2")
        r.check(r.failures == 0 and r.lost == 0, "every node still served its own clients")
        r.note(f"n2 isolated: {refused:g} of its messages refused by n0/n1, {refused_by_n2:g} "
               "of theirs by n2; all clients served")
    finally:
        cluster.stop()
    return r


def side_channel_probe(env: ChaosEnv, rounds: int = 5) -> FaultResult:
    """Measure the prefix-cache side channel a client sees (see docs/security.md).

    A "victim" sends a prompt with a secret 2,000-character prefix to n0. An "attacker" at n1
    then sends guesses: the right prefix, or a wrong one of equal length, each with a fresh
    question. What distinguishes them: latency, ``usage.prompt_tokens_details.cached_tokens``
    and which node served it (routing follows the cached prefix to n0).
    """
    import random as _random

    r = FaultResult("prefix-cache side channel (measurement, not a fault)")
    rng = _random.Random(env.config.seed + 99)

    def text(n: int) -> str:
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz     ") for _ in range(n))

    secret = "Confidential memo: " + text(2000)
    victim = Prompt("victim", secret + " Question: " + text(40), env.config.max_tokens)
    v = env.send(lambda _: env.url(0), [victim], 1)
    time.sleep(3 * env.delta_poll)
    env.wait_view(1, 0)
    guesses: list[Prompt] = []
    for k in range(rounds):
        q = " Question: " + text(40)
        guesses.append(Prompt(f"right{k}", secret + q, env.config.max_tokens))
        guesses.append(Prompt(f"wrong{k}", "Confidential memo: " + text(2000) + q,
                              env.config.max_tokens))
    outs = env.send(lambda _: env.url(1), guesses, 1)
    r.requests = len(v) + len(outs)
    r.failures = sum(not o.ok for o in (*v, *outs))
    _side_channel_figures(r, outs)
    r.check(r.failures == 0, "0 failures")
    return r


def _side_channel_figures(r: FaultResult, outs: Sequence[Outcome]) -> None:
    """What tells a right guess from a wrong one: latency, cached tokens, serving node."""
    right = [o for o in outs if o.id.startswith("right")]
    wrong = [o for o in outs if o.id.startswith("wrong")]
    fig = {
        "latency_p50_right_s": _lat(right, 50), "latency_p50_wrong_s": _lat(wrong, 50),
        "cached_tokens_right": [o.cached_tokens for o in right],
        "cached_tokens_wrong": [o.cached_tokens for o in wrong],
        "served_by_right": dict(Counter(o.served_by for o in right)),
        "served_by_wrong": dict(Counter(o.served_by for o in wrong)),
    }
    r.figures.update(fig)
    c_right = min((o.cached_tokens or 0) for o in right) if right else 0
    c_wrong = max((o.cached_tokens or 0) for o in wrong) if wrong else 0
    r.note(f"right guess: {c_right}+ cached tokens, p50 {fig['latency_p50_right_s'] or 0:.3f}s,"
           f" served by {fig['served_by_right']}; wrong guess: <= {c_wrong} cached tokens, p50 "
           f"{fig['latency_p50_wrong_s'] or 0:.3f}s, served by {fig['served_by_wrong']}")


def _wait_pair(cluster: Any, a: int, b: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    ids = {a: cluster.nodes[a].node_id, b: cluster.nodes[b].node_id}
    while time.monotonic() < deadline:
        try:
            ok = all(
                any(p["node_id"] == ids[y] and p["state"] == "alive"
                    for p in cluster.mesh(x)["peers"])
                for x, y in ((a, b), (b, a)))
        except (httpx.HTTPError, ValueError):
            ok = False
        if ok:
            return True
        time.sleep(0.2)
    return False


def _metric_sum(cluster: Any, nodes: Sequence[int], name: str) -> float:
    return sum(sample_sum(parse_samples(cluster.get(i, "/metrics").text), name) for i in nodes)


# ------------------------------------------------------------------------------- suite
FaultFn = Callable[[ChaosEnv, FaultPlan], list[FaultResult]]


def run_all(env: ChaosEnv, plan: FaultPlan, only: Sequence[str] = ()) -> list[FaultResult]:
    """Every fault, in an order where each leaves the cluster healthy for the next."""
    want_wrong_key = plan.wrong_key or "wrongkey" in only
    want_side = plan.wrong_key or "sidechannel" in only  # full runs only (a measurement)
    steps: list[tuple[str, Callable[[], list[FaultResult]]]] = [
        ("auth", lambda: [hostile_peer_messages(env)]),
        ("kill", lambda: [kill_forward_target(env, plan),
                          restart_new_incarnation(env, plan, target=1)]),
        ("hang", lambda: [kill_forward_target(env, plan, signal.SIGSTOP)]),
        ("stream", lambda: [kill_forward_target(env, plan, stream=True)]),
        ("loss", lambda: [gossip_loss(env, plan, loss, (2 + k,))
                          for k, loss in enumerate(plan.loss_levels)]),
        ("partition", lambda: [partition_halves(env, plan, (10, 11))]),
        ("slow", lambda: [slow_node(env, plan, (8, 9))]),
        ("sidechannel", lambda: [side_channel_probe(env)] if want_side else []),
        ("wrongkey", lambda: [wrong_key_node(env, plan)] if want_wrong_key else []),
    ]
    results: list[FaultResult] = []
    for name, step in steps:
        if only and name not in only:
            continue
        try:
            results.extend(step())
        except Exception as exc:  # report the broken fault, keep going with the others
            r = FaultResult(name)
            r.check(False, f"fault run crashed: {type(exc).__name__}: {exc}")
            results.append(r)
            _recover(env)
    return results


def _recover(env: ChaosEnv) -> None:
    """Best effort: every node running, no partitions, no netem, no engine delay."""
    for n in env.cluster.nodes:
        if n.process is not None and not n.running:
            env.cluster.restart(n.index, wait=False)
        elif n.running:
            env.cluster.kill(n.index, signal.SIGCONT)
    try:
        env.cluster.wait_ready(120)
        env.cluster.heal()
        env.set_netem(loss=0.0, duplicate=0.0, jitter=0.0)
        for n in env.cluster.nodes:
            env.admin(n.index, "/admin/engine-delay", {"seconds": 0.0})
    except Exception:
        pass


__all__ = ["HOP", "FaultPlan", "run_all"]
