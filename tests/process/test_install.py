"""The installed environment has every package the code needs, and pyproject declares them.

Run in a fresh virtual environment (as .ci/run does) these catch a dependency that a
developer's machine happens to have but `pip install -e '.[dev]'` would not bring.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("specdec", "specdec_cli", "coordinator", "draft_service", "target_service")  # bench has its own extra
# packages transformers imports only when it loads a .gguf file: no import of ours names them
GGUF_LOADER_NEEDS = ("gguf", "accelerate")
# optional extras: the files under a folder may import what that extra declares (lazily, with an
# actionable message where it is missing)
EXTRAS_OF = {"specdec/distill/": "distill"}

IMPORT_ALL = """
import importlib, pkgutil, sys
failed = []
for name in sys.argv[1:]:
    package = importlib.import_module(name)
    for info in pkgutil.walk_packages(package.__path__, name + "."):
        try:
            importlib.import_module(info.name)
        except Exception as exc:
            failed.append(f"{info.name}: {exc.__class__.__name__}: {exc}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def _normalize(name: str) -> str:
    """PEP 503 name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared(extra: str | None = None) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return {_normalize(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec).group(0)) for spec in specs}


def _imported_top_level_names() -> dict[str, set[str]]:
    """Top-level absolute imports of the packages -> the files importing them (lazy imports included)."""
    names: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    found = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found = [node.module]
                else:
                    continue
                for name in found:
                    names.setdefault(name.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return names


def _python(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_models_fetch_help_runs():
    result = _python("-m", "specdec_cli", "models", "fetch", "--help")
    assert result.returncode == 0, result.stderr
    assert "--source" in result.stdout and "--cache-dir" in result.stdout


def test_every_module_imports():
    result = _python("-c", IMPORT_ALL, *PACKAGES)
    assert result.returncode == 0, f"modules that fail to import:\n{result.stdout}\n{result.stderr}"


def test_every_third_party_import_is_a_declared_dependency():
    declared = _declared()
    first_party = set(PACKAGES)
    distributions = importlib.metadata.packages_distributions()
    missing = []
    for name, files in sorted(_imported_top_level_names().items()):
        if name in sys.stdlib_module_names or name in first_party:
            continue
        providers = {_normalize(d) for d in distributions.get(name, [])}
        extras = {extra for folder, extra in EXTRAS_OF.items() if all(f.startswith(folder) for f in files)}
        allowed = declared.union(*(_declared(extra) for extra in extras))
        if not providers:
            missing.append(f"{name} (imported by {', '.join(sorted(files))}) is not installed at all")
        elif not providers & allowed:
            missing.append(f"{name} (imported by {', '.join(sorted(files))}) comes from "
                           f"{sorted(providers)}, none of which pyproject `dependencies` declares")
    assert not missing, "\n".join(missing)


def test_gguf_loader_packages_are_declared_and_installed():
    from transformers.utils import is_accelerate_available, is_gguf_available

    assert set(GGUF_LOADER_NEEDS) <= _declared()
    assert is_gguf_available() and is_accelerate_available(), \
        "transformers cannot load .gguf files here: pip install -e . (gguf and accelerate)"


def test_declared_dependencies_are_installed():
    """What pip was asked for is there (a stale or hand-made environment fails here)."""
    absent = []
    for name in sorted(_declared() | _declared("dev")):
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            absent.append(name)
    assert not absent, f"declared but not installed: {absent}; run pip install -e '.[dev]'"
