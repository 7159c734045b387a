"""Sessions in Redis (redis-py asyncio), shared by every coordinator replica.

Keys of session S (all with the session TTL, refreshed on every write):
  specdec:session:S:meta    hash: created_at, updated_at, requests, stats (JSON),
                            draft_address, draft_held, target_address, target_held
  specdec:session:S:tokens  list of committed token ids (append-only)
  specdec:session:S:lease   the lease id of the request generating now, "C:<uuid>" with C its
                            coordinator (expires after lease_ttl unless the request renews it)
and of each coordinator process C using the store:
  specdec:coordinator:C     its liveness key, rewritten every third of holder_ttl: a lease whose
                            coordinator's key is gone (the process was killed, or cut off from
                            Redis for holder_ttl) is taken over by the next request at once

Two coordinators never corrupt a session: a request must hold the lease to write (each
request has its own lease id, in its `Lease` handle), and a write only appends when the
stored token count is the one the writer last saw (checked atomically in a Lua script). A
lease taken over from a coordinator that was only cut off makes that coordinator's next write
fail (FAILED_PRECONDITION, "taken over"): its committed tokens stay, nothing else is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from specdec.errors import FailedPrecondition, Unavailable
from specdec.logtag import redacted_url

from coordinator.sessions.session_store import (
    Lease, Placement, SessionRecord, busy_error, check_lease, not_found_error, taken_over_error,
)

log = logging.getLogger(__name__)

PREFIX = "specdec:session:"
HOLDER_PREFIX = "specdec:coordinator:"
RELEASE_RETRY_S = 0.5  # a release that found Redis down is retried this often, for a lease's lifetime

# The lease check, shared by the scripts: -1 no session, -2 another request holds the lease,
# -4 the lease lapsed (nobody holds it).
LEASE_CHECK = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local holder = redis.call('GET', KEYS[3])
if not holder then return -4 end
if holder ~= ARGV[1] then return -2 end
"""

# KEYS: meta, tokens, lease; ARGV: lease id, expected token count, ttl ms, lease ttl ms,
#       meta JSON, new tokens... Lua's unpack takes at most ~8,000 values: push in chunks.
SAVE_SCRIPT = LEASE_CHECK + """
if redis.call('LLEN', KEYS[2]) ~= tonumber(ARGV[2]) then return -3 end
local meta = cjson.decode(ARGV[5])
for k, v in pairs(meta) do redis.call('HSET', KEYS[1], k, v) end
for first = 6, #ARGV, 1000 do
  redis.call('RPUSH', KEYS[2], unpack(ARGV, first, math.min(first + 999, #ARGV)))
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('PEXPIRE', KEYS[2], ARGV[3]) end
redis.call('PEXPIRE', KEYS[3], ARGV[4])
return redis.call('LLEN', KEYS[2])
"""

# KEYS: meta, tokens, lease; ARGV: lease id, lease ttl ms
RENEW_SCRIPT = LEASE_CHECK + """
redis.call('PEXPIRE', KEYS[3], ARGV[2])
return 1
"""

# KEYS: lease; ARGV: the lease id seen, the new lease id, lease ttl ms (replaces a lease whose
# coordinator is gone, unless it changed since it was read)
TAKE_OVER_SCRIPT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
"""

# KEYS: lease; ARGV: lease id
RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _keys(session_id: str) -> tuple[str, str, str]:
    base = PREFIX + session_id
    return base + ":meta", base + ":tokens", base + ":lease"


class RedisSessionStore:
    """`SessionStore` over Redis; see the module docstring for the layout."""

    def __init__(self, url: str, ttl_s: float = 86400.0, lease_ttl_s: float = 30.0,
                 holder_ttl_s: float = 6.0, socket_timeout_s: float = 5.0):
        self.url = url
        self.ttl_ms = int(ttl_s * 1000)
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.holder_ttl_ms = int(holder_ttl_s * 1000)
        self.holder_id = uuid.uuid4().hex  # this coordinator process, in its leases' ids
        self.client = aioredis.from_url(url, socket_timeout=socket_timeout_s,
                                        socket_connect_timeout=socket_timeout_s, decode_responses=True)
        self._save = self.client.register_script(SAVE_SCRIPT)
        self._renew = self.client.register_script(RENEW_SCRIPT)
        self._take_over = self.client.register_script(TAKE_OVER_SCRIPT)
        self._release = self.client.register_script(RELEASE_SCRIPT)
        self._announcer: asyncio.Task | None = None  # rewrites this coordinator's liveness key
        self._background: set[asyncio.Task] = set()  # releases waiting for Redis to come back

    def _unavailable(self, exc: Exception) -> Unavailable:
        return Unavailable(f"session store {redacted_url(self.url)} is unreachable or refused us "
                           f"({exc.__class__.__name__}: {exc}); retry when it is back")

    async def ping(self) -> None:
        try:
            await self.client.ping()
        except RedisError as exc:
            raise self._unavailable(exc) from exc

    async def create(self) -> SessionRecord:
        record = SessionRecord(session_id=uuid.uuid4().hex)
        meta, _, _ = _keys(record.session_id)
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.hset(meta, mapping=self._meta(record))
                pipe.pexpire(meta, self.ttl_ms)
                await pipe.execute()
        except RedisError as exc:
            raise self._unavailable(exc) from exc
        return record

    async def get(self, session_id: str) -> SessionRecord:
        meta_key, tokens_key, _ = _keys(session_id)
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.hgetall(meta_key)
                pipe.lrange(tokens_key, 0, -1)
                meta, tokens = await pipe.execute()
        except RedisError as exc:
            raise self._unavailable(exc) from exc
        if not meta:
            raise not_found_error(session_id)
        record = SessionRecord(
            session_id=session_id, token_ids=[int(t) for t in tokens],
            created_at=float(meta["created_at"]), updated_at=float(meta["updated_at"]),
            requests=int(meta["requests"]), stats=json.loads(meta["stats"]),
            draft=Placement(meta["draft_address"], int(meta["draft_held"])),
            target=Placement(meta["target_address"], int(meta["target_held"])),
        )
        record.stored_len = len(record.token_ids)
        return record

    # ---- this coordinator's liveness, which its leases last no longer than --------------------

    async def _announce(self) -> None:
        await self.client.set(HOLDER_PREFIX + self.holder_id, "1", px=self.holder_ttl_ms)

    async def _keep_announcing(self) -> None:
        while True:
            await asyncio.sleep(self.holder_ttl_ms / 3000)
            try:
                await self._announce()
            except RedisError as exc:
                log.warning("could not refresh this coordinator's liveness key in %s (%s)",
                            redacted_url(self.url), exc)

    async def _start_announcing(self) -> None:
        """Before the first lease: its holder's liveness key exists before the lease does."""
        if self._announcer is None or self._announcer.done():
            await self._announce()
            self._announcer = asyncio.create_task(self._keep_announcing())

    # ---- leases --------------------------------------------------------------------------------

    async def acquire(self, session_id: str) -> Lease:
        meta_key, _, lease_key = _keys(session_id)
        lease_id = f"{self.holder_id}:{uuid.uuid4().hex}"
        try:
            if not await self.client.exists(meta_key):
                raise not_found_error(session_id)
            await self._start_announcing()
            if not await self.client.set(lease_key, lease_id, nx=True, px=self.lease_ttl_ms):
                await self._take_over_or_busy(session_id, lease_key, lease_id)
        except RedisError as exc:
            raise self._unavailable(exc) from exc
        lease = Lease(session_id, lease_id, SessionRecord(session_id))
        try:
            lease.record = await self.get(session_id)
        except BaseException:
            await self.release(lease)
            raise
        return lease

    async def _take_over_or_busy(self, session_id: str, lease_key: str, lease_id: str) -> None:
        """Take the lease of a request whose coordinator is gone; else raise SessionBusy saying
        when the lease can change hands (its holder's liveness key's time left)."""
        current = await self.client.get(lease_key)
        if current is None:  # released since the SET NX
            if await self.client.set(lease_key, lease_id, nx=True, px=self.lease_ttl_ms):
                return
            raise busy_error(session_id, 0.0)
        holder, sep, _ = current.partition(":")
        free_in_ms = -1
        if sep:  # a lease of a coordinator that keeps a liveness key
            free_in_ms = await self.client.pttl(HOLDER_PREFIX + holder)
            if free_in_ms == -2:  # that coordinator is gone
                if await self._take_over(keys=[lease_key], args=[current, lease_id, self.lease_ttl_ms]):
                    log.info("session %s: took its lease over from coordinator %s, which is gone",
                             session_id, holder[:8])
                    return
                free_in_ms = 0  # changed hands meanwhile
        if free_in_ms < 0:
            free_in_ms = max(await self.client.pttl(lease_key), 0)
        raise busy_error(session_id, free_in_ms / 1000)

    @staticmethod
    def _meta(record: SessionRecord) -> dict[str, str]:
        return {
            "created_at": repr(record.created_at), "updated_at": repr(time.time()),
            "requests": str(record.requests), "stats": json.dumps(record.stats),
            "draft_address": record.draft.address, "draft_held": str(record.draft.held),
            "target_address": record.target.address, "target_held": str(record.target.held),
        }

    def _lease_lost(self, session_id: str, result: int) -> None:
        """Raise for the lease check's failures (see LEASE_CHECK)."""
        if result == -1:
            raise not_found_error(session_id)
        if result == -2:
            raise taken_over_error(session_id)
        if result == -4:
            raise taken_over_error(session_id, lapsed_after_s=self.lease_ttl_ms / 1000)

    async def save(self, record: SessionRecord, lease: Lease) -> None:
        check_lease(record, lease)
        new_tokens = record.token_ids[record.stored_len:]
        try:
            result = await self._save(
                keys=list(_keys(record.session_id)),
                args=[lease.lease_id, record.stored_len, self.ttl_ms, self.lease_ttl_ms,
                      json.dumps(self._meta(record)), *new_tokens])
        except RedisError as exc:
            raise self._unavailable(exc) from exc
        self._lease_lost(record.session_id, result)
        if result == -3:
            raise FailedPrecondition(
                f"session {record.session_id!r} was changed by another writer; reload it and retry")
        record.stored_len = int(result)

    async def renew(self, lease: Lease) -> None:
        try:
            result = await self._renew(keys=list(_keys(lease.session_id)),
                                       args=[lease.lease_id, self.lease_ttl_ms])
        except RedisError as exc:
            raise self._unavailable(exc) from exc
        self._lease_lost(lease.session_id, result)

    async def release(self, lease: Lease) -> None:
        """End the lease; where Redis is down, again every RELEASE_RETRY_S in the background until
        it answers or the lease would have lapsed anyway, so the session is free soon after Redis
        is back rather than a lease's lifetime later."""
        try:
            await self._release_now(lease)
        except RedisError:
            task = asyncio.create_task(self._release_when_back(lease))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _release_now(self, lease: Lease) -> None:
        _, _, lease_key = _keys(lease.session_id)
        await self._release(keys=[lease_key], args=[lease.lease_id])

    async def _release_when_back(self, lease: Lease) -> None:
        give_up = time.monotonic() + self.lease_ttl_ms / 1000
        while time.monotonic() < give_up:
            await asyncio.sleep(RELEASE_RETRY_S)
            with contextlib.suppress(RedisError):
                await self._release_now(lease)
                return

    async def delete(self, session_id: str) -> bool:
        try:
            return bool(await self.client.delete(*_keys(session_id)))
        except RedisError as exc:
            raise self._unavailable(exc) from exc

    async def close(self) -> None:
        """Stop announcing and drop the liveness key (best effort): leases this coordinator still
        holds can be taken over at once."""
        tasks = [t for t in (self._announcer, *self._background) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._announcer is not None:
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                await asyncio.wait_for(self.client.delete(HOLDER_PREFIX + self.holder_id), 1.0)
        await self.client.aclose()
