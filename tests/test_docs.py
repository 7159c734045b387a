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


PACKAGES = ("specdec", "specdec_cli", "coordinator", "draft_service", "target_service")


def layout_rows() -> dict[str, str]:
    """docs/design.md's layout table: folder (as written, with its trailing /) -> the row's text."""
    section = (ROOT / "docs" / "design.md").read_text().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return {match[1]: match[2] for match in re.finditer(r"^\| `([^`]+/)` \| (.*) \|$", section, re.M)}


def test_the_layout_table_names_every_module_and_only_modules_that_exist():
    rows = layout_rows()
    folders = sorted({path.parent for package in PACKAGES for path in (ROOT / package).rglob("*.py")})
    problems = []
    for folder in folders:
        name = f"{folder.relative_to(ROOT)}/"
        if name not in rows:
            problems.append(f"{name} has no row")
            continue
        named = set(re.findall(r"`([\w.]+\.py)`", rows[name])) - {"__init__.py"}
        modules = {path.name for path in folder.glob("*.py") if path.name != "__init__.py"}
        if name != "specdec/v1/":  # the generated stubs: named by their protos
            problems += [f"{name}{module} is not named in its row" for module in sorted(modules - named)]
        problems += [f"{name}{module} is named but does not exist" for module in sorted(named - modules)]
    problems += [f"{name} has a row but no modules" for name in rows
                 if name.split("/")[0] in PACKAGES and not (ROOT / name).is_dir()]
    assert not problems, "docs/design.md's layout table is stale:\n" + "\n".join(problems)
