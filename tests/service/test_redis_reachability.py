"""The session store's reachability as the coordinator logs it: once when Redis stops answering,
once when it answers again (coordinator/sessions/redis_store.py's Reachability)."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.sessions.redis_store import RedisSessionStore
from specdec.errors import Unavailable


def run(coro):
    return asyncio.run(coro)


def test_redis_going_away_and_coming_back_is_logged_once_each(own_redis, caplog):
    async def body():
        store = RedisSessionStore(own_redis.url, socket_timeout_s=1)
        try:
            await store.create()
            own_redis.stop()
            for _ in range(3):
                with pytest.raises(Unavailable):
                    await store.create()
            own_redis.start()
            for _ in range(3):
                await store.create()
        finally:
            await store.close()
    with caplog.at_level("INFO", logger="coordinator.sessions.redis_store"):
        run(body())
    records = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "coordinator.sessions.redis_store"]
    assert [level for level, _ in records] == ["WARNING", "INFO"], records
    assert f"session store {own_redis.url} is unreachable" in records[0][1]
    assert records[1][1] == f"session store {own_redis.url} answers again"
