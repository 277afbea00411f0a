"""A single hot few-shot prefix: every request behind the same 5-shot context.

One few-shot prefix (an MMLU-style header and five worked examples) and a different question
per request. With an MMLU corpus the prefix is a real subject's (the one whose prefix length is
closest to ``PREFIX_CHARS × scale``; ties by seed) and the questions are drawn from every
subject's test split; without one, a synthetic subject at ``scale``. All traffic shares one
prefix, so one node holding it becomes the bottleneck under load: the workload measures whether
a router replicates a hot prefix (on as many nodes as its load needs) or piles onto one node.
"""

from __future__ import annotations

import random

from radixmesh.workload.corpus import Corpus
from radixmesh.workload.mmlu import Question, Subject, format_question
from radixmesh.workload.request import Request
from radixmesh.workload.synthetic import synthetic_subject

PREFIX_CHARS = 2550.0  # MMLU's mean few-shot prefix (header + 5 shots)
MAX_TOKENS = 1


def hot_subject(seed: int, corpus: Corpus, scale: float, n: int) -> tuple[Subject, list[Question]]:
    """The prefix's subject and a pool of at least ``min(n, available)`` questions."""
    rng = random.Random(f"radixmesh-hot/{seed}")
    target = PREFIX_CHARS * scale
    if not corpus.subjects:  # the synthetic subject (of 8 seeded ones) closest to the target
        made = [synthetic_subject(1000 + k, max(n, 1), seed, scale) for k in range(8)]
        s = min(made, key=lambda s: abs(len(s.prefix) - target))
        return s, list(s.test)
    ranked = sorted(corpus.subjects, key=lambda s: (abs(len(s.prefix) - target), s.name))
    subject = rng.choice(ranked[:3])
    pool = [q for s in corpus.subjects for q in s.test]
    rng.shuffle(pool)
    return subject, pool


def requests(n: int, seed: int, corpus: Corpus, scale: float = 1.0) -> list[Request]:
    subject, pool = hot_subject(seed, corpus, scale, n)
    if not pool:
        raise ValueError("no questions for the hot-prefix workload")
    prefix = subject.prefix
    return [
        Request(id=f"hot/{i}", prompt=prefix + format_question(pool[i % len(pool)],
                with_answer=False), max_tokens=MAX_TOKENS, group="hot", prefix_chars=len(prefix))
        for i in range(n)
    ]  # fmt: skip
