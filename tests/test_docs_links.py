"""Every relative link in the README, the changelog and docs/ reaches a file, and its #anchor a heading there.

Headings get renamed as the docs change; a link to the old name then lands at
the top of a thousand-line page. Anchors follow GitHub's rule: lower case,
punctuation other than hyphens dropped, spaces to hyphens, a repeated heading
numbered from -1.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    found, seen, in_code = set(), {}, False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        heading = None if in_code else re.match(r"^#+\s+(.*)", line)
        if heading:
            base = slug(heading.group(1))
            n = seen.get(base, 0)
            found.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
    return found


def links(page: pathlib.Path) -> list[str]:
    return [m.group(1) for m in re.finditer(r"\]\(([^)\s]+)\)", page.read_text())
            if not re.match(r"^[a-z]+:", m.group(1))]


def test_the_slug_rule():
    assert slug("GDN's reverse state walk") == "gdns-reverse-state-walk"
    assert slug("Packed input: full chunks and short chunks in two launches") == \
        "packed-input-full-chunks-and-short-chunks-in-two-launches"
    assert slug("Context parallelism (`--context-parallel`)") == "context-parallelism---context-parallel"


def test_the_link_pattern_finds_the_docs_links():
    # a pattern that matched nothing would let every page pass
    assert sum(len(links(p)) for p in PAGES) > 50
    assert "performance.md#gdns-reverse-state-walk" in links(ROOT / "docs" / "architecture.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    broken = []
    for link in links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path) if path else page
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: no heading with that anchor in {target.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
