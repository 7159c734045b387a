"""The images (docker/Dockerfile, docker/Dockerfile.cuda), .dockerignore, docker/compose.yaml,
the images' health check and docker/*.sh. The Dockerfiles are linted with hadolint and checked for
the properties the deployment relies on; compose's commands are run through the real CLI; the
health check runs against real gRPC servers on loopback; the scripts pass shellcheck. Building
and running the images (docker/smoke.sh) takes minutes and a container engine: it runs only with
SPECDEC_TEST_IMAGES=1.

Here the service tests; the other tiers' are in tests/unit/test_docker.py and
tests/process/test_docker.py.
"""

from __future__ import annotations

import shutil
import subprocess
from concurrent import futures
from pathlib import Path

import pytest
from tests.unit.test_docker import healthcheck


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
def probe_pki(tmp_path_factory) -> Path:
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


def test_healthcheck_speaks_mutual_tls_like_the_chart_probes(probe_pki, capsys):
    """The probe the chart runs on a tier with internal mTLS: the pod's own certificate as the
    client certificate, its ca.crt as the root, the internal server name."""
    import grpc

    credentials = grpc.ssl_server_credentials(
        [((probe_pki / "tls.key").read_bytes(), (probe_pki / "tls.crt").read_bytes())],
        root_certificates=(probe_pki / "ca.crt").read_bytes(), require_client_auth=True)
    server, port = _health_server(credentials)
    address = f"127.0.0.1:{port}"
    tls = [f"--ca-file={probe_pki / 'ca.crt'}", "--server-name=specdec-internal"]
    try:
        assert healthcheck.main([address, *tls, f"--cert-file={probe_pki / 'tls.crt'}",
                                 f"--key-file={probe_pki / 'tls.key'}", "--timeout", "5"]) == 0
        # no client certificate: the server refuses the handshake
        assert healthcheck.main([address, *tls, "--timeout", "2"]) == 1
        # plaintext against a TLS port fails too
        assert healthcheck.main([address, "--timeout", "2"]) == 1
    finally:
        server.stop(None)
    assert "UNAVAILABLE" in capsys.readouterr().err
