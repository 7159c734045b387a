"""Transport security over real servers: TLS on the public port, the API key, mutual TLS
between the coordinator and the tiers, and start-up errors for bad files.

Here the process tests; the other tiers' are in tests/unit/test_security.py and
tests/e2e/test_security.py.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from coordinator.server import StartupError
from coordinator.server import start as start_coordinator
from specdec.config import CoordinatorConfig, DraftConfig
from specdec.rpc.security import CredentialsError, read_api_key, server_credentials
from tests.e2e.test_security import API_KEY, _openssl, pki, secure, _address


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "specdec_cli", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_generate_cli_with_key_and_ca(secure, pki):
    base = ["generate", "--address", _address(secure), "--max-new-tokens", "4", "--json"]
    ok = run_cli(*base, "--tls-ca-file", pki["ca"]["pem"], "hi", env={"SPECDEC_GENERATE_API_KEY": API_KEY})
    assert ok.returncode == 0, ok.stderr
    refused = run_cli(*base, "--tls-ca-file", pki["ca"]["pem"], "--api-key", "wrong-key", "hi")
    assert refused.returncode == 2 and "UNAUTHENTICATED" in refused.stderr
    assert "wrong-key" not in refused.stderr
    missing_ca = run_cli(*base, "--tls-ca-file", "/nonexistent/ca.pem", "hi")
    assert missing_ca.returncode != 0 and "--tls-ca-file /nonexistent/ca.pem" in missing_ca.stderr
    assert "Traceback" not in missing_ca.stderr


# ---- bad files: start-up errors that name the flag and the path -------------------------------

def _server_config(**fields) -> DraftConfig:
    return DraftConfig(model="unused", **fields)


def test_bad_server_files_are_named(pki, tmp_path):
    cert, key = pki["tier"]["pem"], pki["tier"]["key"]
    encrypted = tmp_path / "encrypted.key"
    _openssl("pkey", "-in", key, "-aes128", "-passout", "pass:x", "-out", str(encrypted))
    cases = [
        (dict(tls_cert_file="/nonexistent/c.pem", tls_key_file=key), "--tls-cert-file /nonexistent/c.pem"),
        (dict(tls_cert_file=cert, tls_key_file=str(tmp_path)), f"--tls-key-file {tmp_path}: cannot read"),
        (dict(tls_cert_file=key, tls_key_file=key), f"--tls-cert-file {key}: holds no PEM certificate"),
        (dict(tls_cert_file=cert, tls_key_file=cert), f"--tls-key-file {cert}: holds no PEM private key"),
        (dict(tls_cert_file=cert, tls_key_file=pki["client"]["key"]),
         f"--tls-key-file {pki['client']['key']} is not the private key of the certificate in "
         f"--tls-cert-file {cert}"),
        (dict(tls_cert_file=cert, tls_key_file=str(encrypted)), "encrypted"),
        (dict(tls_cert_file=cert), "--tls-cert-file needs --tls-key-file"),
        (dict(tls_client_ca_file=pki["ca"]["pem"]), "--tls-client-ca-file needs --tls-cert-file"),
        (dict(tls_cert_file=cert, tls_key_file=key, tls_client_ca_file=key),
         f"--tls-client-ca-file {key}: holds no PEM certificate"),
    ]
    for fields, words in cases:
        with pytest.raises(CredentialsError) as info:
            server_credentials(_server_config(**fields))
        assert words in str(info.value), fields
    assert server_credentials(_server_config()) is None
    assert server_credentials(_server_config(tls_cert_file=cert, tls_key_file=key)) is not None


def test_bad_coordinator_files_are_startup_errors(pki, tmp_path):
    empty = tmp_path / "empty.key"
    empty.write_text("\n")
    cases = [
        (dict(api_key_file=str(empty)), f"--api-key-file {empty}: the file is empty"),
        (dict(api_key_file="/nonexistent/key"), "--api-key-file /nonexistent/key: no such file"),
        (dict(upstream_ca_file="/nonexistent/ca.pem"), "--upstream-ca-file /nonexistent/ca.pem"),
        (dict(upstream_cert_file=pki["client"]["pem"], upstream_key_file=pki["client"]["key"]),
         "--upstream-cert-file needs --upstream-ca-file"),
        (dict(upstream_ca_file=pki["ca"]["pem"], upstream_cert_file=pki["client"]["pem"]),
         "--upstream-cert-file needs --upstream-key-file"),
        (dict(upstream_server_name="x"), "--upstream-server-name needs --upstream-ca-file"),
    ]
    for fields, words in cases:
        config = CoordinatorConfig(draft="127.0.0.1:1", target="127.0.0.1:2", port=0, **fields)
        with pytest.raises(StartupError) as info:
            asyncio.run(start_coordinator(config, startup_timeout_s=0.1))
        assert words in str(info.value), fields
    assert read_api_key(pki["api_key_file"]) == API_KEY


def test_serve_reports_a_bad_file_without_a_traceback(tmp_path):
    model = tmp_path / "model"  # a directory that exists: the model is never loaded, the files are checked first
    model.mkdir()
    draft = run_cli("serve", "draft", "--model", str(model), "--tls-cert-file", "/nonexistent/c.pem",
                    "--tls-key-file", "/nonexistent/k.pem")
    assert draft.returncode != 0
    assert "--tls-cert-file /nonexistent/c.pem: no such file" in draft.stderr and "Traceback" not in draft.stderr
    coordinator = run_cli("serve", "coordinator", env={"SPECDEC_COORDINATOR_API_KEY_FILE": str(tmp_path)})
    assert coordinator.returncode != 0
    assert f"--api-key-file {tmp_path}: cannot read" in coordinator.stderr
    assert "Traceback" not in coordinator.stderr
