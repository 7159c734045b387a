"""The documentation stays inside the repository: no pointers to files users never have."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
OUTSIDE = ("../shared", "shared/DESIGN.md", "/work/")


def test_docs_exist():
    assert (ROOT / "docs" / "design.md").is_file()
    assert "docs/design.md" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_never_point_outside_the_repository(doc):
    text = doc.read_text()
    for pointer in OUTSIDE:
        assert pointer not in text, f"{doc.name} refers to {pointer!r}, outside the repository"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(doc):
    for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", doc.read_text()):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        resolved = (doc.parent / target).resolve()
        assert resolved.is_relative_to(ROOT), f"{doc.name} links outside the repository: {target}"
        assert resolved.exists(), f"{doc.name} links to a missing file: {target}"


def _anchors(doc: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    anchors = set()
    for heading in re.findall(r"^#+\s+(.+?)\s*$", re.sub(r"```.*?```", "", doc.read_text(), flags=re.S), re.M):
        anchors.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_to_a_section_name_one_that_exists(doc):
    for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", doc.read_text()):
        page = (doc.parent / target).resolve() if target else doc
        if page.suffix != ".md":
            continue
        assert anchor in _anchors(page), f"{doc.name} links to a missing section: {target}#{anchor}"


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in readme, f"README.md has no link to docs/{page.name}"
