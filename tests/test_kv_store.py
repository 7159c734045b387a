"""The K/V chunk store (specdec/kv/chunk_store.py): Redis and memory stores, the back-off of a store
that is down, credentials kept out of messages, and the background writer that never blocks."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid

import pytest
import redis

from specdec.errors import Unavailable
from specdec.kv.chunk_store import ChunkStoreStats, MemoryChunkStore, RedisChunkStore, open_chunk_store
from specdec.kv.writer import ChunkWriter
from specdec.logtag import redacted_url
from tests.redis_server import RedisServer


def digest(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def value(name: str, size: int = 1000) -> bytes:
    """Distinct bytes per name, so a value read under the wrong key shows."""
    seed = hashlib.sha256(name.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def namespace() -> str:
    return f"test:kv:{uuid.uuid4().hex}:"


class StalledStore(MemoryChunkStore):
    """A memory store whose put_many waits until `release` is set; records each batch's keys."""

    def __init__(self):
        super().__init__()
        self.entered = threading.Event()  # set once a put_many is waiting
        self.release = threading.Event()
        self.batches: list[list[bytes]] = []

    def put_many(self, items):
        self.entered.set()
        assert self.release.wait(10), "the test never released the stalled store"
        self.batches.append([k for k, _ in items])
        super().put_many(items)


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


# ---------------------------------------------------------------- memory store, URLs


@pytest.mark.unit
def test_memory_store_round_trip_and_stats():
    store = MemoryChunkStore()
    a, b, c = digest("a"), digest("b"), digest("c")
    store.put_many([(a, value("a")), (c, value("c", 3000))])
    assert store.get_many([b, a, c, b]) == [None, value("a"), value("c", 3000), None]
    assert store.get_many([]) == []
    assert store.stats() == ChunkStoreStats(hits=2, misses=2, bytes_read=4000,
                                            chunks_written=2, bytes_written=4000)
    with pytest.raises(TypeError, match="bytes digests"):
        store.get_many(["a"])


@pytest.mark.unit
def test_memory_store_ttl_and_byte_bound():
    store = MemoryChunkStore(ttl_s=0.05)
    store.put_many([(digest("a"), b"x")])
    assert store.get_many([digest("a")]) == [b"x"]
    time.sleep(0.1)
    assert store.get_many([digest("a")]) == [None]

    bounded = MemoryChunkStore(max_bytes=2500)
    bounded.put_many([(digest(n), value(n)) for n in "abc"])  # 3000 bytes: "a" goes
    assert bounded.get_many([digest(n) for n in "abc"]) == [None, value("b"), value("c")]
    bounded.get_many([digest("b")])  # "b" is now the most recently used
    bounded.put_many([(digest("d"), value("d"))])
    assert bounded.get_many([digest(n) for n in "bcd"]) == [value("b"), None, value("d")]


@pytest.mark.unit
def test_open_chunk_store_schemes():
    assert open_chunk_store("", ttl_s=10) is None
    assert isinstance(open_chunk_store("memory://", ttl_s=10), MemoryChunkStore)
    for url in ("redis://127.0.0.1:1/0", "rediss://:pw@example.com:6380/1", "unix:///tmp/r.sock"):
        store = open_chunk_store(url, ttl_s=10)  # builds without connecting
        assert isinstance(store, RedisChunkStore)
        store.close()
    for url in ("memory", "http://example.com", "redis:/x", "/tmp/r.sock"):
        with pytest.raises(ValueError, match=r"memory://.*redis://, rediss:// or unix://"):
            open_chunk_store(url, ttl_s=10)
    with pytest.raises(ValueError) as raised:
        open_chunk_store("https://user:hunter2@example.com/0", ttl_s=10)
    assert "hunter2" not in str(raised.value) and "https://***@example.com/0" in str(raised.value)


@pytest.mark.unit
def test_redis_store_rejects_bad_urls_without_showing_the_password():
    with pytest.raises(ValueError, match=r"the scheme 'http://'.*redis://, rediss://") as raised:
        RedisChunkStore("http://:hunter2@example.com:6379/0", ttl_s=10)
    assert "hunter2" not in str(raised.value)
    with pytest.raises(ValueError, match="no scheme"):
        RedisChunkStore("example.com:6379", ttl_s=10)
    with pytest.raises(ValueError, match="invalid chunk store URL") as raised:
        RedisChunkStore("redis://:hunter2@example.com:notaport/0", ttl_s=10)
    assert "hunter2" not in str(raised.value)
    with pytest.raises(ValueError, match="TTL must be positive"):
        RedisChunkStore("redis://127.0.0.1:1/0", ttl_s=0)


@pytest.mark.unit
def test_redacted_url():
    assert redacted_url("redis://:pw@h:6379/0") == "redis://***@h:6379/0"
    assert redacted_url("rediss://user:p@ss@h/0") == "rediss://***@h/0"
    assert redacted_url("redis://h:6379/0") == "redis://h:6379/0"
    assert redacted_url("unix:///tmp/r.sock?db=1&password=pw") == "unix:///tmp/r.sock?db=1&password=***"
    assert redacted_url("user:pw@h") == "***"


# ---------------------------------------------------------------- Redis store


@pytest.mark.service
def test_redis_round_trip_in_one_mget(own_redis):
    store = RedisChunkStore(own_redis.url, ttl_s=60, namespace=namespace())
    try:
        names = ["a", "b", "c", "d"]
        store.put_many([(digest(n), value(n, 100_000 * (i + 1))) for i, n in enumerate(names)])
        before = own_redis.client().info("commandstats").get("cmdstat_mget", {}).get("calls", 0)
        got = store.get_many([digest("a"), digest("x"), digest("c"), digest("b"), digest("y"), digest("d")])
        after = own_redis.client().info("commandstats")["cmdstat_mget"]["calls"]
        assert got == [value("a", 100_000), None, value("c", 300_000), value("b", 200_000), None,
                       value("d", 400_000)]
        assert after - before == 1
        stats = store.stats()
        assert (stats.hits, stats.misses, stats.bytes_read) == (4, 2, 1_000_000)
        assert (stats.chunks_written, stats.bytes_written) == (4, 1_000_000)
        assert store.healthy and store.ping()
    finally:
        store.close()


@pytest.mark.service
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


@pytest.mark.service
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


@pytest.mark.service
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


# ---------------------------------------------------------------- the writer


@pytest.mark.unit
def test_writer_never_blocks_and_skips_when_full():
    store = StalledStore()
    writer = ChunkWriter(store, max_pending=8, max_batch_items=4)
    threads = set()

    def producer(name):
        def produce():
            threads.add(threading.current_thread().name)
            return value(name)
        return produce

    try:
        started = time.monotonic()
        assert writer.offer(digest("0"), producer("0"), nbytes=1000)
        assert store.entered.wait(5)  # the writer holds chunk 0 in a stalled put_many
        accepted = [writer.offer(digest(str(i)), producer(str(i)), nbytes=1000) for i in range(1, 20)]
        assert time.monotonic() - started < 0.5  # while the store stalls
        assert accepted == [True] * 7 + [False] * 12  # the chunk in flight counts as pending
        assert writer.stats().writes_skipped == 12 and writer.pending == 8
        assert not writer.flush(0.1)

        store.release.set()
        assert writer.flush(5)
        assert writer.pending == 0
        assert store.get_many([digest(str(i)) for i in range(8)]) == [value(str(i)) for i in range(8)]
        stats = writer.stats()
        assert (stats.chunks_written, stats.bytes_written, stats.writes_failed) == (8, 8000, 0)
        assert all(len(batch) <= 4 for batch in store.batches)
        assert threads == {"chunk-writer"}  # produce() ran on the writer thread only
        assert writer.offer(digest("late"), producer("late"), nbytes=1000)  # room again
        assert writer.flush(5) and store.get_many([digest("late")]) == [value("late")]
    finally:
        store.release.set()
        writer.close()


@pytest.mark.unit
def test_writer_byte_bounds():
    store = StalledStore()
    writer = ChunkWriter(store, max_pending_bytes=1000, max_batch_bytes=500)
    try:
        assert writer.offer(digest("0"), lambda: value("0", 300), nbytes=300)
        assert store.entered.wait(5)  # in flight
        accepted = [writer.offer(digest(str(i)), lambda i=i: value(str(i), 300), nbytes=300)
                    for i in range(1, 5)]
        assert accepted == [True, True, False, False]  # 900 bytes held, 1200 would not fit
        store.release.set()
        assert writer.flush(5)
        assert [len(b) for b in store.batches] == [1, 1, 1]  # ≤ 500 bytes a batch
        # the bytes written no longer count: three more fit
        store.release.clear()
        assert [writer.offer(digest(f"again{i}"), lambda: b"x", nbytes=300) for i in range(4)] == \
            [True, True, True, False]
        store.release.set()
        assert writer.flush(5)
        # a chunk larger than the whole bound still goes through an empty queue
        assert writer.offer(digest("big"), lambda: b"x" * 5000, nbytes=5000)
        assert writer.flush(5) and store.get_many([digest("big")]) == [b"x" * 5000]
    finally:
        store.release.set()
        writer.close()


@pytest.mark.unit
def test_writer_deduplicates_queued_and_recent_keys():
    store = StalledStore()
    writer = ChunkWriter(store, recent_s=0.2)
    produced = []

    def produce():
        produced.append(1)
        return b"A"

    try:
        assert writer.offer(digest("a"), produce, 1)
        assert writer.offer(digest("a"), produce, 1)  # queued or in flight
        store.release.set()
        assert writer.flush(5)
        assert writer.offer(digest("a"), produce, 1)  # written recently
        assert writer.flush(5)
        stats = writer.stats()
        assert (stats.writes_deduplicated, stats.chunks_written, len(produced)) == (2, 1, 1)
        time.sleep(0.25)  # no longer recent: written again (refreshing its TTL)
        assert writer.offer(digest("a"), produce, 1) and writer.flush(5)
        assert (writer.stats().chunks_written, len(produced)) == (2, 2)
    finally:
        store.release.set()
        writer.close()


@pytest.mark.unit
def test_writer_survives_produce_errors(caplog):
    store = MemoryChunkStore()
    writer = ChunkWriter(store)

    def broken():
        raise RuntimeError("codec bug")

    try:
        assert writer.offer(digest("a"), broken, 10)
        assert writer.offer(digest("b"), lambda: b"B", 1)
        assert writer.offer(digest("c"), lambda: "not bytes", 1)
        assert writer.flush(5)
        assert writer.offer(digest("d"), lambda: b"D", 1) and writer.flush(5)
        assert store.get_many([digest(n) for n in "abcd"]) == [None, b"B", None, b"D"]
        stats = writer.stats()
        assert (stats.writes_failed, stats.chunks_written) == (2, 2)
        assert "codec bug" in caplog.text
        # a failed chunk is not "recent": a later offer writes it
        assert writer.offer(digest("a"), lambda: b"A", 1) and writer.flush(5)
        assert store.get_many([digest("a")]) == [b"A"]
    finally:
        writer.close()


@pytest.mark.unit
def test_writer_drops_what_the_store_fails_and_never_retries():
    class FlakyStore(MemoryChunkStore):
        def __init__(self):
            super().__init__()
            self.fail = True
            self.calls = 0

        def put_many(self, items):
            self.calls += 1
            if self.fail:
                raise Unavailable("chunk store is down")
            super().put_many(items)

    store = FlakyStore()
    writer = ChunkWriter(store)
    try:
        assert writer.offer(digest("a"), lambda: b"A", 1) and writer.flush(5)
        assert (store.calls, writer.stats().writes_failed) == (1, 1)
        time.sleep(0.1)
        assert store.calls == 1  # dropped, not retried
        store.fail = False
        assert writer.offer(digest("b"), lambda: b"B", 1) and writer.flush(5)
        assert store.get_many([digest("a"), digest("b")]) == [None, b"B"]
    finally:
        writer.close()


@pytest.mark.unit
def test_writer_does_not_produce_while_the_store_backs_off():
    class BackingOff(MemoryChunkStore):
        def available(self):
            return False

    store = BackingOff()
    writer = ChunkWriter(store)
    produced = []
    try:
        assert writer.offer(digest("a"), lambda: produced.append(1) or b"A", 1) and writer.flush(5)
        assert produced == [] and writer.stats().writes_failed == 1 and len(store) == 0
    finally:
        writer.close()


@pytest.mark.unit
def test_writer_close_stops_the_thread_even_when_the_store_stalls():
    store = StalledStore()
    writer = ChunkWriter(store, max_batch_items=1)
    try:
        for name in "abc":
            assert writer.offer(digest(name), lambda: b"x", 1)
        started = time.monotonic()
        writer.close(timeout_s=0.2)
        assert time.monotonic() - started < 1.0
        assert not writer.offer(digest("d"), lambda: b"x", 1)  # closed
        stats = writer.stats()
        assert (stats.writes_failed, stats.writes_skipped) == (2, 1)  # "a" is in flight
    finally:
        store.release.set()
    writer._thread.join(5)
    assert not writer._thread.is_alive()
    assert store.get_many([digest("a")]) == [b"x"]  # the batch in flight completed

    idle = ChunkWriter(MemoryChunkStore())
    idle.close()
    assert not idle._thread.is_alive()


@pytest.mark.service
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
