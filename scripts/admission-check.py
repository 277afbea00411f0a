"""Prefix-aware ("pioneers first") vs FCFS admission on one burst of shared-prefix requests.

N requests sharing a P-token prefix (each with its own S-token suffix) arrive together at a cold
engine; the scheduler (core/scheduler.py) runs them to completion on a virtual clock, each step
lasting ``Profile.step_s(step)`` of a shipped step-time profile (core/profile.py). Prints, for
each admission policy and step budget: prompt tokens computed, tokens reused from the cache,
steps, and mean / max time to first token. A benchmark that prints; it asserts nothing.

    PYTHONPATH=src python scripts/admission-check.py [--profile h100-llama3-8b] [-n 8]
"""

from __future__ import annotations

import argparse

from radixmesh.core.profile import Profile, resolve
from radixmesh.core.scheduler import Scheduler


def run(profile: Profile, aware: bool, step_tokens: int, args: argparse.Namespace) -> str:
    sched = Scheduler(profile.scheduler_config(prefix_aware=aware, step_tokens=step_tokens))
    prefix = list(range(args.prefix))
    for i in range(args.n):
        suffix = [50_000 + i * args.suffix + j for j in range(args.suffix)]
        sched.add(i, prefix + suffix, args.max_tokens, 0.0)
    now, ttft = 0.0, []
    for _ in range(100_000):
        step = sched.schedule(now)
        if step.empty:
            break
        now += profile.step_s(step)
        for f in sched.complete(step, dict.fromkeys(step.emitting, 1), now):
            assert f.first_token_at is not None
            ttft.append(f.first_token_at)
    name = "prefix-aware" if aware else "FCFS"
    return (
        f"{name:>12} {step_tokens:>7} {sched.prefill_tokens_computed:>9} "
        f"{sched.cached_tokens_hit:>7} {sched.steps:>5} "
        f"{1000 * sum(ttft) / len(ttft):>12.1f} {1000 * max(ttft):>11.1f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="h100-llama3-8b", help="shipped name or TOML file")
    ap.add_argument("-n", type=int, default=8, help="requests in the burst")
    ap.add_argument("--prefix", type=int, default=2000, help="shared prefix tokens")
    ap.add_argument("--suffix", type=int, default=32, help="own suffix tokens per request")
    ap.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    args = ap.parse_args()
    profile = resolve(args.profile)
    print(f"{args.n} x ({args.prefix} shared + {args.suffix} own) tokens, profile {profile.name}")
    print(
        f"{'policy':>12} {'budget':>7} {'computed':>9} {'reused':>7} {'steps':>5} "
        f"{'mean TTFT ms':>12} {'max TTFT ms':>11}"
    )
    for step_tokens in (profile.step_tokens, 4 * profile.step_tokens):
        for aware in (True, False):
            print(run(profile, aware, step_tokens, args))


if __name__ == "__main__":
    main()
