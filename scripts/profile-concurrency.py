"""A profile on the batching scheduler at fixed concurrency: TTFT and ITL as a benchmark would see.

``c`` closed-loop clients each send a request of ``--input`` distinct (uncached) prompt tokens and
``--output`` output tokens on average (uniform in 0.5-1.5x, seeded: equal lengths would keep the
clients in lockstep, every prefill arriving in the same step), and the next as soon as it
finishes. The scheduler
(core/scheduler.py) runs them on a virtual clock, each step lasting ``Profile.step_s(step)``.
Prints the median time to first token, inter-token gap and time per output token at each
concurrency, beside the published figures given with ``--published``. The unfitted points (high
concurrency) test the form: a profile is fitted to single-stream and light-load figures, the
scheduler supplies the mixing of prefill chunks into decode steps. A benchmark that prints; it
asserts nothing.

    PYTHONPATH=src python scripts/profile-concurrency.py --profile a10g-llama3-8b \\
        --input 550 --output 150 --published "1:137:30.7,4:171:33.9,16:303:42.7,64:1080:61.7"
"""

from __future__ import annotations

import argparse
import random
import statistics

from radixmesh.core.profile import Profile, resolve
from radixmesh.core.scheduler import Scheduler


def run(profile: Profile, clients: int, args: argparse.Namespace) -> tuple[float, float, float]:
    """Medians of TTFT, inter-token gap and TPOT (a request's (end - first token) / (outputs - 1),
    as vLLM's benchmark reports it) over the requests after the first round, in seconds."""
    sched = Scheduler(profile.scheduler_config())
    arrived: dict[int, float] = {}
    last_token: dict[int, float] = {}
    ttfts: list[float] = []
    gaps: list[float] = []
    tpots: list[float] = []
    next_id = 0
    rng = random.Random(args.seed)

    def submit(now: float) -> None:
        nonlocal next_id
        base = 100_000 + next_id * args.input
        out = rng.randint(args.output // 2, args.output * 3 // 2)
        sched.add(next_id, list(range(base, base + args.input)), max(1, out), now)
        arrived[next_id] = now
        next_id += 1

    for _ in range(clients):
        submit(0.0)
    now, total = 0.0, clients * (args.rounds + 1)
    for _ in range(1_000_000):
        step = sched.schedule(now)
        if step.empty:
            break
        now += profile.step_s(step)
        warm = next_id > clients  # skip the first round's cold burst
        for seq in step.emitting:
            if seq in last_token and warm:
                gaps.append(now - last_token[seq])
            elif seq not in last_token and warm and seq >= clients:
                ttfts.append(now - arrived[seq])
            last_token[seq] = now
        for f in sched.complete(step, dict.fromkeys(step.emitting, 1), now):
            last_token.pop(f.seq, None)
            if f.seq >= clients and len(f.output) > 1 and f.first_token_at is not None:
                tpots.append((now - f.first_token_at) / (len(f.output) - 1))
            if next_id < total:
                submit(now)
    return statistics.median(ttfts), statistics.median(gaps), statistics.median(tpots)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="a10g-llama3-8b", help="shipped name or TOML file")
    ap.add_argument("--input", type=int, default=550, help="prompt tokens per request")
    ap.add_argument("--output", type=int, default=150, help="output tokens per request")
    ap.add_argument("--concurrency", default="1,4,16,64", help="clients, comma-separated")
    ap.add_argument("--rounds", type=int, default=4, help="requests per client after the first")
    ap.add_argument("--seed", type=int, default=0, help="output-length seed")
    ap.add_argument("--published", default="", help="c:TTFT_ms:ITL_or_TPOT_ms,... to print beside")
    args = ap.parse_args()
    profile = resolve(args.profile)
    published = {}
    for item in filter(None, args.published.split(",")):
        c, ttft, itl = item.split(":")
        published[int(c)] = (float(ttft), float(itl))
    print(f"profile {profile.name}: {args.input} in / {args.output} out, closed loop")
    head = ("clients", "TTFT ms", "published", "ITL ms", "TPOT ms", "published")
    print(" ".join(f"{h:>9}" for h in head))
    for clients in (int(c) for c in args.concurrency.split(",")):
        ttft, itl, tpot = run(profile, clients, args)
        pub_ttft, pub_itl = published.get(clients, (float("nan"), float("nan")))
        row = (ttft * 1e3, pub_ttft, itl * 1e3, tpot * 1e3, pub_itl)
        print(f"{clients:>9} " + " ".join(f"{v:>9.2f}" for v in row))


if __name__ == "__main__":
    main()
