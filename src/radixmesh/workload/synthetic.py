"""A synthetic MMLU-shaped workload, for machines without the dataset.

Shape (measured on MMLU, GUIDE §5): 57 groups ("subjects") with MMLU's per-subject test sizes
(100–1,534, median 173, 14,042 in all); each prompt is the MMLU header, 5 worked examples
(the group's shared prefix) and one question ending ``"Answer:"``. Lengths are drawn so the
shared prefix is ≈ 85% of all prompt characters (MMLU: 84.6%, prompt mean 3,024 chars).
``scale`` multiplies every length (0.25 gives ~750-char prompts for slow CPU engines).
Text is seeded pseudo-words, so two groups never share more than the header.
Deterministic: the same ``seed`` and ``scale`` give byte-identical prompts.
"""

from __future__ import annotations

import math
import random

from radixmesh.workload.mmlu import CHOICES, Question, Subject, subject_requests
from radixmesh.workload.request import Request

# Test questions per MMLU subject (alphabetical subject order of the release).
MMLU_GROUP_SIZES: tuple[int, ...] = (
    100, 135, 152, 100, 265, 144, 100, 100, 100, 173, 102, 100, 235, 114, 145, 378, 126, 100,
    310, 203, 100, 165, 198, 193, 390, 270, 238, 151, 545, 216, 204, 237, 223, 131, 121, 108,
    163, 112, 103, 234, 100, 783, 346, 895, 306, 311, 324, 282, 1534, 272, 612, 110, 245, 201,
    100, 166, 171,
)  # fmt: skip

EXAMPLE_CHARS_MEAN = 480.0  # one worked example (5 per prefix, + ~75-char header ≈ 2,557)
QUESTION_CHARS_MEAN = 420.0  # the test question with its choices
GROUP_SIGMA = 0.45  # log-normal spread of a group's typical lengths (MMLU varies a lot)
ITEM_SIGMA = 0.35  # spread of single items around their group's typical length

_SYLLABLES = tuple(c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou")


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


def words(rng: random.Random, n_chars: int) -> str:
    """Seeded pseudo-words (syllables of the synthetic alphabet), about ``n_chars`` long."""
    out: list[str] = []
    size = 0
    while size < n_chars:
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


def _question(rng: random.Random, n_chars: int) -> Question:
    stem = max(8, int(n_chars * 0.6))
    choice = max(2, int(n_chars * 0.1) - 4)
    choices = tuple(words(rng, choice) for _ in CHOICES)
    return Question(
        words(rng, stem) + "?",
        (choices[0], choices[1], choices[2], choices[3]),
        rng.choice(CHOICES),
    )


def synthetic_subject(index: int, size: int, seed: int, scale: float = 1.0) -> Subject:
    rng = random.Random(f"radixmesh-synthetic/{seed}/{index}")
    ex_mean = _lognormal(rng, EXAMPLE_CHARS_MEAN * scale, GROUP_SIGMA)
    q_mean = _lognormal(rng, QUESTION_CHARS_MEAN * scale, GROUP_SIGMA)
    dev = tuple(_question(rng, int(_lognormal(rng, ex_mean, ITEM_SIGMA))) for _ in range(5))
    test = tuple(_question(rng, int(_lognormal(rng, q_mean, ITEM_SIGMA))) for _ in range(size))
    return Subject(f"topic_{index:02d}", dev, test)


def synthetic_groups(
    seed: int = 0, scale: float = 1.0, groups: int = 57, max_per_group: int | None = None
) -> dict[str, list[Request]]:
    """``groups`` groups with MMLU's sizes (cycled if more than 57), capped at ``max_per_group``."""
    if scale <= 0:
        raise ValueError("scale must be > 0")
    if groups < 1:
        raise ValueError("groups must be >= 1")
    out: dict[str, list[Request]] = {}
    for i in range(groups):
        size = MMLU_GROUP_SIZES[i % len(MMLU_GROUP_SIZES)]
        if max_per_group is not None:
            size = min(size, max_per_group)
        subject = synthetic_subject(i, size, seed, scale)
        out[subject.name] = subject_requests(subject)
    return out
