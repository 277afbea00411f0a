"""``radixmesh profile``: list the shipped step-time profiles, or show what one predicts.

``radixmesh profile list`` names each shipped profile with its hardware and model;
``radixmesh profile show NAME|FILE`` prints the coefficients, the predicted time to first token
of a 1k / 4k / 8k-token prompt served alone, the time per output token at batch 1 / 16 / 64
(each sequence attending to ``--context`` KV tokens), and every published figure the profile
cites beside its prediction. Predictions are the profile's formula
(:mod:`radixmesh.core.profile`), without queueing: a running engine adds its own.
"""

from __future__ import annotations

import argparse
import sys

from radixmesh.core.profile import COEFFICIENTS, Profile, resolve, shipped

PROMPTS = (1024, 4096, 8192)
BATCHES = (1, 16, 64)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="the shipped profiles")
    show = sub.add_parser("show", help="one profile's coefficients and predictions")
    show.add_argument("spec", metavar="NAME|FILE", help="a shipped profile or a TOML file")
    show.add_argument(
        "--context",
        type=int,
        default=1024,
        help="KV tokens each decoding sequence attends to, for the TPOT lines (default 1024)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "list":
            for name in shipped():
                prof = resolve(name)
                mark = " (derived)" if prof.derived else ""
                print(f"{name:<20} {prof.hardware}; {prof.model}{mark}")
            return 0
        if args.context < 0:
            raise ValueError("--context must be >= 0")
        print(show(resolve(args.spec), args.context))
    except ValueError as exc:
        print(f"radixmesh profile: {exc}", file=sys.stderr)
        return 2
    return 0


def show(prof: Profile, context: int) -> str:
    """The report ``radixmesh profile show`` prints."""
    lines = [
        f"{prof.name}: {prof.model} on {prof.hardware}" + (" (derived)" if prof.derived else ""),
        f"  source: {prof.source}",
        f"  KV {prof.kv_blocks:,} blocks x {prof.block_size} tokens = "
        f"{prof.kv_blocks * prof.block_size:,} tokens; context {prof.context_length:,}; "
        f"max running {prof.max_running}; step tokens {prof.step_tokens:,}",
        "  coefficients:",
    ]
    lines += [f"    {name:<16} {getattr(prof, name):.4g} s" for name in COEFFICIENTS]
    ttfts = [
        f"{n // 1024}k {prof.ttft_s(n) * 1e3:,.1f} ms" for n in PROMPTS if n <= prof.context_length
    ]
    lines.append("  predicted TTFT (alone): " + ", ".join(ttfts))
    batches = [b for b in BATCHES if b <= prof.max_running]  # more cannot run at once
    tpots = [f"batch {b} {prof.tpot_s(b, context) * 1e3:,.2f} ms" for b in batches]
    lines.append(f"  predicted TPOT (context {context:,}): " + ", ".join(tpots))
    if prof.checks:
        lines.append("  published figures:")
    for check in prof.checks:
        predicted = prof.predicted_s(check)
        error = predicted / check.published_s - 1
        verdict = "ok" if abs(error) <= check.tolerance else "OUTSIDE"
        lines.append(
            f"    {check.metric} batch={check.batch} context={check.context} "
            f"tokens={check.tokens}: published {check.published_s * 1e3:.2f} ms, predicted "
            f"{predicted * 1e3:.2f} ms ({error:+.1%}, tolerance {check.tolerance:.0%}: {verdict})"
        )
        lines.append(f"      {check.source}")
    return "\n".join(lines)
