"""Every relative link in the README, the recipes' README, the changelog and docs/ reaches a file, and its
#anchor a heading there; every repository path those pages write in backticks exists.

Headings get renamed as the docs change; a link to the old name then lands at
the top of a thousand-line page. Anchors follow GitHub's rule: lower case,
punctuation other than hyphens dropped, spaces to hyphens, a repeated heading
numbered from -1. Files get moved (bench tools to `dev/`, a module to another
package); a path left behind in the prose sends the reader nowhere.
"""

from __future__ import annotations

import importlib.util
import itertools
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "recipes" / "README.md", ROOT / "CHANGELOG.md",
         *sorted((ROOT / "docs").glob("*.md"))]
PATH_PAGES = [p for p in PAGES if p.name != "CHANGELOG.md"]   # the changelog records paths as they were

# What makes a backticked token a repository path: a slash between two names, and one of these
# endings or a trailing slash (a folder). A bare `name/` is a folder named in words (a run's `final/`,
# the repository's `kernels/`), not a path.
EXTENSIONS = (".py", ".json", ".jsonl", ".md", ".png", ".toml", ".txt", ".yaml", ".yml", ".sh")
# Paths that are not the repository's, each for a stated reason:
# - what a command writes: the word after one of these options in the same span;
OUTPUT_OPTIONS = ("--json", "--markdown", "--plot", "--png", "--output-dir", "-o")
# - paths under these folders, which the pages use for outputs and scratch files (a run's
#   `--output-dir`, `$OUT` on a GPU machine);
OUTPUT_ROOTS = ("/", "~", "$OUT", "runs/", "out/", "outputs/")
# - files inside another installed package, checked against that package's own files;
PACKAGES = ("transformers", "fla", "torch", "triton")
# - code that was removed, written with git's `<commit>:<path>` (the commit holds it).
AT_COMMIT = re.compile(r"^[0-9a-f]{7,40}:")


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


def spans(page: pathlib.Path) -> list[str]:
    """The inline code spans of a page (fenced blocks left out: they hold commands' outputs and code)."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return [m.group(1) for m in re.finditer(r"`([^`\n]+)`", text)]


def path_tokens(span: str) -> list[str]:
    """The words of a code span that look like repository paths, outputs and other packages' files
    left out."""
    words = span.split()
    out = []
    for before, word in zip(["", *words], words):
        word = word.strip(",;:()[]'\"")
        if before in OUTPUT_OPTIONS or "/" not in word.rstrip("/") or "://" in word or "=" in word:
            continue
        if not (word.endswith(EXTENSIONS) or word.endswith("/")):
            continue
        if word.startswith(OUTPUT_ROOTS) or AT_COMMIT.match(word):
            continue
        out.append(word.removeprefix("$REPO/"))   # `$REPO` stands for the checkout
    return out


def expand(pattern: str) -> list[str]:
    """`{a,b}` alternatives spelled out; `*` is left to glob."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def package_dir(name: str) -> pathlib.Path | None:
    spec = importlib.util.find_spec(name)
    return pathlib.Path(spec.origin).parent if spec and spec.origin else None


def resolves(token: str, page: pathlib.Path) -> bool:
    """Every alternative of the token names something that exists, relative to the repository root or
    to the page's folder (or, for another package's files, to that package)."""
    first = token.split("/")[0]
    bases = [package_dir(first).parent] if first in PACKAGES and package_dir(first) else [ROOT, page.parent]
    for alternative in expand(token):
        if not any(list(base.glob(alternative.rstrip("/"))) if "*" in alternative else (base / alternative).exists()
                   for base in bases):
            return False
    return True


def test_the_slug_rule():
    assert slug("GDN's reverse state walk") == "gdns-reverse-state-walk"
    assert slug("Packed input: full chunks and short chunks in two launches") == \
        "packed-input-full-chunks-and-short-chunks-in-two-launches"
    assert slug("Context parallelism (`--context-parallel`)") == "context-parallelism---context-parallel"


def test_the_link_pattern_finds_the_docs_links():
    # a pattern that matched nothing would let every page pass
    assert sum(len(links(p)) for p in PAGES) > 50
    assert "studies.md#gdns-reverse-state-walk" in links(ROOT / "docs" / "architecture.md")


def test_the_path_pattern_finds_paths_and_leaves_out_outputs():
    # the same guard for the backticked paths, and the allowances at work on spans the pages write
    assert sum(len(path_tokens(s)) for p in PATH_PAGES for s in spans(p)) > 100
    assert path_tokens("python $REPO/dev/bench_lab --from-json docs/bench/ops/*.json --markdown ops.md "
                       "--plot docs/img/x.png") == ["docs/bench/ops/*.json"]
    assert path_tokens("python $REPO/dev/compare_runs.py --png /tmp/loss.png") == ["dev/compare_runs.py"]
    assert path_tokens("eee31eb:kernels/triton_backend/split_reverse.py") == []
    assert expand("docs/bench/{ops,walk}/") == ["docs/bench/ops/", "docs/bench/walk/"]
    assert not resolves("rewy_hf/bench/kernel_registers.py", ROOT / "README.md")   # moved to dev/
    assert resolves("configs/ddp.yaml", ROOT / "recipes" / "README.md")            # relative to its page


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


@pytest.mark.parametrize("page", PATH_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_backticked_path_exists(page):
    missing = sorted({token for span in spans(page) for token in path_tokens(span) if not resolves(token, page)})
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: " + ", ".join(missing)


def test_the_performance_page_stays_a_reference():
    """performance.md holds the current figures, their commands and short explanations; studies and
    shape-by-shape tables live on their own pages (400 lines is the page's stated size)."""
    lines = (ROOT / "docs" / "performance.md").read_text().splitlines()
    assert len(lines) <= 400, f"performance.md has {len(lines)} lines: move studies to docs/studies.md"
