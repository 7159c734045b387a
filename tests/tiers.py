"""The test tiers, read from the folders: a test in tests/<tier>/ is in that tier and no other.

tests/conftest.py marks every collected test with its folder's tier, so `pytest -m unit` (or
service, e2e, process) runs the whole folder, and refuses a test outside the tier folders or one
that declares another tier (`@pytest.mark.<tier>` on it, `pytestmark` in its module)."""

from __future__ import annotations

from pathlib import Path

import pytest

TIERS = ("unit", "service", "e2e", "process")  # the markers registered in pyproject.toml


def misplaced(folder: str | None, declared: set[str]) -> str | None:
    """Why a test whose first folder under tests/ is `folder` (None: tests/ itself) and which
    declares the tier markers `declared` is in the wrong place; None when it is not."""
    if folder not in TIERS:
        return f"outside the tier folders ({', '.join(f'tests/{t}/' for t in TIERS)})"
    others = sorted(declared - {folder})
    if others:
        return f"in tests/{folder}/ but marked {' and '.join(others)}"
    return None


def mark_by_folder(items: list[pytest.Item], root: Path) -> None:
    """Give each test its folder's tier marker; a UsageError lists the tests that are misplaced."""
    wrong = []
    for item in items:
        path = Path(item.path).resolve()
        parts = path.relative_to(root).parts if path.is_relative_to(root) else ()
        folder = parts[0] if len(parts) > 1 else None
        declared = {mark.name for mark in item.iter_markers() if mark.name in TIERS}
        problem = misplaced(folder, declared)
        if problem:
            wrong.append(f"  {item.nodeid}: {problem}")
        else:
            item.add_marker(folder)
    if wrong:
        raise pytest.UsageError(
            f"{len(wrong)} test(s) not where their tier says: a test's tier is its folder, "
            f"tests/<tier>/ with <tier> one of {', '.join(TIERS)}; move each into its tier's "
            "folder (and drop any other tier marker):\n" + "\n".join(wrong))
