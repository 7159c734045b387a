"""The Redis session store against a real redis-server: leases (one per request, renewed, taken over),
versioned appends, long sessions, TTL, auth, TLS.

Here the unit tests; the other tiers' are in tests/service/test_redis_store.py and
tests/e2e/test_redis_store.py and tests/process/test_redis_store.py.
"""

from __future__ import annotations

import pytest
import redis

from coordinator.sessions.redis_store import RedisSessionStore
from coordinator.sessions.memory_store import MemorySessionStore
from coordinator.sessions.stores import open_store
from specdec.errors import FailedPrecondition, Unavailable
from tests.service.test_redis_store import run


def test_unreachable_redis_is_unavailable_with_a_clear_message(caplog):
    """The client is told what failed, not where the store lives; the log names it, redacted."""
    async def body():
        store = RedisSessionStore("redis://:secret@127.0.0.1:1/0", socket_timeout_s=0.5)
        try:
            with pytest.raises(Unavailable) as info:
                await store.create()
            message = str(info.value)
            assert message.startswith("the session store is unreachable") and "retry when it is back" in message
            assert "127.0.0.1" not in message and ":1" not in message and "secret" not in message, message
        finally:
            await store.close()
    with caplog.at_level("WARNING", logger="coordinator.sessions.redis_store"):
        run(body())
    assert "redis://***@127.0.0.1:1/0 is unreachable" in caplog.text and "secret" not in caplog.text


def test_open_store_rejects_unknown_scheme():
    with pytest.raises(ValueError, match="unsupported --session-store"):
        open_store("postgres://x")


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
