"""Session store: the canonical committed tokens of every session.

`SessionStore` is the interface every store implements (`memory_store.py`, the embedded
default; `redis_store.py`, shared by replicas; `stores.py` opens the one --session-store
names). Records are copied in and out, so callers never share state with the store. A
session is leased by one request at a time: `acquire` gives the request its own `Lease`
handle, and every write, renewal and release names it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from specdec.errors import FailedPrecondition, NotFound, SessionBusy

from coordinator.sessions.model_tiers import Tier


@dataclass(frozen=True)
class Placement:
    """Where one tier holds a session's KV cache. Frozen: a record's copies may share it."""

    address: str = ""  # the replica holding the session's KV cache ("" = none recorded)
    held: int = 0      # committed tokens that replica holds


@dataclass
class SessionRecord:
    """One session: committed tokens, where each tier holds its KV cache, cumulative stats."""

    session_id: str
    token_ids: list[int] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    requests: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    draft: Placement = field(default_factory=Placement)   # the draft replica and what it holds
    target: Placement = field(default_factory=Placement)  # the target replica and what it holds
    stored_len: int = field(default=0, compare=False, repr=False)  # tokens the store already has

    def placement(self, tier: Tier) -> Placement:
        if tier == Tier.DRAFT:
            return self.draft
        if tier == Tier.TARGET:
            return self.target
        raise ValueError(f"no tier {tier!r}")

    def place(self, tier: Tier, placement: Placement) -> None:
        if tier == Tier.DRAFT:
            self.draft = placement
        elif tier == Tier.TARGET:
            self.target = placement
        else:
            raise ValueError(f"no tier {tier!r}")

    def hold(self, tier: Tier, held: int) -> None:
        """The tier's replica now holds the first `held` committed tokens."""
        self.place(tier, Placement(self.placement(tier).address, held))


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


def busy_error(session_id: str, free_in_s: float | None = None) -> SessionBusy:
    """Another request holds the session; free_in_s: how long until its lease can change hands
    even if the request holding it is gone (its coordinator stopped)."""
    when = ("" if free_in_s is None else
            f" (if that request's coordinator stopped, the session is free in {free_in_s:.1f}s)")
    return SessionBusy(
        f"session {session_id!r} is generating in another request{when}; wait for it to finish or "
        "cancel it", retry_after_s=free_in_s)


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
