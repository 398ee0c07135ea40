"""The docs' own rules: short pages, no words about how the work was organised, links that lead somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
BANNED = re.compile(r"session|\bstop \d+|engineers", re.IGNORECASE)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def slugs(text: str) -> set[str]:
    """GitHub's anchors for a page's headings (outside code blocks): lowercased, punctuation dropped, spaces to -."""
    found: set[str] = set()
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = re.match(r"#{1,6} (.+)", line)
        if heading and not fenced:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            n = 1
            base = slug
            while slug in found:
                slug, n = f"{base}-{n}", n + 1
            found.add(slug)
    return found


def test_the_slugs_are_githubs() -> None:
    assert slugs("# Keep-alive (`bench/warm_pool.py`, `ember sim --verdict`)\n## A\n## A\n") == {
        "keep-alive-benchwarm_poolpy-ember-sim---verdict", "a", "a-1"}


def test_the_readme_is_a_page() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_no_page_is_over_500_lines(page: Path) -> None:
    assert len(page.read_text().splitlines()) <= 500


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_no_page_speaks_of_how_the_work_was_organised(page: Path) -> None:
    hits = [f"{n}: {m.group(0)!r}" for n, line in enumerate(page.read_text().splitlines(), 1)
            for m in BANNED.finditer(line)]
    assert not hits


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_link_leads_somewhere(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue   # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        missing = not dest.exists()
        if missing or (anchor and dest.suffix == ".md" and anchor not in slugs(dest.read_text())):
            broken.append(target)
    assert not broken


REPO_PATH = re.compile(r"`((?:ember|bench|tests|deploy|docs)/[\w./-]+?)/?(?:::\w+)?`")


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_file_of_the_repository_a_page_names_exists(page: Path) -> None:
    """A path in backticks (`ember/core/placement.py`) names a file that is there; benchmark outputs aside."""
    missing = [path for path in REPO_PATH.findall(page.read_text())
               if not path.startswith("bench/results/") and not (ROOT / path).exists()]
    assert not missing


def test_the_architecture_keeps_its_rings_every_rung_and_the_processes() -> None:
    from ember.core.states import Rung

    text = (ROOT / "docs" / "architecture.md").read_text()
    assert {"the-cold-start-ladder", "processes"} <= slugs(text)
    assert all(ring in text for ring in ("adapters (the edge)", "wire models", "pure core"))
    ladder = text.split("## The cold-start ladder")[1].split("\n## ")[0]
    first_cells = {line.split("|")[1].strip() for line in ladder.splitlines() if line.startswith("| ")}
    missing = [rung.value for rung in Rung if not any(re.search(rf"\b{rung.value}\b", c) for c in first_cells)]
    assert not missing, f"docs/architecture.md's ladder lacks {missing}"
