"""Every session-store test against a Redis Cluster of 3 primaries (each with a replica) and a
Sentinel-watched primary with 2 replicas; hash-tagged keys; --session-durability's WAIT;
the recording stream on a Cluster; old untagged sessions renamed on first use."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from coordinator.recording import StreamSink
from coordinator.sessions.durability import Durability, parse_durability
from coordinator.sessions.redis_store import HOLDER_PREFIX, RedisSessionStore, _keys, _legacy_keys
from coordinator.sessions.stores import open_store
from specdec.errors import Unavailable
from specdec.records import read_stream
from tests.service import test_redis_store as store_tests
from tests.redis_ha import ClusterGroup, SentinelGroup


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    group = ClusterGroup(tmp_path_factory.mktemp("cluster")).start()
    yield group
    group.stop()


@pytest.fixture(scope="module")
def sentinel(tmp_path_factory):
    group = SentinelGroup(tmp_path_factory.mktemp("sentinel")).start()
    yield group
    group.stop()


def _store_tests():
    """The tests of tests/service/test_redis_store.py that need only a Redis URL: all of the store's own."""
    return [test for name, test in vars(store_tests).items()
            if name.startswith("test_") and list(inspect.signature(test).parameters) == ["redis_url"]]


@pytest.mark.parametrize("test", _store_tests(), ids=lambda test: test.__name__[5:])
def test_store_on_a_cluster(test, cluster):
    test(cluster.url)


@pytest.mark.parametrize("test", _store_tests(), ids=lambda test: test.__name__[5:])
def test_store_on_sentinel(test, sentinel):
    test(sentinel.url)


def test_every_store_test_is_run_on_each_topology():
    assert len(_store_tests()) >= 8


def test_a_sessions_keys_share_one_slot_and_liveness_keys_are_reachable(cluster):
    async def body():
        store = RedisSessionStore(cluster.url)
        try:
            record = await store.create()
            lease = await store.acquire(record.session_id)
            slots = {await store.client.cluster_keyslot(key) for key in _keys(record.session_id)}
            assert len(slots) == 1
            for node in cluster.servers[:3]:  # any node leads to the liveness key (MOVED followed)
                other = RedisSessionStore(f"redis+cluster://127.0.0.1:{node.port}")
                try:
                    assert await other.client.exists(HOLDER_PREFIX + store.holder_id)
                finally:
                    await other.close()
            await store.release(lease)
        finally:
            await store.close()
    asyncio.run(body())


async def _save_some(store: RedisSessionStore) -> RedisSessionStore:
    record = await store.create()
    lease = await store.acquire(record.session_id)
    lease.record.token_ids += [7, 8, 9]
    try:
        await store.save(lease.record, lease)
    finally:
        await store.release(lease)
    return lease.record


@pytest.mark.parametrize("topology", ["cluster", "sentinel"])
def test_durable_commits_wait_for_replicas(topology, request):
    url = request.getfixturevalue(topology).url
    replicas = 1 if topology == "cluster" else 2  # each cluster primary has one replica

    async def body():
        enough = RedisSessionStore(url, durability=Durability(replicas, 2000))
        too_many = RedisSessionStore(url, durability=Durability(replicas + 1, 100))
        try:
            saved = await _save_some(enough)
            assert (await enough.get(saved.session_id)).token_ids == [7, 8, 9]
            with pytest.raises(Unavailable, match=f"reached {replicas} of the {replicas + 1} replica") as short:
                await _save_some(too_many)
            assert "retry" in str(short.value)
        finally:
            await asyncio.gather(enough.close(), too_many.close())
    asyncio.run(body())


def test_durability_settings_are_read_or_refused_precisely():
    assert parse_durability("none") == Durability()
    assert parse_durability("replicas=1") == Durability(1, 1000)
    assert parse_durability(" Replicas=2, timeout_ms=50 ") == Durability(2, 50)
    assert str(Durability(1, 20)) == "replicas=1,timeout_ms=20" and str(Durability()) == "none"
    for bad, says in [("replicas=0", ">= 1"), ("replicas=x", "whole number"), ("timeout_ms=5", "names no replicas"),
                      ("always", "is not 'none'"), ("replicas=1,replicas=2", "is not 'none'")]:
        with pytest.raises(ValueError, match=says):
            parse_durability(bad)
    with pytest.raises(ValueError, match="needs a Redis session store"):
        open_store("memory", durability=Durability(1))
    with pytest.raises(ValueError, match="a sentinel URL ends with /SERVICE_NAME") as bad_url:
        open_store("redis+sentinel://:pw@h:26379")
    assert "pw" not in str(bad_url.value)


def test_the_recording_stream_on_a_cluster(cluster):
    sink = StreamSink(cluster.url, "specdec:records:test", max_len=10)
    try:
        assert sink.write(b'{"a": 1}\n') and sink.write(b'{"a": 2}\n')
    finally:
        sink.close()
    with pytest.raises(ValueError, match="not a Redis URL"):
        StreamSink("memory", "k", 10)
    assert list(read_stream(cluster.url, "specdec:records:test")) == []  # no records, but read


def test_sessions_of_the_untagged_layout_are_renamed_on_first_use(own_redis):
    async def body():
        store = RedisSessionStore(own_redis.url)
        try:
            fresh = await store.create()
            meta, _, _ = _keys(fresh.session_id)
            old_meta, old_tokens, _ = _legacy_keys("older")
            await store.client.hset(old_meta, mapping=await store.client.hgetall(meta))
            await store.client.rpush(old_tokens, 4, 5)
            assert (await store.get("older")).token_ids == [4, 5]
            lease = await store.acquire("older")
            lease.record.token_ids.append(6)
            await store.save(lease.record, lease)
            assert await store.client.lrange(_keys("older")[1], 0, -1) == ["4", "5", "6"]
            assert not await store.client.exists(old_meta, old_tokens)
        finally:
            await store.close()
    asyncio.run(body())
