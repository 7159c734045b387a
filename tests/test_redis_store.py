"""The Redis session store against a real redis-server: leases, versioned appends, TTL, auth, TLS."""

from __future__ import annotations

import asyncio
import subprocess

import pytest

from coordinator.redis_store import RedisSessionStore, _keys
from coordinator.store import open_store
from specdec.errors import FailedPrecondition, NotFound, Unavailable
from tests.redis_server import RedisServer


def run(coro):
    return asyncio.run(coro)


async def _roundtrip(store: RedisSessionStore):
    record = await store.create()
    leased = await store.acquire(record.session_id)
    leased.token_ids += [1, 2, 3]
    leased.draft_address, leased.draft_held = "d:1", 2
    leased.stats = {"rounds": 4}
    await store.save(leased)
    leased.token_ids += [4]
    await store.save(leased)
    got = await store.get(record.session_id)
    await store.release(record.session_id)
    return record, got


def test_roundtrip_and_append(redis_url):
    async def body():
        store = RedisSessionStore(redis_url, ttl_s=100)
        try:
            record, got = await _roundtrip(store)
            assert got.token_ids == [1, 2, 3, 4]
            assert (got.draft_address, got.draft_held, got.stats) == ("d:1", 2, {"rounds": 4})
            ttl = await store.client.pttl(_keys(record.session_id)[1])
            assert 0 < ttl <= 100_000
            assert await store.delete(record.session_id)
            with pytest.raises(NotFound):
                await store.get(record.session_id)
        finally:
            await store.close()
    run(body())


def test_lease_is_exclusive_across_stores(redis_url):
    """Two coordinator replicas share one Redis: only one request may write a session."""
    async def body():
        a, b = RedisSessionStore(redis_url), RedisSessionStore(redis_url)
        try:
            record = await a.create()
            held = await a.acquire(record.session_id)
            with pytest.raises(FailedPrecondition, match="generating in another request"):
                await b.acquire(record.session_id)
            # b cannot write without the lease, even with a loaded record
            stale = await b.get(record.session_id)
            stale.token_ids.append(9)
            with pytest.raises(FailedPrecondition, match="lost its lease"):
                await b.save(stale)
            await a.release(record.session_id)
            again = await b.acquire(record.session_id)
            # a's record is stale now: it may not append behind b's back
            again.token_ids.append(7)
            await b.save(again)
            a._leases[record.session_id] = b._leases[record.session_id]  # even with the lease id
            held.token_ids.append(8)
            with pytest.raises(FailedPrecondition, match="changed by another writer"):
                await a.save(held)
            assert (await a.get(record.session_id)).token_ids == [7]
        finally:
            await a.close()
            await b.close()
    run(body())


def test_lease_expires_without_progress(redis_url):
    async def body():
        a = RedisSessionStore(redis_url, lease_ttl_s=0.2)
        b = RedisSessionStore(redis_url, lease_ttl_s=0.2)
        try:
            record = await a.create()
            await a.acquire(record.session_id)
            await asyncio.sleep(0.4)
            await b.acquire(record.session_id)  # a stalled request does not block a session forever
        finally:
            await a.close()
            await b.close()
    run(body())


def test_unreachable_redis_is_unavailable_with_a_clear_message():
    async def body():
        store = RedisSessionStore("redis://:secret@127.0.0.1:1/0", socket_timeout_s=0.5)
        try:
            with pytest.raises(Unavailable) as info:
                await store.create()
            assert "127.0.0.1:1" in str(info.value) and "secret" not in str(info.value)
        finally:
            await store.close()
    run(body())


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


def test_open_store_rejects_unknown_scheme():
    with pytest.raises(ValueError, match="unsupported --session-store"):
        open_store("postgres://x")
