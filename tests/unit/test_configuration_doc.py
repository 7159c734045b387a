"""docs/configuration.md says what the parsers say, and no page names a flag that does not exist."""

from __future__ import annotations

import ast
import difflib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# scripts whose own flags the pages may name (the benchmarks, the image's health check, the
# stub generator, this page's generator)
SCRIPTS = [*sorted((ROOT / "bench").glob("*.py")), ROOT / "docker" / "healthcheck.py",
           ROOT / "protos" / "generate.py", ROOT / "docs" / "generate_configuration.py"]
# flags of other programs that the pages show in commands, by program
EXTERNAL = {
    "pip": {"--quiet", "--no-deps", "--no-binary", "--only-binary", "--python-version", "--implementation",
            "--platform", "--no-index"},
    "llama.cpp's llama-server": {"--spec-type"},
    "pytest": {"--strict-markers"},
    "helm": {"--set", "--set-json", "--reuse-values", "--create-namespace", "--install"},
    "kubectl": {"--from-literal"},
    "docker / docker compose / podman": {"--build", "--rm", "--chmod", "--build-arg", "--format",
                                         "--runtime", "--mount", "--ulimit"},
    "py-spy": {"--gil", "--native"},
}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")


def _generator():
    spec = importlib.util.spec_from_file_location("generate_configuration",
                                                  ROOT / "docs" / "generate_configuration.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _script_flags(path: Path) -> set[str]:
    """The option strings of every add_argument call in a script (and --no-… of boolean ones)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            found.update(n for n in names if n.startswith("--"))
            if any(k.arg == "action" and "BooleanOptional" in ast.unparse(k.value) for k in node.keywords):
                found.update("--no-" + n[2:] for n in names if n.startswith("--"))
    return found


def test_the_configuration_page_is_generated_from_the_parsers():
    page = ROOT / "docs" / "configuration.md"
    expected = _generator().render()
    current = page.read_text() if page.exists() else ""
    diff = "".join(difflib.unified_diff(current.splitlines(True), expected.splitlines(True),
                                        "docs/configuration.md", "generated"))
    assert current == expected, f"docs/configuration.md is stale; run python docs/generate_configuration.py\n{diff}"


def test_the_generator_check_mode_agrees(capsys):
    assert _generator().main(["--check"]) == 0, capsys.readouterr().out


def test_every_service_flag_has_a_row_with_its_environment_variable():
    from specdec import config

    page = (ROOT / "docs" / "configuration.md").read_text()
    for cls, prefix in ((config.DraftConfig, "draft"), (config.TargetConfig, "target"),
                        (config.CoordinatorConfig, "coordinator")):
        for field in cls.__dataclass_fields__.values():
            assert f"`{config.env_name(prefix, field.name)}`" in page, field.name


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_a_page_names_exists(doc):
    known = _generator().flags().union(*(_script_flags(s) for s in SCRIPTS), *EXTERNAL.values())
    named = set(FLAG.findall(doc.read_text()))
    unknown = sorted(named - known)
    assert not unknown, (f"{doc.relative_to(ROOT)} names flags no parser has: {unknown} (a flag of another "
                         "program goes into EXTERNAL in this test)")
