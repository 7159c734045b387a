"""The Redis session store against a real redis-server: leases (one per request, renewed, taken over),
versioned appends, long sessions, TTL, auth, TLS.

Here the service tests; the other tiers' are in tests/unit/test_redis_store.py and
tests/e2e/test_redis_store.py and tests/process/test_redis_store.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from coordinator.sessions.redis_store import HOLDER_PREFIX, RedisSessionStore, _keys
from coordinator.sessions.session_store import Lease, Placement
from specdec.errors import FailedPrecondition, NotFound, SessionBusy


def run(coro):
    return asyncio.run(coro)


@contextlib.asynccontextmanager
async def _replicas(url: str, **options):
    """Two coordinators' stores on one Redis, closed at the end."""
    stores = [RedisSessionStore(url, **options) for _ in range(2)]
    try:
        yield stores
    finally:
        await asyncio.gather(*(store.close() for store in stores))


async def _roundtrip(store: RedisSessionStore):
    record = await store.create()
    lease = await store.acquire(record.session_id)
    leased = lease.record
    leased.token_ids += [1, 2, 3]
    leased.draft = Placement("d:1", 2)
    leased.stats = {"rounds": 4}
    await store.save(leased, lease)
    leased.token_ids += [4]
    await store.save(leased, lease)
    got = await store.get(record.session_id)
    await store.release(lease)
    return record, got


def test_roundtrip_and_append(redis_url):
    async def body():
        store = RedisSessionStore(redis_url, ttl_s=100)
        try:
            record, got = await _roundtrip(store)
            assert got.token_ids == [1, 2, 3, 4]
            assert (got.draft.address, got.draft.held, got.stats) == ("d:1", 2, {"rounds": 4})
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
            with pytest.raises(FailedPrecondition, match="taken over"):
                await b.save(stale, Lease(record.session_id, "not-the-lease", stale))
            await a.release(held)
            again = await b.acquire(record.session_id)
            # a's record is stale now: it may not append behind b's back
            again.record.token_ids.append(7)
            await b.save(again.record, again)
            held.record.token_ids.append(8)
            with pytest.raises(FailedPrecondition, match="changed by another writer"):
                await a.save(held.record, again)  # even with b's lease
            assert (await a.get(record.session_id)).token_ids == [7]
        finally:
            await a.close()
            await b.close()
    run(body())


def test_lease_expires_without_progress(redis_url):
    async def body():
        async with _replicas(redis_url, lease_ttl_s=0.2) as (a, b):
            record = await a.create()
            await a.acquire(record.session_id)
            await asyncio.sleep(0.4)
            await b.acquire(record.session_id)  # a stalled request does not block a session forever
    run(body())


def _as_if_killed(store: RedisSessionStore) -> None:
    """The store's coordinator stops without a goodbye: no more liveness refreshes, nothing released."""
    store._announcer.cancel()


def test_a_killed_coordinators_lease_is_taken_over_once_its_liveness_lapses(redis_url):
    async def body():
        async with _replicas(redis_url, lease_ttl_s=60, holder_ttl_s=0.6) as (a, b):
            record = await a.create()
            held = await a.acquire(record.session_id)
            _as_if_killed(a)
            with pytest.raises(SessionBusy, match="free in") as busy:
                await b.acquire(record.session_id)
            assert 0 < busy.value.retry_after_s <= 0.6
            await asyncio.sleep(busy.value.retry_after_s + 0.1)
            taken = await b.acquire(record.session_id)  # long before the 60 s lease would lapse
            taken.record.token_ids.append(5)
            await b.save(taken.record, taken)
            held.record.token_ids.append(6)  # the old holder, were it only cut off, writes nothing
            with pytest.raises(FailedPrecondition, match="taken over"):
                await a.save(held.record, held)
            assert (await b.get(record.session_id)).token_ids == [5]
    run(body())


def test_a_live_coordinators_lease_is_never_taken_over(redis_url):
    async def body():
        async with _replicas(redis_url, lease_ttl_s=60, holder_ttl_s=0.3) as (a, b):
            record = await a.create()
            await a.acquire(record.session_id)
            for _ in range(4):  # four liveness lifetimes: a keeps refreshing its key
                await asyncio.sleep(0.3)
                with pytest.raises(SessionBusy) as busy:
                    await b.acquire(record.session_id)
                assert 0 < busy.value.retry_after_s <= 0.3
    run(body())


def test_a_lease_without_a_coordinator_lasts_its_ttl(redis_url):
    """A lease written by a coordinator that keeps no liveness key (an older version) is never taken
    over; the busy error says when it lapses."""
    async def body():
        store = RedisSessionStore(redis_url, lease_ttl_s=60)
        client = store.client
        try:
            record = await store.create()
            await client.set(_keys(record.session_id)[2], "an-older-coordinators-lease", px=5000)
            with pytest.raises(SessionBusy) as busy:
                await store.acquire(record.session_id)
            assert 4 < busy.value.retry_after_s <= 5
            assert await client.get(_keys(record.session_id)[2]) == "an-older-coordinators-lease"
        finally:
            await store.close()
    run(body())


def test_closing_a_store_frees_its_sessions_at_once(redis_url):
    async def body():
        a = RedisSessionStore(redis_url, lease_ttl_s=60, holder_ttl_s=30)
        b = RedisSessionStore(redis_url, lease_ttl_s=60, holder_ttl_s=30)
        try:
            record = await a.create()
            await a.acquire(record.session_id)
            holder_key = HOLDER_PREFIX + a.holder_id
            assert await b.client.exists(holder_key)
            await a.close()
            assert not await b.client.exists(holder_key)
            await b.acquire(record.session_id)
        finally:
            await b.close()
    run(body())


def test_a_release_while_redis_is_down_is_made_when_it_is_back(own_redis):
    async def body():
        async with _replicas(own_redis.url, lease_ttl_s=60, holder_ttl_s=30, socket_timeout_s=1) as (a, b):
            record = await a.create()
            lease = await a.acquire(record.session_id)
            own_redis.stop()
            await a.release(lease)  # Redis is down: the release waits in the background
            own_redis.start()
            deadline = time.monotonic() + 5
            while await b.client.exists(_keys(record.session_id)[2]):
                assert time.monotonic() < deadline, "the lease was not released once Redis was back"
                await asyncio.sleep(0.1)
            await b.acquire(record.session_id)  # free long before the 60 s lease would lapse
    run(body())


# ---- one lease per request ----------------------------------------------------------------------

def test_two_requests_never_use_each_others_lease(redis_url):
    """One coordinator, two requests on one session (the first one's lease lapsed): each handle
    writes, renews and releases only with its own lease id."""
    async def body():
        store = RedisSessionStore(redis_url, lease_ttl_s=0.2)
        try:
            record = await store.create()
            lease_key = _keys(record.session_id)[2]
            first = await store.acquire(record.session_id)
            await asyncio.sleep(0.4)  # first stalls; its lease lapses
            with pytest.raises(FailedPrecondition, match="taken over.*lapsed after 0.2s"):
                await store.renew(first)
            second = await store.acquire(record.session_id)
            first.record.token_ids.append(1)
            with pytest.raises(FailedPrecondition, match="taken over.*another request holds"):
                await store.save(first.record, first)
            with pytest.raises(FailedPrecondition, match="taken over"):
                await store.renew(first)
            await store.release(first)  # does not end second's lease
            assert await store.client.get(lease_key) == second.lease_id
            with pytest.raises(FailedPrecondition, match="generating in another request"):
                await store.acquire(record.session_id)
            second.record.token_ids.append(2)
            await store.save(second.record, second)
            await store.renew(second)
            with pytest.raises(ValueError, match="saved under the lease"):
                await store.save(await store.create(), second)
            await store.release(second)
            assert await store.client.get(lease_key) is None
            assert (await store.get(record.session_id)).token_ids == [2]
        finally:
            await store.close()
    run(body())


def test_renewal_keeps_the_lease_past_its_ttl(redis_url):
    async def body():
        async with _replicas(redis_url, lease_ttl_s=0.3) as (a, b):
            await b.ping()  # connected first (a Cluster client loads its slot map): not on the lease's clock
            record = await a.create()
            lease = await a.acquire(record.session_id)
            for _ in range(10):  # 1 s, three lease lifetimes
                await asyncio.sleep(0.1)
                await a.renew(lease)
            with pytest.raises(FailedPrecondition, match="generating in another request"):
                await b.acquire(record.session_id)
    run(body())


# ---- long sessions ------------------------------------------------------------------------------

def test_saves_and_reloads_a_20000_token_session(redis_url):
    """Lua's unpack takes ~8,000 values: a long first save is pushed in chunks, atomically."""
    async def body():
        store = RedisSessionStore(redis_url)
        try:
            record = await store.create()
            lease = await store.acquire(record.session_id)
            tokens = [(i * 7919) % 151_936 for i in range(20_000)]
            lease.record.token_ids.extend(tokens)
            await store.save(lease.record, lease)
            lease.record.token_ids.extend(tokens[:9_000])
            await store.save(lease.record, lease)
            await store.release(lease)
            assert (await store.get(record.session_id)).token_ids == tokens + tokens[:9_000]
        finally:
            await store.close()
    run(body())
