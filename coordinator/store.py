"""Session store: the canonical committed tokens of every session.

`SessionStore` is the interface; `MemorySessionStore` is the embedded default
(one process). Records are copied in and out, so callers never share state
with the store. A session is leased by one request at a time: `acquire` gives
the request its own `Lease` handle, and every write, renewal and release names it.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
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


@dataclass(eq=False)
class Lease:
    """One request's hold on a session: the lease id that lets it write, and its copy of the record."""

    session_id: str
    lease_id: str
    record: SessionRecord


class SessionStore(Protocol):
    async def create(self) -> SessionRecord: ...

    async def get(self, session_id: str) -> SessionRecord: ...

    async def acquire(self, session_id: str) -> Lease:
        """Lease the session for one request; FailedPrecondition when already leased."""

    async def save(self, record: SessionRecord, lease: Lease) -> None:
        """Write the record under the lease; FailedPrecondition when another request took the
        session over (or wrote it since this record was loaded)."""

    async def renew(self, lease: Lease) -> None:
        """Keep the lease alive; FailedPrecondition when another request took the session over."""

    async def release(self, lease: Lease) -> None:
        """End the lease (nothing happens when another request holds the session now)."""

    async def delete(self, session_id: str) -> bool: ...

    async def ping(self) -> None:
        """Unavailable when the store cannot be reached."""

    async def close(self) -> None: ...


def busy_error(session_id: str) -> FailedPrecondition:
    return FailedPrecondition(
        f"session {session_id!r} is generating in another request; wait for it to finish or cancel it"
    )


def taken_over_error(session_id: str, lapsed_after_s: float | None = None) -> FailedPrecondition:
    """This request's lease is gone: another request holds the session (or, lapsed_after_s set,
    the lease lapsed unrenewed and another request may take it)."""
    why = (f"its lease lapsed after {lapsed_after_s:g}s without a renewal" if lapsed_after_s is not None
           else "another request holds its lease now")
    return FailedPrecondition(
        f"session {session_id!r} was taken over: this request lost its lease ({why}); the tokens it "
        "committed are kept; continue the session once the other request is done")


def check_lease(record: SessionRecord, lease: Lease) -> None:
    """A request writes only its own session with its own lease (a bug otherwise)."""
    if record.session_id != lease.session_id:
        raise ValueError(f"record of session {record.session_id!r} saved under the lease of "
                         f"{lease.session_id!r}")


def not_found_error(session_id: str) -> NotFound:
    return NotFound(f"session {session_id!r} does not exist (expired or deleted); omit session_id "
                    "to start a new session")


class MemorySessionStore:
    """In-process store (the embedded default): nothing survives a restart."""

    def __init__(self) -> None:
        self._records: dict[str, SessionRecord] = {}
        self._leases: dict[str, str] = {}  # session id -> lease id of the request holding it
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

    async def acquire(self, session_id: str) -> Lease:
        async with self._lock:
            if session_id not in self._records:
                raise not_found_error(session_id)
            if session_id in self._leases:
                raise busy_error(session_id)
            lease = Lease(session_id, uuid.uuid4().hex, copy.deepcopy(self._records[session_id]))
            lease.record.stored_len = len(lease.record.token_ids)
            self._leases[session_id] = lease.lease_id
            return lease

    def _check_holder(self, lease: Lease) -> None:
        if lease.session_id not in self._records:
            raise not_found_error(lease.session_id)
        if self._leases.get(lease.session_id) != lease.lease_id:
            raise taken_over_error(lease.session_id)

    async def save(self, record: SessionRecord, lease: Lease) -> None:
        check_lease(record, lease)
        record.updated_at = time.time()
        async with self._lock:
            self._check_holder(lease)
            self._records[record.session_id] = _stored_copy(record, self._records[record.session_id])
            record.stored_len = len(record.token_ids)

    async def renew(self, lease: Lease) -> None:
        async with self._lock:
            self._check_holder(lease)

    async def release(self, lease: Lease) -> None:
        async with self._lock:
            if self._leases.get(lease.session_id) == lease.lease_id:
                del self._leases[lease.session_id]

    async def delete(self, session_id: str) -> bool:
        async with self._lock:
            self._leases.pop(session_id, None)
            return self._records.pop(session_id, None) is not None

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None


def _stored_copy(record: SessionRecord, stored: SessionRecord) -> SessionRecord:
    """The store's own copy of a record it held as `stored`. Committed tokens only grow under a
    lease, so the tokens past record.stored_len are copied, not the whole history each round."""
    tokens = stored.token_ids
    keep = min(record.stored_len, len(tokens), len(record.token_ids))
    del tokens[keep:]
    tokens.extend(record.token_ids[keep:])
    return dataclasses.replace(record, token_ids=tokens, stats=copy.deepcopy(record.stats),
                               stored_len=len(tokens))


def open_store(url: str, ttl_s: float = 86400.0, lease_s: float = 120.0) -> SessionStore:
    """The store named by --session-store: `memory` or a redis://, rediss:// or unix:// URL."""
    if url == "memory":
        return MemorySessionStore()
    if url.startswith(("redis://", "rediss://", "unix://")):
        from coordinator.redis_store import RedisSessionStore

        return RedisSessionStore(url, ttl_s=ttl_s, lease_ttl_s=lease_s)
    raise ValueError(f"unsupported --session-store {url!r}: use 'memory' or a redis:// / rediss:// URL")
