"""A test's tier is its folder: the rule tests/conftest.py applies (tests/tiers.py) can fail."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.tiers import TIERS, misplaced

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tier", TIERS)
def test_a_test_in_its_tiers_folder_is_in_place(tier):
    assert misplaced(tier, set()) is None
    assert misplaced(tier, {tier}) is None


def test_a_test_outside_the_tier_folders_is_misplaced():
    assert "outside the tier folders" in misplaced(None, set())
    assert "outside the tier folders" in misplaced("support", {"unit"})


def test_a_test_marked_with_another_tier_is_misplaced():
    assert misplaced("unit", {"service"}) == "in tests/unit/ but marked service"
    assert misplaced("e2e", {"e2e", "process"}) == "in tests/e2e/ but marked process"


def _collect(suite: Path, *args: str) -> subprocess.CompletedProcess:
    (suite / "conftest.py").write_text(textwrap.dedent("""
        from pathlib import Path

        import pytest

        from tests.tiers import mark_by_folder


        @pytest.hookimpl(tryfirst=True)
        def pytest_collection_modifyitems(config, items):
            mark_by_folder(items, Path(__file__).resolve().parent)
        """))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "--rootdir",
         str(suite), "-c", os.devnull, *args, str(suite)],
        capture_output=True, text=True, timeout=120, cwd=suite, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def test_collection_refuses_misplaced_tests_and_marks_the_rest_by_folder(tmp_path):
    suite = tmp_path / "suite"
    _write(suite / "unit" / "test_fast.py", "def test_fast():\n    pass\n")
    _write(suite / "e2e" / "test_slow.py", "def test_slow():\n    pass\n")
    placed = _collect(suite, "-m", "unit")
    assert placed.returncode == 0, placed.stdout + placed.stderr
    assert "test_fast.py::test_fast" in placed.stdout and "test_slow" not in placed.stdout

    _write(suite / "test_loose.py", "def test_loose():\n    pass\n")
    _write(suite / "unit" / "test_wrong.py", """
        import pytest

        @pytest.mark.service
        def test_wrong():
            pass
        """)
    refused = _collect(suite)
    assert refused.returncode == pytest.ExitCode.USAGE_ERROR, refused.stdout + refused.stderr
    assert "2 test(s) not where their tier says" in refused.stderr
    assert "test_loose.py::test_loose: outside the tier folders" in refused.stderr
    assert "unit/test_wrong.py::test_wrong: in tests/unit/ but marked service" in refused.stderr
