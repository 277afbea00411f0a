"""Multi-turn chat: conversations that resend their growing history, interleaved.

Every conversation opens with the same short system preamble (what a chat template puts in
front of everything — a common header shorter than any conversation), then alternates user
and assistant messages. Turn k of a conversation is a chat request whose messages are the
preamble, the k-1 earlier exchanges and the new user message, so it extends the previous
turn's prompt: the earlier turns are the cacheable prefix, on whichever node served them.

The assistant messages are fixed stand-ins written by the generator (a trace of a real chat
carries the answers it got; the tiny engine's random-weight output is not worth resending), so
turn k+1 shares exactly turn k's prompt, not the tokens the engine generated after it.

Conversations interleave (``width`` open at a time, each step continues a random one) and
every request enters the cluster at a random node (seeded): consecutive turns of one
conversation usually arrive at different nodes, so a router must find the history elsewhere.
A turn waits for the answer to the one before it (``Request.after``), as its user would: the
replay sends it once that turn has finished, whatever the schedule.
A conversation has 2–10 turns and ends early when its next prompt would exceed ``max_chars``
(``MAX_CHARS``; below scale 1 the history's share of it shrinks with ``scale``).
"""

from __future__ import annotations

import random
from dataclasses import replace

from radixmesh.workload.corpus import Corpus
from radixmesh.workload.generated import Session, interleave, lognormal_chars
from radixmesh.workload.request import Message, Request

SYSTEM = (
    "You are a helpful, knowledgeable assistant. Answer the user's questions accurately and "
    "concisely, explain your reasoning when it helps, say so when you are unsure, and keep "
    "a friendly, professional tone. Use plain language; prefer short paragraphs and lists."
)
USER_CHARS = 220.0
ASSISTANT_CHARS = 380.0
MAX_CHARS = 3300  # prompt characters (byte tokens + template), inside a 4,096-token context
MIN_TURNS, MAX_TURNS = 2, 10
WIDTH = 6  # conversations open at once
MAX_TOKENS = 8


def conversation(
    index: int, seed: int, corpus: Corpus, scale: float, max_chars: int | None = None
) -> Session:
    """One conversation's turns, in order; ``max_chars`` defaults to the preamble plus
    ``MAX_CHARS`` minus the preamble, times ``scale`` (≤ 1): the history's budget scales."""
    if max_chars is None:
        max_chars = int(len(SYSTEM) + (MAX_CHARS - len(SYSTEM)) * min(scale, 1.0))
    rng = random.Random(f"radixmesh-chat/{seed}/{index}")
    turns = rng.randint(MIN_TURNS, MAX_TURNS)
    history: list[Message] = [Message("system", SYSTEM)]
    group = f"chat/{index:04d}"
    for turn in range(turns):
        user = Message("user", corpus.text(rng, lognormal_chars(rng, USER_CHARS * scale)) + "?")
        msgs = (*history, user)
        if turn > 0 and sum(len(m.content) for m in msgs) > max_chars:
            return
        shared = sum(len(m.content) for m in history)
        yield Request(
            id=f"{group}/t{turn}", messages=msgs, max_tokens=MAX_TOKENS, group=group,
            prefix_chars=shared,
        )  # fmt: skip
        answer = corpus.text(rng, lognormal_chars(rng, ASSISTANT_CHARS * scale))
        history += [user, Message("assistant", answer)]


def requests(
    n: int, seed: int, corpus: Corpus, scale: float = 1.0, nodes: int = 1
) -> list[Request]:
    """``n`` interleaved turns with seeded random entry nodes in ``range(nodes)``."""
    rng = random.Random(f"radixmesh-chat/{seed}")
    reqs = interleave(
        lambda i: conversation(i, seed, corpus, scale),
        n,
        WIDTH,
        rng,
    )
    return [replace(r, entry=rng.randrange(max(nodes, 1))) for r in reqs]
