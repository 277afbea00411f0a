"""Retrieval-augmented generation: a few dozen long documents, Zipf popularity, short questions.

The corpus holds ``DOCUMENTS`` documents (32 by default, each ~2,600 characters at scale 1, a
title and body from the corpus text). Each request retrieves one of them, drawn with Zipf
popularity (exponent 1.1 over a seeded ranking: the top document gets ~22 % of the requests
with 32 documents, the last ~0.5 %), and asks a short question (~120 characters) about it::

    <instruction header> Document 7: <title>\\n<body>\\n\\nQuestion: <question>?\\nAnswer:

The header plus the document is the shared prefix (``prefix_chars``); it is what a router
should keep on few nodes — the popular documents on more than one.
"""

from __future__ import annotations

import random

from radixmesh.workload.corpus import Corpus
from radixmesh.workload.generated import lognormal_chars
from radixmesh.workload.request import Request

HEADER = (
    "Answer the question using only the document below. If the document does not contain the "
    "answer, say that you do not know.\n\n"
)
DOCUMENTS = 32
DOC_CHARS = 2600.0
DOC_MAX = 3300.0  # longer draws are cut here (prompts stay inside a 4,096-token context)
QUESTION_CHARS = 120.0
ZIPF_S = 1.1
MAX_TOKENS = 4


def zipf_weights(n: int, s: float = ZIPF_S) -> list[float]:
    """Normalized Zipf weights of ranks 1..n."""
    w = [1.0 / (k**s) for k in range(1, n + 1)]
    total = sum(w)
    return [x / total for x in w]


def documents(seed: int, corpus: Corpus, scale: float, count: int = DOCUMENTS) -> list[str]:
    """The ``count`` documents, each ``Document i: title`` + body."""
    out = []
    for i in range(count):
        rng = random.Random(f"radixmesh-rag/{seed}/doc/{i}")
        size = min(lognormal_chars(rng, DOC_CHARS * scale, 0.25), int(DOC_MAX * scale))
        body = corpus.text(rng, size)
        out.append(f"Document {i}: {corpus.title(rng)}\n{body}")
    return out


def requests(
    n: int, seed: int, corpus: Corpus, scale: float = 1.0, count: int = DOCUMENTS
) -> list[Request]:
    docs = documents(seed, corpus, scale, count)
    rng = random.Random(f"radixmesh-rag/{seed}")
    ranking = list(range(count))
    rng.shuffle(ranking)  # rank r is document ranking[r]
    picks = rng.choices(ranking, weights=zipf_weights(count), k=n)
    out = []
    for i, d in enumerate(picks):
        prefix = HEADER + docs[d] + "\n\nQuestion: "
        question = corpus.text(rng, lognormal_chars(rng, QUESTION_CHARS * scale))
        out.append(Request(
            id=f"rag/{i}", prompt=f"{prefix}{question}?\nAnswer:", max_tokens=MAX_TOKENS,
            group=f"doc/{d:02d}", prefix_chars=len(prefix),
        ))  # fmt: skip
    return out
