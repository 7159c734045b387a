"""Session store: the canonical committed tokens of every session.

`SessionStore` is the interface; `MemorySessionStore` is the embedded default
(one process). Records are copied in and out, so callers never share state
with the store. A session is leased by one request at a time.
"""

from __future__ import annotations

import asyncio
import copy
import time
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from specdec.errors import FailedPrecondition, NotFound


@dataclass
class SessionRecord:
    """One session: committed tokens, what each service holds, cumulative stats."""

    session_id: str
    token_ids: list[int] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    requests: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    draft_address: str = ""  # the draft replica holding this session's KV cache
    draft_held: int = 0  # committed tokens that replica holds
    target_address: str = ""
    target_held: int = 0
    stored_len: int = field(default=0, compare=False, repr=False)  # tokens the store already has


class SessionStore(Protocol):
    async def create(self) -> SessionRecord: ...

    async def get(self, session_id: str) -> SessionRecord: ...

    async def acquire(self, session_id: str) -> SessionRecord:
        """Lease the session for one request; FailedPrecondition when already leased."""

    async def save(self, record: SessionRecord) -> None: ...

    async def release(self, session_id: str) -> None:
        """End the lease."""

    async def delete(self, session_id: str) -> bool: ...

    async def ping(self) -> None:
        """Unavailable when the store cannot be reached."""

    async def close(self) -> None: ...


def busy_error(session_id: str) -> FailedPrecondition:
    return FailedPrecondition(
        f"session {session_id!r} is generating in another request; wait for it to finish or cancel it"
    )


def not_found_error(session_id: str) -> NotFound:
    return NotFound(f"session {session_id!r} does not exist (expired or deleted); omit session_id "
                    "to start a new session")


class MemorySessionStore:
    """In-process store (the embedded default): nothing survives a restart."""

    def __init__(self) -> None:
        self._records: dict[str, SessionRecord] = {}
        self._leased: set[str] = set()
        self._lock = asyncio.Lock()

    async def create(self) -> SessionRecord:
        record = SessionRecord(session_id=uuid.uuid4().hex)
        async with self._lock:
            self._records[record.session_id] = copy.deepcopy(record)
        return record

    async def get(self, session_id: str) -> SessionRecord:
        async with self._lock:
            if session_id not in self._records:
                raise not_found_error(session_id)
            return copy.deepcopy(self._records[session_id])

    async def acquire(self, session_id: str) -> SessionRecord:
        async with self._lock:
            if session_id not in self._records:
                raise not_found_error(session_id)
            if session_id in self._leased:
                raise busy_error(session_id)
            self._leased.add(session_id)
            return copy.deepcopy(self._records[session_id])

    async def save(self, record: SessionRecord) -> None:
        record.updated_at = time.time()
        async with self._lock:
            if record.session_id not in self._records:
                raise not_found_error(record.session_id)
            self._records[record.session_id] = copy.deepcopy(record)

    async def release(self, session_id: str) -> None:
        async with self._lock:
            self._leased.discard(session_id)

    async def delete(self, session_id: str) -> bool:
        async with self._lock:
            self._leased.discard(session_id)
            return self._records.pop(session_id, None) is not None

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None


def open_store(url: str, ttl_s: float = 86400.0, lease_s: float = 120.0) -> SessionStore:
    """The store named by --session-store: `memory` or a redis://, rediss:// or unix:// URL."""
    if url == "memory":
        return MemorySessionStore()
    if url.startswith(("redis://", "rediss://", "unix://")):
        from coordinator.redis_store import RedisSessionStore

        return RedisSessionStore(url, ttl_s=ttl_s, lease_ttl_s=lease_s)
    raise ValueError(f"unsupported --session-store {url!r}: use 'memory' or a redis:// / rediss:// URL")
