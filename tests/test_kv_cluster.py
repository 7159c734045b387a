"""The K/V chunk store on a Redis Cluster (redis+cluster://): three primaries on loopback, the
chunks' keys spread over their hash slots, read back with one pipeline of GETs per node into
reused buffers, checked and decoded bit for bit."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest
import redis
import torch
from redis.connection import ConnectionPool

from specdec.kv.chunk_store import RedisChunkStore, open_chunk_store
from specdec.kv.chunks import HEADER_BYTES, ChunkLayout, chunk_keys, chunk_view, encode_chunk
from tests.redis_server import RedisServer, free_port

pytestmark = pytest.mark.process

LAYOUT = ChunkLayout(layers=2, kv_heads=2, head_dim=8, dtype=torch.float64, tokens=16)


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is a port too, and free."""
    for _ in range(200):
        port = free_port()
        if port + 10000 < 65536:
            try:
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port + 10000))
                return port
            except OSError:
                pass
    raise RuntimeError("no free port pair for a cluster node")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Three cluster-enabled redis-servers joined as a cluster with no replicas: their ports."""
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli is not installed (apt-get install redis-tools)")
    root = tmp_path_factory.mktemp("cluster")
    servers = []
    try:
        for i in range(3):
            servers.append(RedisServer(root / str(i), port=cluster_port(), extra=[
                "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{i}.conf",
                "--cluster-node-timeout", "2000", "--appendonly", "no"]).start())
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{s.port}" for s in servers],
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + 30
        while any(s.client().cluster("info")["cluster_state"] != "ok" for s in servers):
            assert time.monotonic() < deadline, "the cluster did not come up"
            time.sleep(0.1)
        yield [s.port for s in servers]
    finally:
        for server in servers:
            server.stop()


def stored(count: int) -> tuple[list[bytes], list[torch.Tensor], list[bytes]]:
    keys = chunk_keys(b"\x07" * 32, list(range(count * LAYOUT.tokens)), LAYOUT.tokens)
    chunks = [torch.randn(LAYOUT.shape, dtype=torch.float64) for _ in keys]
    return keys, chunks, [encode_chunk(c, k) for c, k in zip(chunks, keys)]


def test_chunks_spread_over_the_primaries_and_read_per_node(cluster, monkeypatch):
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in cluster[:2])  # any nodes will do
    store = open_chunk_store(url, ttl_s=60)
    assert isinstance(store, RedisChunkStore)
    keys, chunks, values = stored(12)
    try:
        store.put_many(list(zip(keys, values)))
        held = [redis.Redis(port=p).dbsize() for p in cluster]
        assert sum(held) == 12 and sum(1 for n in held if n) >= 2, held  # spread, not all on one

        gets = [redis.Redis(port=p).info("commandstats").get("cmdstat_get", {}).get("calls", 0) for p in cluster]
        taken = []
        original = ConnectionPool.get_connection

        def counted(pool, *args, **kwargs):
            taken.append(pool.connection_kwargs["port"])
            return original(pool, *args, **kwargs)

        monkeypatch.setattr(ConnectionPool, "get_connection", counted)
        buffers = [memoryview(bytearray(HEADER_BYTES + LAYOUT.nbytes)) for _ in range(2)]
        missing = keys[5][::-1]  # a key nobody wrote, in the middle
        order = keys[:5] + [missing] + keys[5:]
        got = []
        for key, value in zip(order, store.stream(order, buffers)):
            got.append(None if value is None else chunk_view(value, key, LAYOUT).clone())
        monkeypatch.undo()
        assert got[5] is None
        for chunk, out in zip(chunks, got[:5] + got[6:]):
            assert torch.equal(chunk, out)
        assert sorted(taken) == sorted(set(taken)) and len(taken) >= 2  # one pipeline per node
        after = [redis.Redis(port=p).info("commandstats")["cmdstat_get"]["calls"] for p in cluster]
        assert sum(after) - sum(gets) == 13
        assert store.get_many([keys[0], missing]) == [values[0], None]
        stats = store.stats()
        assert (stats.hits, stats.misses, stats.read_errors) == (13, 2, 0) and store.healthy
    finally:
        store.close()


def test_a_stream_stopped_early_leaves_the_connections_usable(cluster):
    store = RedisChunkStore("redis+cluster://127.0.0.1:%d" % cluster[0], ttl_s=60, namespace="early:")
    keys, _, values = stored(8)
    try:
        store.put_many(list(zip(keys, values)))
        buffers = [memoryview(bytearray(HEADER_BYTES + LAYOUT.nbytes)) for _ in range(2)]
        values_read = store.stream(keys, buffers)
        next(values_read)
        values_read.close()  # replies left unread: those connections are closed, not reused
        assert store.get_many(keys) == values
    finally:
        store.close()


def test_a_cluster_that_is_down_costs_misses_not_errors():
    store = RedisChunkStore(f"redis+cluster://127.0.0.1:{free_port()}", ttl_s=60, retry_s=60)
    keys, _, _ = stored(2)
    assert store.get_many(keys) == [None, None] and not store.healthy
    assert list(store.stream(keys)) == [None, None]  # backing off: no network
    assert store.stats().reads_skipped == 1
    store.close()
