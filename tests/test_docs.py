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


def test_every_summary_figure_has_its_plot_command_machine_and_date():
    """docs/benchmarks.md's headline figures: each record under docs/figures/ has its plot, the
    literal commands, the machine and the date, its medians agree with its rows, and the summary
    shows the plot and links the record."""
    from bench.summary_figures import median_check, records

    summary = (ROOT / "docs" / "benchmarks.md").read_text()
    found = records(ROOT / "docs" / "figures")
    assert {record["figure"] for record in found.values()} >= {"heads", "speedup", "engines"}
    for path, record in found.items():
        for key in ("title", "date", "machine", "commands", "conditions", "recorded_in_commit"):
            assert record.get(key), f"{path.name} has no {key}"
        assert all(command.strip() for command in record["commands"])
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", record["date"]), f"{path.name}: date {record['date']!r}"
        assert path.with_suffix(".png").is_file(), f"{path.name} has no plot: run python bench/summary_figures.py"
        assert f"(figures/{path.with_suffix('.png').name})" in summary, f"the summary does not show {path.stem}'s plot"
        assert f"(figures/{path.name})" in summary, f"the summary does not link {path.name}"
        assert not median_check(record), median_check(record)


def test_the_machine_record_names_cpu_cores_memory_and_measured_bandwidth():
    import json

    machine = json.loads((ROOT / "docs" / "figures" / "machine.json").read_text())
    assert machine["cpu_model"] and machine["cores"] >= 1 and machine["memory_gib"] > 0
    assert machine["bandwidth_gbs"] > 0 and machine["command"].startswith("python bench/machine.py")
    assert "python bench/machine.py" in (ROOT / "docs" / "benchmarks.md").read_text()
