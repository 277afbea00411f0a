"""The chaos suite: every fault, in an order where each leaves the cluster healthy for the next.

Theory of operation
-------------------
``run_all`` runs the faults of :mod:`radixmesh.chaos.faults` and
:mod:`radixmesh.chaos.attacks` by name (``--only`` keeps some; the wrong-key cluster and the
side-channel measurement only in full runs or when named). A fault that crashes is reported as
a failed check and the cluster is put back as well as possible (every node running, no
partition, no emulated loss, no engine delay) before the next one.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Sequence

from radixmesh.chaos.attacks import hostile_peer_messages, side_channel_probe, wrong_key_node
from radixmesh.chaos.env import ChaosEnv
from radixmesh.chaos.faults import (
    FaultPlan,
    gossip_loss,
    kill_forward_target,
    partition_halves,
    restart_new_incarnation,
    slow_node,
)
from radixmesh.chaos.report import FaultResult

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
