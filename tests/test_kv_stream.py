"""The restore path of K/V chunks: `chunk_view` (a stored value checked and viewed as a tensor
without a copy) and `RedisChunkStore.stream` (one pipeline of GETs, each value received into
the caller's reused buffers on a reader thread), on a real redis-server."""

from __future__ import annotations

import struct
import uuid

import pytest
import redis
import torch

from specdec.kv.chunk_store import RedisChunkStore
from specdec.kv.chunks import HEADER_BYTES, LAYOUT_VERSION, ChunkError, ChunkLayout, chunk_keys, chunk_view
from specdec.kv.chunks import decode_chunk, encode_chunk

LAYOUT = ChunkLayout(layers=2, kv_heads=1, head_dim=4, dtype=torch.float64, tokens=8)
MODEL = b"\x05" * 32


def chunks(count: int, seed: int = 0) -> tuple[list[bytes], list[torch.Tensor], list[bytes]]:
    gen = torch.Generator().manual_seed(seed)
    keys = chunk_keys(MODEL, list(range(count * LAYOUT.tokens)), LAYOUT.tokens)
    kvs = [torch.randn(LAYOUT.shape, dtype=torch.float64, generator=gen) for _ in keys]
    return keys, kvs, [encode_chunk(kv, key) for kv, key in zip(kvs, keys)]


def buffers(count: int = 2) -> list[memoryview]:
    return [memoryview(bytearray(HEADER_BYTES + LAYOUT.nbytes)) for _ in range(count)]


@pytest.mark.unit
def test_chunk_view_shares_the_buffer_and_equals_decode():
    keys, kvs, values = chunks(1)
    buffer = bytearray(values[0])
    view = chunk_view(buffer, keys[0], LAYOUT)  # [layers, 2, kv_heads, tokens, head_dim]
    assert torch.equal(view, kvs[0]) and torch.equal(view, decode_chunk(values[0], keys[0], LAYOUT))
    buffer[HEADER_BYTES:HEADER_BYTES + 8] = struct.pack("<d", 42.0)
    assert view.view(-1)[0].item() == 42.0  # no copy: the tensor is the buffer
    assert torch.equal(chunk_view(values[0], keys[0], LAYOUT), kvs[0])  # read-only bytes: a copy


@pytest.mark.unit
@pytest.mark.parametrize("version", [0, LAYOUT_VERSION + 1, 0xFFFF])
def test_a_chunk_of_another_format_version_is_refused_never_misread(version):
    keys, _, values = chunks(1)
    other = bytearray(values[0])
    struct.pack_into("<H", other, 4, version)  # the version field follows the 4-byte magic
    for read in (chunk_view, decode_chunk):
        with pytest.raises(ChunkError) as raised:
            read(other, keys[0], LAYOUT)
        assert raised.value.reason == "version"


@pytest.fixture
def store(redis_url):
    store = RedisChunkStore(redis_url, ttl_s=60, namespace=f"test:kv:{uuid.uuid4().hex}:")
    yield store
    store.close()


@pytest.mark.service
def test_values_stream_through_the_callers_buffers_in_turn(store):
    keys, kvs, values = chunks(5)
    store.put_many(list(zip(keys, values)))
    staging = buffers()
    seen = []
    for i, (key, value) in enumerate(zip(keys, store.stream(keys, staging))):
        assert value.obj is staging[i % 2].obj  # received into the caller's memory, no copy
        seen.append(chunk_view(value, key, LAYOUT).clone())
    assert all(torch.equal(a, b) for a, b in zip(seen, kvs))
    small = [memoryview(bytearray(10))] * 2  # too small: each value in memory of its own
    assert [bytes(v) for v in store.stream(keys[:2], small)] == values[:2]
    assert store.stats().read_errors == 0 and store.healthy


@pytest.mark.service
def test_an_error_reply_ends_the_read_with_misses_and_no_back_off(store, redis_url):
    keys, _, values = chunks(3)
    store.put_many(list(zip(keys, values)))
    redis.Redis.from_url(redis_url).delete(store._name(keys[1]))
    redis.Redis.from_url(redis_url).rpush(store._name(keys[1]), "a list")  # GET answers WRONGTYPE
    assert store.get_many(keys) == [values[0], None, None]
    assert store.stats().read_errors == 1 and store.healthy
    assert store.get_many([keys[2], keys[0]]) == [values[2], values[0]]  # the connection is fine


@pytest.mark.service
def test_stopping_early_lets_go_of_the_connection(store):
    keys, _, values = chunks(6)
    store.put_many(list(zip(keys, values)))
    for _ in range(3):
        stream = store.stream(keys, buffers())
        assert bytes(next(stream)) == values[0]
        stream.close()  # five replies unread: that connection is closed, never reused
        assert store.get_many(keys[3:]) == values[3:]


@pytest.mark.service
def test_resp3_nulls_are_misses(redis_url):
    url = redis_url + ("&" if "?" in redis_url else "?") + "protocol=3"
    keys, _, values = chunks(2)
    with RedisChunkStore(url, ttl_s=60, namespace=f"test:kv:{uuid.uuid4().hex}:") as store:
        store.put_many([(keys[1], values[1])])
        assert store.get_many(keys) == [None, values[1]]


@pytest.mark.service
def test_the_read_benchmark_reads_both_paths(redis_url):
    from bench.kv_read import measure, table

    rows = measure(redis_url, lambda size: ChunkLayout(2, 1, 4, torch.bfloat16, size), [70], [16, 32], 1)
    assert [(r["tokens"], r["chunk_tokens"], r["chunks"]) for r in rows] == [(70, 16, 4), (70, 32, 2)]
    assert rows[0]["bytes"] == 4 * (HEADER_BYTES + 2 * 2 * 1 * 16 * 4 * 2)
    assert all(r[f"{p}_mb_s"] > 0 for r in rows for p in ("mget", "stream", "read"))
    assert "speed-up" in table(rows)
