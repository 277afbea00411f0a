"""The faults of an adversary, against a running keyed cluster (see docs/security.md).

Theory of operation
-------------------
``hostile_peer_messages`` posts unauthenticated, forged, tampered, stale and replayed peer
messages to a node (gossip, forward and link endpoints) and checks each is refused with the
expected status and counted in /metrics, while the mesh keeps converging. ``wrong_key_node``
starts a second cluster in which one node was given another cluster key: the other two must
never admit it, both sides count the refusals, and every node still serves its own clients.
``side_channel_probe`` is a measurement, not a fault: what a client at another node learns of
a secret prefix cached for someone else (latency, cached tokens, serving node).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import httpx

from radixmesh.chaos.env import ChaosEnv
from radixmesh.chaos.faults import FaultPlan, latency, sum_metric, tally
from radixmesh.chaos.load import ClientOutcome, Prompt, closed_loop
from radixmesh.chaos.report import FaultResult
from radixmesh.core.auth import ClusterKey, sign
from radixmesh.core.headers import HEADER_AUTH
from radixmesh.runtime.metrics import parse_samples, sample_sum
from radixmesh.runtime.peer_auth import GOSSIP_PURPOSE, forward_purpose

Case = tuple[str, str, bytes, dict[str, str], int]  # what, path, body, headers, expected status


def hostile_peer_messages(env: ChaosEnv) -> FaultResult:
    """Unauthenticated, forged, tampered, stale and replayed peer messages: all refused."""
    r = FaultResult("hostile peer messages (no auth, wrong key, tampered, stale, replayed)")
    if not env.key:
        r.check(False, "the cluster runs without a key: nothing to test")
        return r
    cases = _hostile_cases(ClusterKey.from_text(env.key), time.time())
    rejected0 = sum_metric(env, "radixmesh_peer_auth_rejected_total")
    _post_cases(env.url(0), r, cases)
    rejected = sum_metric(env, "radixmesh_peer_auth_rejected_total") - rejected0
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


def _side_channel_figures(r: FaultResult, outs: Sequence[ClientOutcome]) -> None:
    """What tells a right guess from a wrong one: latency, cached tokens, serving node."""
    right = [o for o in outs if o.id.startswith("right")]
    wrong = [o for o in outs if o.id.startswith("wrong")]
    fig = {
        "latency_p50_right_s": latency(right, 50), "latency_p50_wrong_s": latency(wrong, 50),
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
