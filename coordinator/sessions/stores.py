"""Open the session store that --session-store names."""

from __future__ import annotations

from coordinator.sessions.durability import Durability
from coordinator.sessions.session_store import SessionStore

MEMORY = "memory"


def open_store(url: str, ttl_s: float = 86400.0, lease_s: float = 30.0,
               holder_ttl_s: float = 6.0, durability: Durability = Durability()) -> SessionStore:
    """The store named by --session-store: `memory`, or a Redis URL of any topology
    (specdec/redis_url.py). ValueError, saying what is wrong, for anything else."""
    if url == MEMORY:
        if durability.waits:
            raise ValueError(f"--session-durability {durability} needs a Redis session store with "
                             "replicas; --session-store memory has none: use 'none'")
        from coordinator.sessions.memory_store import MemorySessionStore

        return MemorySessionStore()
    from coordinator.sessions.redis_store import RedisSessionStore

    try:
        return RedisSessionStore(url, ttl_s=ttl_s, lease_ttl_s=lease_s, holder_ttl_s=holder_ttl_s,
                                 durability=durability)
    except ValueError as exc:
        raise ValueError(f"unsupported --session-store: {exc}; or use 'memory'") from None
