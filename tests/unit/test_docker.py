"""The images (docker/Dockerfile, docker/Dockerfile.cuda), .dockerignore, docker/compose.yaml,
the images' health check and docker/*.sh. The Dockerfiles are linted with hadolint and checked for
the properties the deployment relies on; compose's commands are run through the real CLI; the
health check runs against real gRPC servers on loopback; the scripts pass shellcheck. Building
and running the images (docker/smoke.sh) takes minutes and a container engine: it runs only with
SPECDEC_TEST_IMAGES=1.

Here the unit tests; the other tiers' are in tests/service/test_docker.py and
tests/process/test_docker.py.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import re
from pathlib import Path

import pytest
import yaml


ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.cuda"]
COMPOSE = DOCKER / "compose.yaml"
OFFICIAL_IMAGES = {"redis"}  # Docker official images compose may use besides our own
UID = "10001"


def stages(dockerfile: Path) -> list[list[str]]:
    """The instructions of each stage, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    result: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            result.append([])
        if result:
            result[-1].append(line)
    return result


def build_args(dockerfile: Path) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile.read_text(), re.M))


# ---- Dockerfile properties ---------------------------------------------------------------------

@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_is_multi_stage_non_root_and_pinned(dockerfile):
    all_stages = stages(dockerfile)
    named = {stage[0].split()[-1]: stage for stage in all_stages if " AS " in stage[0]}
    assert len(all_stages) >= 2 and "builder" in named and not re.search(r" AS ", all_stages[-1][0])
    final = all_stages[-1]
    for image in build_args(dockerfile).values():
        if ("/" in image or ":" in image) and "://" not in image:  # a base image, not a URL
            name, _, tag = image.partition(":")
            assert re.match(r"^\d+\.\d+\.\d+", tag) and tag != "latest", f"{image} is not pinned"
    assert any(line.startswith("COPY --from=builder /opt/venv /opt/venv") for line in final)
    assert f"USER {UID}:{UID}" in final and final.index(f"USER {UID}:{UID}") > max(
        i for i, line in enumerate(final) if line.startswith(("RUN", "COPY")))
    assert any(f"--uid {UID}" in line for line in final if line.startswith("RUN"))
    # no build tools: the final stage installs nothing
    for line in final:
        assert not re.search(r"\b(apt-get|apt|apk|pip|conda)\s+install\b", line), line
        assert not re.search(r"\b(gcc|g\+\+|build-essential|make)\b", line), line
    assert any(line.startswith("HEALTHCHECK") and '"specdec-healthcheck"' in line for line in final)
    assert 'ENTRYPOINT ["specdec"]' in final
    # the builder installs the project as a wheel, and torch the right way for each image
    builder = " ".join(named["builder"])
    # the dependencies install before the code is copied, from the list pyproject.toml declares
    assert builder.index("pip install -r requirements.txt") < builder.index("COPY specdec ")
    assert "--mount=type=cache,target=/root/.cache/pip pip install -r" in builder  # nothing cached in a layer
    assert "COPY --from=requirements /requirements.txt" in builder and "tomllib" in " ".join(named["requirements"])
    assert "pip wheel" in builder and "/wheels/specdec-*.whl" in builder
    if dockerfile.name == "Dockerfile":
        # the CPU index unless the build says otherwise (docker/smoke.sh, with a local wheel)
        assert '--index-url "${TORCH_INDEX_URL}"' in builder and "torch==" in builder
        assert build_args(dockerfile)["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
        assert build_args(dockerfile)["TORCH_VERSION"] == "2.13.0"
    else:
        base = build_args(dockerfile)["PYTORCH_IMAGE"]
        assert base.startswith("pytorch/pytorch:") and base.endswith("-runtime")
        assert "--system-site-packages" in builder


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copied_paths_exist_and_are_not_docker_ignored(dockerfile):
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]

    def ignored(path: str) -> bool:
        result = False
        for pattern in patterns:
            negate = pattern.startswith("!")
            pattern = pattern.lstrip("!").replace("**/", "")
            parts = Path(path).parts
            hit = any(fnmatch.fnmatch("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1)) or \
                fnmatch.fnmatch(Path(path).name, pattern) and "/" not in pattern
            if hit:
                result = not negate
        return result

    copies = [line.split()[1:-1] for stage in stages(dockerfile) for line in stage
              if line.startswith("COPY") and "--from=" not in line]
    sources = [src for args in copies for src in args if not src.startswith("--")]
    # RUN --mount=type=bind,source=... reads the build context too
    sources += [src for stage in stages(dockerfile) for line in stage
                for src in re.findall(r"--mount=type=bind,source=([^,\s]+)", line)]
    assert {"pyproject.toml", "README.md", "specdec", "coordinator", "draft_service", "target_service",
            "specdec_cli", "docker/healthcheck.py"} <= set(sources)
    for src in sources:
        assert (ROOT / src).exists(), src
        assert not ignored(src), f"{src} is excluded by .dockerignore"
    for heavy in (".git", ".venv", "tests", "bench", "helm"):
        assert ignored(heavy), f".dockerignore lets {heavy} into the build context"


def test_package_list_matches_pyproject():
    """The Dockerfiles copy exactly the packages pyproject.toml ships."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pattern.rstrip("*") for pattern in include}
    for dockerfile in DOCKERFILES:
        copied = {line.split()[1] for stage in stages(dockerfile) for line in stage
                  if line.startswith("COPY ") and line.split()[1] in packages | {"bench", "tests"}}
        assert copied == packages, dockerfile.name


# ---- compose -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _ours(service: dict) -> bool:
    return "build" in service


def test_compose_uses_only_our_images_and_official_ones(compose):
    services = compose["services"]
    assert {"coordinator", "draft", "target", "redis"} <= set(services)
    for name, service in services.items():
        image = service["image"]
        if _ours(service):
            dockerfile = ROOT / "docker" / Path(service["build"]["dockerfile"]).name
            assert dockerfile in DOCKERFILES and (DOCKER / service["build"]["context"]).resolve() == ROOT
            assert image.split(":")[0] == "specdec"
        else:
            repository, _, tag = image.partition(":")
            assert repository in OFFICIAL_IMAGES, f"{name}: {image} is neither built here nor official"
            assert re.match(r"^\d+\.\d+\.\d+", tag), f"{name}: {image} is not pinned"
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on unknown {dependency}"


def test_compose_wires_the_coordinator_to_the_others(compose):
    services = compose["services"]

    def flag(argv: list[str], name: str) -> str:
        return argv[argv.index(name) + 1]

    coordinator = services["coordinator"]["command"]
    assert coordinator[:2] == ["serve", "coordinator"]
    for tier in ("draft", "target"):
        host, port = flag(coordinator, f"--{tier}").split(":")
        assert host == tier and flag(services[tier]["command"], "--port") == port
        assert services["coordinator"]["depends_on"][tier] == {"condition": "service_healthy"}
        assert services[tier]["environment"][f"SPECDEC_{tier.upper()}_MODEL"].endswith(f"/models/tiny/{tier}}}")
        assert services[tier]["depends_on"]["models"] == {"condition": "service_completed_successfully"}
    assert flag(coordinator, "--session-store") == "redis://redis:6379/0"
    assert services["coordinator"]["depends_on"]["redis"] == {"condition": "service_healthy"}
    assert services["models"]["command"] == ["models", "tiny", "/models/tiny"]
    for name in ("coordinator", "draft", "target"):
        assert flag(services[name]["command"], "--host") == "0.0.0.0"
        assert "models:/models:ro" in services[name]["volumes"]


# ---- the health check --------------------------------------------------------------------------

def _load_healthcheck():
    spec = importlib.util.spec_from_file_location("specdec_healthcheck", DOCKER / "healthcheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


healthcheck = _load_healthcheck()


@pytest.mark.parametrize("cmdline, env, address", [
    (["/opt/venv/bin/python", "/opt/venv/bin/specdec", "serve", "target", "--port", "6000"], {}, "127.0.0.1:6000"),
    (["specdec", "serve", "draft", "--port=7000", "--host", "0.0.0.0"], {}, "127.0.0.1:7000"),
    (["specdec", "serve", "coordinator"], {}, "127.0.0.1:50051"),
    (["specdec", "serve", "draft"], {"SPECDEC_DRAFT_PORT": "7100"}, "127.0.0.1:7100"),
    (["specdec", "serve", "target", "--port", "0"], {}, "127.0.0.1:50053"),
])
def test_healthcheck_finds_its_own_server(cmdline, env, address):
    assert healthcheck.own_address(cmdline, env) == address


def test_healthcheck_refuses_a_container_that_is_not_a_server():
    with pytest.raises(SystemExit, match="pass ADDRESS"):
        healthcheck.own_address(["specdec", "models", "tiny", "/models/tiny"], {})
