"""The Redis session store against a real redis-server: leases (one per request, renewed, taken over),
versioned appends, long sessions, TTL, auth, TLS."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import threading
import time

import grpc
import pytest
import redis

from coordinator.sessions.redis_store import HOLDER_PREFIX, RedisSessionStore, _keys
from coordinator.sessions.memory_store import MemorySessionStore
from coordinator.sessions.session_store import Lease, Placement
from coordinator.sessions.stores import open_store
from specdec_cli import tiny
from specdec.errors import FailedPrecondition, NotFound, SessionBusy, Unavailable
from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster
from tests.redis_server import RedisServer


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


@pytest.mark.service
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


@pytest.mark.service
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


@pytest.mark.service
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


@pytest.mark.service
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


@pytest.mark.service
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


@pytest.mark.service
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


@pytest.mark.service
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


@pytest.mark.service
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


@pytest.mark.unit
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


@pytest.mark.process
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


@pytest.mark.process
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


@pytest.mark.unit
def test_open_store_rejects_unknown_scheme():
    with pytest.raises(ValueError, match="unsupported --session-store"):
        open_store("postgres://x")


# ---- one lease per request ----------------------------------------------------------------------

@pytest.mark.service
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


@pytest.mark.unit
def test_memory_store_leases_are_per_request():
    async def body():
        store = MemorySessionStore()
        record = await store.create()
        first = await store.acquire(record.session_id)
        await store.release(first)
        second = await store.acquire(record.session_id)
        first.record.token_ids.append(1)
        with pytest.raises(FailedPrecondition, match="taken over"):
            await store.save(first.record, first)
        with pytest.raises(FailedPrecondition, match="taken over"):
            await store.renew(first)
        await store.release(first)  # a stale handle releases nothing
        with pytest.raises(FailedPrecondition, match="generating in another request"):
            await store.acquire(record.session_id)
        second.record.token_ids.append(2)
        await store.save(second.record, second)
        await store.renew(second)
        await store.release(second)
        assert (await store.get(record.session_id)).token_ids == [2]
    run(body())


@pytest.mark.service
def test_renewal_keeps_the_lease_past_its_ttl(redis_url):
    async def body():
        async with _replicas(redis_url, lease_ttl_s=0.3) as (a, b):
            record = await a.create()
            lease = await a.acquire(record.session_id)
            for _ in range(10):  # 1 s, three lease lifetimes
                await asyncio.sleep(0.1)
                await a.renew(lease)
            with pytest.raises(FailedPrecondition, match="generating in another request"):
                await b.acquire(record.session_id)
    run(body())


# ---- long sessions ------------------------------------------------------------------------------

@pytest.mark.service
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


@pytest.fixture(scope="module")
def long_context_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    tokenizer = tiny.byte_level_tokenizer()
    target = tiny.build_model(root / "target", tokenizer, "llama", seed=41, context=16384)
    draft = tiny.build_model(root / "draft", tokenizer, "llama", seed=42, layers=1, context=16384)
    return str(draft), str(target)


@pytest.mark.e2e
def test_long_prompt_end_to_end_through_redis(long_context_models, redis_url):
    draft, target = long_context_models
    prompt = [1 + (i * 7919) % 383 for i in range(10_500)]
    with Cluster(draft, target, dtype="float32", coordinator={"session_store": redis_url}) as cluster:
        response = cluster.complete(token_ids=prompt, max_new_tokens=8, num_speculative_tokens=3,
                                    ignore_eos=True)
        assert len(response.token_ids) == 8 and response.stats.prompt_tokens == len(prompt)
        session = cluster.stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=response.session_id))
        assert list(session.token_ids) == prompt + list(response.token_ids)
        more = cluster.complete(session_id=response.session_id, token_ids=[5, 6], max_new_tokens=4,
                                ignore_eos=True)
        assert len(more.token_ids) == 4 and more.stats.target_prefill_tokens <= 4


# ---- the engine renews its lease and stops when it is taken over ------------------------------

def _in_thread(call):
    """Run call() in a thread; returns (thread, outcome dict with 'result' or 'error')."""
    outcome: dict = {}

    def body():
        try:
            outcome["result"] = call()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, outcome


def _wait_for(predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _stuck_request(cluster, redis_client):
    """A continued session whose request is stuck waiting for the (stopped) target; returns
    (session id, tokens stored before it, thread, outcome) once its input is committed."""
    first = cluster.complete(prompt="def fibonacci(n):", max_new_tokens=4, ignore_eos=True)
    sid = first.session_id
    tokens_key = _keys(sid)[1]
    before = redis_client.llen(tokens_key)
    cluster.target.stop(None).wait()
    thread, outcome = _in_thread(lambda: cluster.complete(session_id=sid, token_ids=[5, 6], max_new_tokens=8,
                                                          num_speculative_tokens=2, ignore_eos=True))
    _wait_for(lambda: redis_client.llen(tokens_key) == before + 2, "the request to commit its input")
    return sid, before, thread, outcome


@pytest.mark.e2e
def test_renewal_keeps_a_long_request_lease_alive(models, redis_url):
    """A request waiting for its target far longer than the lease keeps its session."""
    lease_s = 1.0
    paths = models["llama"]
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with Cluster(paths["draft"], paths["target"],
                 coordinator={"session_store": redis_url, "session_lease_s": lease_s}) as cluster:
        sid, before, thread, outcome = _stuck_request(cluster, client)
        time.sleep(3 * lease_s)  # three lease lifetimes without a round finishing
        assert thread.is_alive(), outcome

        async def other_replica_acquires():
            store = RedisSessionStore(redis_url, lease_ttl_s=lease_s)
            try:
                await store.acquire(sid)
            finally:
                await store.close()
        with pytest.raises(FailedPrecondition, match="generating in another request"):
            run(other_replica_acquires())
        cluster._start_target(cluster.target_port)
        thread.join(120)
        assert "error" not in outcome, outcome
        assert len(outcome["result"].token_ids) == 8
        assert client.llen(_keys(sid)[1]) == before + 2 + 8
    client.close()


@pytest.mark.e2e
def test_request_whose_session_was_taken_over_stops(models, redis_url):
    paths = models["llama"]
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with Cluster(paths["draft"], paths["target"],
                 coordinator={"session_store": redis_url, "session_lease_s": 1.0}) as cluster:
        sid, before, thread, outcome = _stuck_request(cluster, client)
        stored = client.lrange(_keys(sid)[1], 0, -1)
        # another replica took the session over (as after a lapse of this request's lease)
        client.set(_keys(sid)[2], "another-request", px=60_000)
        cluster._start_target(cluster.target_port)
        thread.join(120)
        error = outcome.get("error")
        assert isinstance(error, grpc.RpcError), outcome
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "was taken over" in error.details() and sid in error.details()
        # the tokens it committed stay; nothing after the takeover was written; the new holder keeps its lease
        assert client.lrange(_keys(sid)[1], 0, -1) == stored and len(stored) == before + 2
        assert client.get(_keys(sid)[2]) == "another-request"
    client.close()
