"""Transport security over real servers: TLS on the public port, the API key, mutual TLS
between the coordinator and the tiers, and start-up errors for bad files.

Here the e2e tests; the other tiers' are in tests/unit/test_security.py and
tests/process/test_security.py.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from coordinator.server import StartupError
from coordinator.server import start as start_coordinator
from specdec.config import CoordinatorConfig
from specdec.v1 import coordinator_pb2_grpc
from tests.cluster import Cluster, generate_request

API_KEY = "sk-test-4f1c0b7e9a2d4c6e8f0a1b3c5d7e9f21"
TIER_NAME = "specdec-tier"  # the only name in the tiers' certificate: the coordinator overrides the check


# ---- a small PKI, made with openssl --------------------------------------------------------------

def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _ca(directory: Path, name: str) -> dict[str, str]:
    key, pem = str(directory / f"{name}.key"), str(directory / f"{name}.pem")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", key, "-out", pem, "-days", "2", "-subj", f"/CN={name}")
    return {"key": key, "pem": pem}


def _leaf(directory: Path, name: str, ca: dict[str, str], san: str) -> dict[str, str]:
    key, csr, pem = (str(directory / f"{name}.{ext}") for ext in ("key", "csr", "pem"))
    ext = directory / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", key,
             "-out", csr, "-subj", f"/CN={name}")
    _openssl("x509", "-req", "-in", csr, "-CA", ca["pem"], "-CAkey", ca["key"], "-CAcreateserial",
             "-out", pem, "-days", "2", "-extfile", str(ext))
    return {"key": key, "pem": pem}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca, other = _ca(root, "ca"), _ca(root, "other-ca")
    key_file = root / "api.key"
    key_file.write_text(f"  {API_KEY}\n")  # surrounding whitespace is stripped
    return {
        "ca": ca, "other": other,
        "coordinator": _leaf(root, "coordinator", ca, "IP:127.0.0.1,DNS:localhost"),
        "tier": _leaf(root, "tier", ca, f"DNS:{TIER_NAME}"),
        "client": _leaf(root, "client", ca, "DNS:coordinator-client"),
        "stranger": _leaf(root, "stranger", other, "DNS:coordinator-client"),
        "api_key_file": str(key_file),
    }


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def _tier_tls(pki) -> dict[str, str]:
    """Draft and target serve TLS and require client certificates from our CA."""
    return {"tls_cert_file": pki["tier"]["pem"], "tls_key_file": pki["tier"]["key"],
            "tls_client_ca_file": pki["ca"]["pem"]}


def _upstream(pki, client: str | None = "client", ca: str = "ca", server_name: str = TIER_NAME) -> dict:
    fields = {"upstream_ca_file": pki[ca]["pem"], "upstream_server_name": server_name}
    if client:
        fields.update(upstream_cert_file=pki[client]["pem"], upstream_key_file=pki[client]["key"])
    return fields


@pytest.fixture(scope="module")
def secure(models, pki):
    """TLS + API key on the coordinator's port, mutual TLS between the coordinator and the tiers."""
    coordinator = {"tls_cert_file": pki["coordinator"]["pem"], "tls_key_file": pki["coordinator"]["key"],
                   "api_key_file": pki["api_key_file"], **_upstream(pki)}
    cluster = Cluster(models["llama"]["draft"], models["llama"]["target"], coordinator=coordinator,
                      draft=_tier_tls(pki), target=_tier_tls(pki),
                      client_credentials=grpc.ssl_channel_credentials(_read(pki["ca"]["pem"])),
                      metadata=(("authorization", f"Bearer {API_KEY}"),))
    with cluster:
        yield cluster


def _address(cluster: Cluster) -> str:
    return f"127.0.0.1:{cluster.coordinator.port}"


def _stub(channel: grpc.Channel) -> coordinator_pb2_grpc.CoordinatorStub:
    return coordinator_pb2_grpc.CoordinatorStub(channel)


# ---- the API key ------------------------------------------------------------------------------

def test_right_key_over_tls_and_mtls_generates_with_the_draft(secure):
    response = secure.complete(prompt="def f(x):", max_new_tokens=8, ignore_eos=True, num_speculative_tokens=3)
    assert len(response.token_ids) == 8
    # the draft tier answered over mutual TLS too: no round fell back to target-only
    assert response.stats.draft_tokens > 0 and response.stats.fallback_rounds == 0
    chunks = secure.stream(prompt="def f(x):", max_new_tokens=8, ignore_eos=True, num_speculative_tokens=3)
    assert [t for c in chunks for t in c.token_ids] == list(response.token_ids)


@pytest.mark.parametrize("metadata, words", [
    ((), "missing API key"),
    ((("authorization", "Bearer not-the-key"),), "invalid API key"),
    ((("authorization", API_KEY),), "invalid API key"),  # no "Bearer "
])
def test_missing_or_wrong_key_is_unauthenticated(secure, metadata, words):
    stub = _stub(secure.channel)
    for call in (lambda: stub.Complete(_complete_request(), timeout=30, metadata=metadata),
                 lambda: list(stub.Generate(generate_request(prompt="hi", max_new_tokens=2), timeout=30,
                                            metadata=metadata))):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert words in info.value.details()
        assert "authorization: Bearer <key>" in info.value.details()
        assert API_KEY not in info.value.details() and "not-the-key" not in info.value.details()


def _complete_request():
    from specdec.v1 import coordinator_pb2

    return coordinator_pb2.CompleteRequest(request=generate_request(prompt="hi", max_new_tokens=2))


def test_health_and_reflection_need_no_key(secure):
    health = health_pb2_grpc.HealthStub(secure.channel)
    for service in ("", "specdec.v1.Coordinator"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(secure.channel)
    answers = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                              timeout=10)
    names = {s.name for answer in answers for s in answer.list_services_response.service}
    assert "specdec.v1.Coordinator" in names


def test_the_key_never_reaches_the_logs(secure, caplog):
    caplog.set_level(logging.DEBUG)
    stub = _stub(secure.channel)
    with pytest.raises(grpc.RpcError):
        stub.Complete(_complete_request(), timeout=30, metadata=(("authorization", f"Bearer {API_KEY}x"),))
    secure.complete(prompt="hi", max_new_tokens=2)
    assert any("refused" in r.getMessage() for r in caplog.records)  # the logs were captured
    assert API_KEY not in caplog.text


# ---- TLS on the public port -------------------------------------------------------------------

def test_plaintext_client_cannot_use_the_tls_port(secure):
    with grpc.insecure_channel(_address(secure)) as channel:
        with pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_trusting_another_ca_fails(secure, pki):
    credentials = grpc.ssl_channel_credentials(_read(pki["other"]["pem"]))
    with grpc.secure_channel(_address(secure), credentials) as channel:
        with pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "handshake" in info.value.details().lower()


# ---- mutual TLS between the coordinator and the tiers -----------------------------------------

def _start_against(secure, fields: dict, timeout_s: float = 1.5) -> str:
    """Start a coordinator against the secure cluster's tiers; return its StartupError message."""
    config = CoordinatorConfig(draft=f"127.0.0.1:{secure.draft_port}", target=f"127.0.0.1:{secure.target_port}",
                               port=0, **fields)

    async def attempt():
        running = await start_coordinator(config, startup_timeout_s=timeout_s)
        await running.stop(None)

    with pytest.raises(StartupError) as info:
        asyncio.run(attempt())
    return str(info.value)


@pytest.mark.parametrize("fields, words", [
    ({}, "--upstream-ca-file"),  # plaintext to a TLS tier
    ("no-client-cert", "--upstream-cert-file"),
    ("stranger-cert", "--upstream-cert-file"),
    ("other-ca", "handshake"),
    ("wrong-name", "'somebody-else' (--upstream-server-name)"),
])
def test_coordinator_without_the_right_credentials_cannot_use_the_tiers(secure, pki, fields, words):
    fields = {
        "no-client-cert": lambda: _upstream(pki, client=None),
        "stranger-cert": lambda: _upstream(pki, client="stranger"),
        "other-ca": lambda: _upstream(pki, ca="other"),
        "wrong-name": lambda: _upstream(pki, server_name="somebody-else"),
    }[fields]() if isinstance(fields, str) else fields
    message = _start_against(secure, fields)
    assert f"draft service at 127.0.0.1:{secure.draft_port}" in message
    assert "TLS" in message and words in message
