"""What the generated workloads share (``workload.build.generate(kind, ...)`` builds one).

Kinds (each a ``--workload`` of ``radixmesh bench``; each seeded, deterministic by seed):

* ``chat`` (:mod:`~radixmesh.workload.chat`) — multi-turn conversations; every turn resends the
  growing history, once the previous turn was answered; conversations interleave; the entry
  node is random per request.
* ``rag`` (:mod:`~radixmesh.workload.rag`) — a few dozen long documents with Zipf popularity,
  a short question after the retrieved document.
* ``agentic`` (:mod:`~radixmesh.workload.agentic`) — one long tool-use system prompt shared by
  every request, per-task scratchpads growing step by step (each step once the last one was
  answered); tasks interleave.
* ``hotprefix`` (:mod:`~radixmesh.workload.hotprefix`) — every request behind one few-shot
  prefix (a load that exceeds one node's capacity unless the prefix is replicated).

``scale`` multiplies every generated length (1.0 ≈ 1–4k characters per prompt, sized for the
tiny engine's 4,096-token context with the byte tokenizer). Filler text comes from a
:class:`~radixmesh.workload.corpus.Corpus` (MMLU's sentences when an MMLU directory is given,
else seeded pseudo-words), so nothing here needs the dataset.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from dataclasses import replace

from radixmesh.workload.request import Request

KINDS = ("chat", "rag", "agentic", "hotprefix")
Session = Iterator[Request]


def lognormal_chars(rng: random.Random, mean: float, sigma: float = 0.35) -> int:
    """A length with the given mean (log-normal spread ``sigma``), at least 1."""
    return max(1, int(rng.lognormvariate(math.log(max(mean, 1.0)) - sigma * sigma / 2, sigma)))


def interleave(
    new_session: Callable[[int], Session], n: int, width: int, rng: random.Random
) -> list[Request]:
    """``n`` requests from sessions (conversations, agent tasks) of which ``width`` are open at
    a time: each step continues a random open session; a finished one is replaced by a new
    session (``new_session(index)``). Within a session, order is kept, and each request but
    the first waits for the one before it (``Request.after``): a user sends the next turn once
    the answer to the last one is in, an agent its next step once the tool has answered."""
    if n < 0 or width < 1:
        raise ValueError("need n >= 0 and width >= 1")
    out: list[Request] = []
    opened = 0
    open_: list[Session] = []
    last: list[str | None] = []  # the id of each open session's last request
    while len(out) < n:
        while len(open_) < width:
            open_.append(new_session(opened))
            last.append(None)
            opened += 1
        k = rng.randrange(len(open_))
        nxt = next(open_[k], None)
        if nxt is None:
            open_.pop(k)
            last.pop(k)
            continue
        out.append(replace(nxt, after=last[k]))
        last[k] = nxt.id
    return out

