"""The K/V chunk store (specdec/kv/chunk_store.py): Redis and memory stores, the back-off of a store
that is down, credentials kept out of messages, and the background writer that never blocks.

Here the service tests; the other tiers' are in tests/unit/test_kv_store.py.
"""

from __future__ import annotations

import logging
import time
import uuid

import pytest
import redis

from specdec.errors import Unavailable
from specdec.kv.chunk_store import RedisChunkStore
from specdec.kv.writer import ChunkWriter
from tests.redis_server import RedisServer
from tests.unit.test_kv_store import digest, value


def namespace() -> str:
    return f"test:kv:{uuid.uuid4().hex}:"


class CountingConnections:
    """Counts how often a RedisChunkStore's client takes a connection (touches the network)."""

    def __init__(self, store: RedisChunkStore, monkeypatch):
        pool = store._client.connection_pool
        original = pool.get_connection
        self.calls = 0

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(pool, "get_connection", counted)


# ---------------------------------------------------------------- Redis store


def test_redis_round_trip_in_one_pipeline(own_redis, monkeypatch):
    store = RedisChunkStore(own_redis.url, ttl_s=60, namespace=namespace())
    try:
        names = ["a", "b", "c", "d"]
        store.put_many([(digest(n), value(n, 100_000 * (i + 1))) for i, n in enumerate(names)])
        before = own_redis.client().info("commandstats").get("cmdstat_get", {}).get("calls", 0)
        connections = CountingConnections(store, monkeypatch)
        got = store.get_many([digest("a"), digest("x"), digest("c"), digest("b"), digest("y"), digest("d")])
        after = own_redis.client().info("commandstats")["cmdstat_get"]["calls"]
        assert got == [value("a", 100_000), None, value("c", 300_000), value("b", 200_000), None,
                       value("d", 400_000)]
        assert after - before == 6 and connections.calls == 1  # six GETs sent as one pipeline
        stats = store.stats()
        assert (stats.hits, stats.misses, stats.bytes_read) == (4, 2, 1_000_000)
        assert (stats.chunks_written, stats.bytes_written) == (4, 1_000_000)
        assert store.healthy and store.ping()
    finally:
        store.close()


def test_redis_keys_and_ttl(redis_url):
    ns = namespace()
    whole = RedisChunkStore(redis_url, ttl_s=100, namespace=ns)
    fraction = RedisChunkStore(redis_url, ttl_s=2.5, namespace=ns)
    client = redis.Redis.from_url(redis_url)
    try:
        whole.put_many([(digest("a"), b"A")])
        fraction.put_many([(digest("b"), b"B")])
        assert client.get(ns + digest("a").hex()) == b"A"  # namespace + hex of the digest
        assert 90 < client.ttl(ns + digest("a").hex()) <= 100
        assert 2000 < client.pttl(ns + digest("b").hex()) <= 2500  # PX: neither EX 2 nor EX 3
        # another namespace does not see them
        other = RedisChunkStore(redis_url, ttl_s=100, namespace=namespace())
        assert other.get_many([digest("a"), digest("b")]) == [None, None]
        other.close()
    finally:
        whole.close()
        fraction.close()
        client.close()


def test_redis_down_backs_off_then_reads_again(own_redis, monkeypatch):
    store = RedisChunkStore(own_redis.url, ttl_s=60, namespace=namespace(), retry_s=0.2)
    keys = [digest("a"), digest("b")]
    try:
        store.put_many([(keys[0], b"A"), (keys[1], b"B")])
        assert store.get_many(keys) == [b"A", b"B"]
        own_redis.stop()

        started = time.monotonic()
        assert store.get_many(keys) == [None, None]
        assert time.monotonic() - started < 1.0
        assert not store.healthy and store.stats().read_errors == 1

        connections = CountingConnections(store, monkeypatch)
        started = time.monotonic()
        assert store.get_many(keys) == [None, None]  # during the back-off: no network at all
        with pytest.raises(Unavailable, match="unreachable"):
            store.put_many([(digest("c"), b"C")])
        assert time.monotonic() - started < 0.1
        assert connections.calls == 0
        stats = store.stats()
        assert (stats.read_errors, stats.reads_skipped, stats.hits) == (1, 1, 2)

        own_redis.start()  # append-only: the chunks survive the restart
        time.sleep(0.25)
        assert store.get_many(keys) == [b"A", b"B"]
        assert store.healthy and connections.calls == 1
        store.put_many([(digest("c"), b"C")])
        assert store.get_many([digest("c")]) == [b"C"]
    finally:
        store.close()


def test_wrong_password_is_unhealthy_and_never_shown(tmp_path, caplog):
    right, wrong = "right-pw-1", "wrong-pw-2"
    server = RedisServer(tmp_path / "r", extra=["--requirepass", right]).start()
    caplog.set_level(logging.DEBUG)
    messages = []
    try:
        bad = RedisChunkStore(f"redis://:{wrong}@127.0.0.1:{server.port}/0", ttl_s=60,
                              namespace=namespace(), retry_s=0.2)
        assert bad.get_many([digest("a")]) == [None]
        assert not bad.healthy and bad.stats().read_errors == 1
        with pytest.raises(Unavailable) as raised:
            bad.put_many([(digest("a"), b"A")])
        messages += [str(raised.value), repr(bad), bad.url]
        time.sleep(0.25)
        assert not bad.ping()
        bad.close()

        good = RedisChunkStore(f"redis://:{right}@127.0.0.1:{server.port}/0", ttl_s=60,
                               namespace=namespace())
        good.put_many([(digest("a"), b"A")])
        assert good.get_many([digest("a")]) == [b"A"] and good.healthy
        messages += [repr(good), good.url]
        good.close()
    finally:
        server.stop()
    messages += [r.getMessage() for r in caplog.records] + [caplog.text]
    assert any("unreachable or refused" in m for m in messages)
    assert "***@127.0.0.1" in bad.url
    for message in messages:
        assert right not in message and wrong not in message, message


def test_writer_over_redis(own_redis):
    store = RedisChunkStore(own_redis.url, ttl_s=60, namespace=namespace(), retry_s=0.2)
    writer = ChunkWriter(store, max_batch_items=4)
    names = [str(i) for i in range(10)]
    try:
        for name in names:
            assert writer.offer(digest(name), lambda name=name: value(name, 1 << 20), 1 << 20)
        assert writer.flush(10)
        assert store.get_many([digest(n) for n in names]) == [value(n, 1 << 20) for n in names]
        assert writer.stats().chunks_written == 10

        own_redis.stop()
        started = time.monotonic()
        for name in ("x", "y", "z"):
            assert writer.offer(digest(name), lambda: b"x", 1)
        assert writer.flush(5)
        assert time.monotonic() - started < 2.0
        assert writer.stats().writes_failed == 3 and not store.healthy
    finally:
        writer.close()
        store.close()
