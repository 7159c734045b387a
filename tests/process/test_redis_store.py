"""The Redis session store against a real redis-server: leases (one per request, renewed, taken over),
versioned appends, long sessions, TTL, auth, TLS.

Here the process tests; the other tiers' are in tests/unit/test_redis_store.py and
tests/service/test_redis_store.py and tests/e2e/test_redis_store.py.
"""

from __future__ import annotations

import subprocess

import pytest
import redis

from coordinator.sessions.redis_store import RedisSessionStore
from coordinator.sessions.stores import open_store
from specdec.errors import Unavailable
from tests.redis_server import RedisServer
from tests.service.test_redis_store import run, _roundtrip


def test_password_url(tmp_path):
    server = RedisServer(tmp_path / "r", extra=["--requirepass", "s3cret"]).start()
    try:
        async def body():
            bad = RedisSessionStore(f"redis://127.0.0.1:{server.port}/0")
            good = RedisSessionStore(f"redis://:s3cret@127.0.0.1:{server.port}/0")
            try:
                with pytest.raises(Unavailable, match="refused"):
                    await bad.create()
                _, got = await _roundtrip(good)
                assert got.token_ids == [1, 2, 3, 4]
            finally:
                await bad.close()
                await good.close()
        run(body())
    finally:
        server.stop()


def _make_certs(directory):
    """A CA and a server certificate for 127.0.0.1 (openssl)."""
    directory.mkdir()
    ca_key, ca, key, csr, cert = (str(directory / n) for n in ("ca.key", "ca.pem", "srv.key", "srv.csr", "srv.pem"))
    ext = directory / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    for command in (
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca,
         "-days", "2", "-subj", "/CN=specdec-test-ca"],
        ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
        ["openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
         "-days", "2", "-extfile", str(ext)],
    ):
        subprocess.run(command, check=True, capture_output=True)
    return {"ca": ca, "cert": cert, "key": key}


def test_tls_url(tmp_path):
    certs = _make_certs(tmp_path / "certs")
    server = RedisServer(tmp_path / "r", tls=certs).start()
    try:
        async def body():
            store = open_store(f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={certs['ca']}")
            try:
                _, got = await _roundtrip(store)
                assert got.token_ids == [1, 2, 3, 4]
            finally:
                await store.close()
        run(body())
    finally:
        server.stop()
