"""Text for generated workloads: MMLU's own sentences when a copy is at hand, else seeded words.

The routing-issue workloads (chat, RAG, agentic, hot few-shot prefix) need realistic filler —
documents, user turns, tool observations. :class:`Corpus` draws runs of consecutive passages
from a pool: the MMLU questions and answer choices (``Corpus.from_mmlu``, English text of
realistic word and sentence lengths) or, without the dataset, the seeded pseudo-words of the
synthetic MMLU generator (``Corpus.words``). Every draw takes a ``random.Random`` so the
generators stay deterministic by seed; the pool itself holds no randomness.
"""

from __future__ import annotations

import random
from pathlib import Path

from radixmesh.workload import mmlu
from radixmesh.workload.synthetic import words


class Corpus:
    """A pool of text passages; :meth:`text` cuts ``n`` characters out of consecutive ones."""

    def __init__(
        self, passages: list[str] | None, name: str, subjects: list[mmlu.Subject] | None = None
    ) -> None:
        self.passages = [p.strip() for p in passages or [] if p.strip()]
        self.name = name
        self.subjects = subjects or []  # MMLU subjects, when the pool came from MMLU

    @classmethod
    def from_mmlu(cls, directory: str | Path) -> Corpus:
        """MMLU's test questions with their choices, one passage each, in file order."""
        subjects = mmlu.load_subjects(directory)
        passages = [" ".join((q.text, *q.choices)).replace("\n", " ")
                    for s in subjects for q in s.test]  # fmt: skip
        return cls(passages, "mmlu", subjects)

    @classmethod
    def words(cls) -> Corpus:
        """No dataset: seeded pseudo-words (the synthetic MMLU generator's syllables)."""
        return cls(None, "words")

    @classmethod
    def for_dir(cls, mmlu_dir: str | None) -> Corpus:
        return cls.from_mmlu(mmlu_dir) if mmlu_dir else cls.words()

    def text(self, rng: random.Random, n_chars: int) -> str:
        """About ``n_chars`` characters (cut at a word boundary, at least one word)."""
        n_chars = max(1, n_chars)
        if not self.passages:
            return words(rng, n_chars)
        i = rng.randrange(len(self.passages))
        parts: list[str] = []
        size = 0
        while size < n_chars:
            p = self.passages[i % len(self.passages)]
            parts.append(p)
            size += len(p) + 1
            i += 1
        out = " ".join(parts)
        if len(out) <= n_chars:
            return out
        cut = out.rfind(" ", 0, n_chars + 1)
        return out[: cut if cut > 0 else n_chars]

    def title(self, rng: random.Random, n_words: int = 4) -> str:
        """A short capitalized title (``n_words`` words of a random passage)."""
        picked = self.text(rng, 12 * n_words).split()[:n_words]
        return " ".join(w.strip(".,;:?!()\"'").capitalize() for w in picked) or "Untitled"
