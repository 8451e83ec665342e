"""The documentation holds together: a short README, links that resolve, no page out of reach."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 400

# [text](target) and ![alt](target); the target ends at whitespace or ")" (an optional title
# after a space is ignored).
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def links(page: Path) -> list[str]:
    """The link targets of a page, outside fenced code blocks and inline code."""
    targets = []
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        line = re.sub(r"`[^`]*`", "", line)
        targets.extend(LINK.findall(line))
    return targets


def is_relative(target: str) -> bool:
    return not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) and not target.startswith("#")


def resolve(page: Path, target: str) -> Path:
    path = target.split("#", 1)[0].split("?", 1)[0]
    return (page.parent / path).resolve()


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines, at most {MAX_README_LINES}")


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    broken = [target for target in links(page) if is_relative(target)
              and not resolve(page, target).exists()]
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files: {broken}"


def test_pages_have_links_checked():
    """The link pattern finds links at all (a pattern that matches nothing passes vacuously)."""
    assert len([t for t in links(README) if is_relative(t)]) >= 10


def test_readme_reaches_every_docs_page():
    """Every markdown page under docs/ is linked from the README, directly or through pages it
    links."""
    reached: set[Path] = set()
    todo = [README.resolve()]
    while todo:
        page = todo.pop()
        if page in reached or not page.is_file() or page.suffix != ".md":
            continue
        reached.add(page)
        todo.extend(resolve(page, t) for t in links(page) if is_relative(t))
    missing = [str(p.relative_to(ROOT)) for p in sorted(DOCS.rglob("*.md"))
               if p.resolve() not in reached]
    assert not missing, f"docs pages the README does not reach: {missing}"
