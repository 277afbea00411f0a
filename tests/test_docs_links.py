"""Every relative link in the project's documentation resolves.

Theory of operation: the README, DEVELOPERS.md and every page under docs/ are read as Markdown;
fenced code blocks and inline code are removed, then every link and image target that is not a
URL is resolved against the page's folder and must exist, and a ``#fragment`` into a Markdown
page (or into the page itself) must name one of its headings as GitHub spells anchors. A
documentation file that is not a checked page (an image, a folder, deploy/README.md) only has
to exist.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "DEVELOPERS.md", *(ROOT / "docs").glob("*.md")])

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)


def _prose(text: str) -> str:
    """The page without fenced code blocks (links inside them are not links)."""
    return _FENCE.sub("", text)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.replace("`", "").strip().lower()
    kept = []
    for ch in text:
        if ch in "-_ " or unicodedata.category(ch)[0] in "LN":
            kept.append("-" if ch == " " else ch)
    return "".join(kept)


def anchors(page: Path) -> set[str]:
    """Every anchor a page's headings give, GitHub's -1, -2 suffixes for repeats included."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for heading in _HEADING.findall(_prose(page.read_text(encoding="utf-8"))):
        slug = anchor(heading)
        n = seen.get(slug, 0)
        out.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return out


def relative_links(page: Path) -> list[str]:
    """The link targets of a page that point into the repository, not at a URL."""
    text = _INLINE_CODE.sub("", _prose(page.read_text(encoding="utf-8")))
    targets = _LINK.findall(text)
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def broken_links(page: Path) -> list[str]:
    """Each relative link of a page whose file or heading does not exist, with why."""
    broken = []
    for target in relative_links(page):
        path_part, _, fragment = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_docs_do_not_send_users_to_shared() -> None:
    for page in PAGES:
        assert "../shared" not in page.read_text(encoding="utf-8"), page.name


def test_the_checker_finds_a_broken_file_and_a_broken_anchor(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Title\n\n## Workloads × schedules\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#workloads--schedules) [gone](missing.md) [bad](other.md#nope)\n"
        "[self](#here) [url](https://example.com/x.md)\n\n## Here\n"
        "```\n[in code](nowhere.md)\n```\n",
        encoding="utf-8",
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "other.md#nope: no heading with that anchor in other.md",
    ]


def test_anchor_matches_github_spelling() -> None:
    assert anchor("Paper reproduction (MMLU, 4 nodes)") == "paper-reproduction-mmlu-4-nodes"
    assert anchor("External engine: vLLM CPU (make vllm-check)") == (
        "external-engine-vllm-cpu-make-vllm-check"
    )
    assert anchor("`/peer/forward` outside FastAPI") == "peerforward-outside-fastapi"
