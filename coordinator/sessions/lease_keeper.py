"""Keep a request's session lease alive on a timer, however long its rounds take."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from specdec.errors import SpecdecError, Unavailable

from coordinator.sessions.session_store import Lease, SessionStore

log = logging.getLogger(__name__)


class LeaseKeeper:
    """While entered, renews `lease` every interval_s. A renewal that finds the session taken
    over (or deleted) ends the renewals and is kept in `lost`; `check()` raises it. A store that
    is unreachable is retried at the next tick (the request's own writes fail meanwhile)."""

    def __init__(self, store: SessionStore, lease: Lease, interval_s: float):
        self.store = store
        self.lease = lease
        self.interval_s = interval_s
        self.lost: SpecdecError | None = None
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> "LeaseKeeper":
        self._task = asyncio.create_task(self._renew_until_lost())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _renew_until_lost(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.store.renew(self.lease)
            except Unavailable as exc:
                log.warning("session %s: could not renew its lease (%s)", self.lease.session_id, exc)
            except SpecdecError as exc:
                log.warning("session %s: %s", self.lease.session_id, exc)
                self.lost = exc
                return

    def check(self) -> None:
        """Raise the error of a lost lease (FailedPrecondition, or NotFound when deleted)."""
        if self.lost is not None:
            raise self.lost
