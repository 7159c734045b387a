"""Open the session store that --session-store names."""

from __future__ import annotations

from coordinator.sessions.session_store import SessionStore


def open_store(url: str, ttl_s: float = 86400.0, lease_s: float = 30.0,
               holder_ttl_s: float = 6.0) -> SessionStore:
    """The store named by --session-store: `memory` or a redis://, rediss:// or unix:// URL."""
    if url == "memory":
        from coordinator.sessions.memory_store import MemorySessionStore

        return MemorySessionStore()
    if url.startswith(("redis://", "rediss://", "unix://")):
        from coordinator.sessions.redis_store import RedisSessionStore

        return RedisSessionStore(url, ttl_s=ttl_s, lease_ttl_s=lease_s, holder_ttl_s=holder_ttl_s)
    raise ValueError(f"unsupported --session-store {url!r}: use 'memory' or a redis:// / rediss:// URL")
