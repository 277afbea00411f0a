"""MMLU in its original release layout, turned into the paper's few-shot workload.

Layout: ``{dev,val,test}/{subject}_{split}.csv``, no header, columns
``question,A,B,C,D,answer``. Per subject, the 5 ``dev`` rows are the few-shot prefix after
the header ``"The following are multiple choice questions (with answers) about
{subject}.\\n\\n"`` (Hendrycks et al.'s format); each ``test`` question follows, ending in
``"Answer:"``. One output token. Request ids are ``{subject}/{row}`` so the same question
has the same id in every run (outputs can be compared across policies).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from radixmesh.workload.request import Request

CHOICES = ("A", "B", "C", "D")


@dataclass(frozen=True, slots=True)
class Question:
    text: str
    choices: tuple[str, str, str, str]
    answer: str


@dataclass(frozen=True, slots=True)
class Subject:
    name: str
    dev: tuple[Question, ...]
    test: tuple[Question, ...]

    @property
    def prefix(self) -> str:
        return header(self.name) + "".join(format_question(q, with_answer=True) for q in self.dev)


def header(subject: str) -> str:
    pretty = subject.replace("_", " ")
    return f"The following are multiple choice questions (with answers) about {pretty}.\n\n"


def format_question(q: Question, *, with_answer: bool) -> str:
    lines = [q.text] + [f"{c}. {t}" for c, t in zip(CHOICES, q.choices, strict=True)]
    body = "\n".join(lines) + "\nAnswer:"
    return body + f" {q.answer}\n\n" if with_answer else body


def _read_csv(path: Path) -> tuple[Question, ...]:
    rows: list[Question] = []
    with path.open(newline="", encoding="utf-8") as fh:
        for lineno, row in enumerate(csv.reader(fh), start=1):
            if len(row) != 6:
                raise ValueError(f"{path}:{lineno}: expected 6 columns, got {len(row)}")
            q, a, b, c, d, ans = row
            if ans.strip() not in CHOICES:
                raise ValueError(f"{path}:{lineno}: answer {ans!r} is not one of A-D")
            rows.append(Question(q, (a, b, c, d), ans.strip()))
    return tuple(rows)


def subjects_in(directory: Path) -> list[str]:
    dev = directory / "dev"
    if not dev.is_dir():
        raise FileNotFoundError(f"{directory} has no dev/ folder (expected MMLU release layout)")
    return sorted(p.name.removesuffix("_dev.csv") for p in dev.glob("*_dev.csv"))


def load_subjects(directory: str | Path, split: str = "test") -> list[Subject]:
    """Read every subject that has both a dev file and a ``split`` file."""
    root = Path(directory)
    out: list[Subject] = []
    for name in subjects_in(root):
        split_path = root / split / f"{name}_{split}.csv"
        if not split_path.exists():
            continue
        dev = _read_csv(root / "dev" / f"{name}_dev.csv")
        out.append(Subject(name, dev, _read_csv(split_path)))
    if not out:
        raise FileNotFoundError(f"no MMLU subjects with a {split} split under {directory}")
    return out


def subject_requests(subject: Subject, max_tokens: int = 1) -> list[Request]:
    prefix = subject.prefix
    return [
        Request(
            id=f"{subject.name}/{i}",
            prompt=prefix + format_question(q, with_answer=False),
            max_tokens=max_tokens,
            group=subject.name,
            prefix_chars=len(prefix),
        )
        for i, q in enumerate(subject.test)
    ]


def load_groups(directory: str | Path, split: str = "test") -> dict[str, list[Request]]:
    """All questions, grouped by subject (in file order)."""
    return {s.name: subject_requests(s) for s in load_subjects(directory, split)}
