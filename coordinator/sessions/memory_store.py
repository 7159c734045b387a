"""The in-process session store (the embedded default, one coordinator): nothing survives a
restart."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import time
import uuid

from coordinator.sessions.session_store import (Lease, SessionRecord, busy_error, check_lease, not_found_error,
                               taken_over_error)


class MemorySessionStore:
    """`SessionStore` in this process's memory."""

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
