"""Replica pools and session affinity.

Each tier (draft, target) has a `ReplicaPool`: one client per address that discovery reports.
A replica is used only once it answers grpc.health.v1 and its model info passes the pool's
check (the same vocabulary as the target; an incompatible replica is refused and logged).
A session is pinned to one replica per tier by rendezvous (highest-random-weight) hashing of
its id over the usable replicas: a replica that leaves or fails moves only its own sessions,
one that joins takes only the sessions that now hash to it. A failed replica is skipped until
a background health check says it answers again (and, for drafts, at least --draft-retry-s). A
replica whose call timed out is health-checked at once and counts as failed only when it does
not answer (a slow model is not a dead one).

`Routes` holds both pools, feeds them from a discovery, and keeps a session record's
placement per tier (the replica's address, the tokens it holds) honest: a session that lands on another replica than the one
recorded holds nothing there, so the next call resends its history from the store.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.errors import SpecdecError, Unavailable
from specdec.types import ModelDescription

from coordinator.sessions.clients import ServiceClient, release_quietly
from coordinator.sessions.discovery import Discovery
from coordinator.sessions.session_store import Placement, SessionRecord
from coordinator.sessions.model_tiers import Tier

log = logging.getLogger(__name__)

PROBING, READY, FAILED, REFUSED = "probing", "ready", "failed", "refused"
PROBE_INTERVAL_S = 0.25  # how often replicas that are not ready are health-checked
PROBE_TIMEOUT_S = 2.0
REFUSED_RECHECK_S = 10.0  # a refused replica is checked again this often (it may be redeployed)
INFO_REFRESH_S = 10.0  # a ready replica's model info is read again this often (restarted behind the
#                        same address, it may serve another model)

Check = Callable[[ModelDescription], None]  # raises (naming the difference) when incompatible


def model_fingerprint(info: ModelDescription) -> str:
    """The model a replica serves, as its model info names it (id, dtype, device, output size,
    the checkpoint's identity): what the coordinator's estimates of a model are kept by. A new
    checkpoint is another model, whether rolled out under a new path or written over the old
    one (its checkpoint_id differs: specdec/checkpoint.py)."""
    identity = "\x00".join((info.model_id, info.dtype, info.device, str(info.vocab_size), info.checkpoint_id))
    return hashlib.blake2b(identity.encode(), digest_size=6).hexdigest()


def _serves(info: ModelDescription) -> tuple[str, int, str]:
    """What a replica serves, as a refresh compares it: its model and its heads (a target
    restarted with other heads keeps its model fingerprint)."""
    return model_fingerprint(info), info.num_heads, info.heads_id


def weight(key: str, address: str) -> int:
    """The rendezvous weight of a (session, replica) pair: a stable 64-bit hash."""
    digest = hashlib.blake2b(f"{key}\x00{address}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank(key: str, addresses: Iterable[str]) -> list[str]:
    """Addresses by descending weight for key: the first is key's replica, then its fallbacks."""
    addresses = list(addresses)
    if len(addresses) <= 1:  # one replica (or none): nothing to weigh
        return addresses
    return sorted(addresses, key=lambda address: (weight(key, address), address), reverse=True)


@dataclass
class Replica:
    address: str
    client: ServiceClient
    state: str = PROBING
    info: ModelDescription | None = None
    answered_at: float = 0.0  # when its model info first came back
    error: Exception | None = None  # why it was refused
    next_probe: float = 0.0  # monotonic time of its next health check
    next_refresh: float = 0.0  # monotonic time its model info is read again while it is ready
    probing: bool = False
    last_error: str = ""  # why its last health check failed (start-up errors quote it)


class ReplicaPool:
    """The replicas of one tier; see the module docstring."""

    def __init__(self, kind: str, make_client: Callable[[str], ServiceClient], min_down_s: float = 0.0,
                 probe_interval_s: float = PROBE_INTERVAL_S, probe_timeout_s: float = PROBE_TIMEOUT_S):
        self.kind = kind
        self.min_down_s = min_down_s
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self._make_client = make_client
        self._replicas: dict[str, Replica] = {}
        self._check: Check | None = None
        self._changed = asyncio.Event()
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None
        self.fingerprint_vocab_size: int | None = None  # tokenizer fingerprints over ids below this

    def fingerprint_below(self, size: int) -> None:
        """From now on compare tokenizer fingerprints over ids < size: every replica is asked again."""
        self.fingerprint_vocab_size = size
        for replica in self._replicas.values():
            replica.info, replica.answered_at = None, 0.0
        self._wake.set()

    def failures(self) -> list[tuple[ServiceClient, str]]:
        """(client, last error) of the replicas whose health check failed (for start-up errors)."""
        return [(r.client, r.last_error) for _, r in sorted(self._replicas.items()) if r.last_error and r.info is None]

    # ---- what discovery says ------------------------------------------------------------------

    def update(self, addresses: Iterable[str]) -> None:
        """The tier's current addresses: new ones are probed, gone ones dropped (their sessions move)."""
        wanted = set(addresses)
        for address in sorted(set(self._replicas) - wanted):
            replica = self._replicas.pop(address)
            log.info("%s replica %s left (was %s)", self.kind, address, replica.state)
            self._spawn(replica.client.close())
        for address in sorted(wanted - set(self._replicas)):
            self._replicas[address] = Replica(address, self._make_client(address))
        self._changed.set()
        self._wake.set()

    # ---- what routing asks --------------------------------------------------------------------

    def ready(self) -> list[str]:
        return sorted(a for a, r in self._replicas.items() if r.state == READY)

    def pick(self, key: str) -> ServiceClient | None:
        """key's replica among the usable ones (None when there is none)."""
        ready = self.ready()
        return self._replicas[rank(key, ready)[0]].client if ready else None

    def model_of(self, address: str) -> str | None:
        """The fingerprint of the model the replica at `address` serves (None: not known)."""
        replica = self._replicas.get(address)
        return model_fingerprint(replica.info) if replica is not None and replica.info is not None else None

    def info_of(self, address: str) -> ModelDescription | None:
        """The model info of the replica at `address` (None: not known)."""
        replica = self._replicas.get(address)
        return replica.info if replica is not None else None

    def infos(self) -> list[ModelDescription]:
        """The model info of every replica that has answered and was not refused."""
        return [r.info for r in self._replicas.values() if r.info is not None and r.state != REFUSED]

    def ready_client(self, address: str) -> ServiceClient | None:
        replica = self._replicas.get(address)
        return replica.client if replica is not None and replica.state == READY else None

    def mark_failed(self, address: str) -> None:
        """A call to address failed: skip it until a health check says it answers again."""
        replica = self._replicas.get(address)
        if replica is None or replica.state != READY:
            return
        replica.state = FAILED
        replica.next_probe = time.monotonic() + self.min_down_s
        log.warning("%s replica %s failed; its sessions move to the other replicas until it answers "
                    "health checks again", self.kind, address)
        self._changed.set()
        self._wake.set()

    def suspect(self, address: str) -> None:
        """A call to address timed out: its model may only be slow (it stays in use) or its
        process hung. A health check now tells them apart (the services answer it while their
        model works): a replica that does not answer it is marked failed."""
        replica = self._replicas.get(address)
        if replica is None or replica.state != READY or replica.probing:
            return
        replica.probing = True
        self._spawn(self._check_alive(replica))

    async def _check_alive(self, replica: Replica) -> None:
        try:
            alive = await self._answers(replica)
        finally:
            replica.probing = False
        if not alive and self._replicas.get(replica.address) is replica:
            self.mark_failed(replica.address)

    async def check_alive(self, address: str) -> bool:
        """A call to address timed out: health-check it now; one that does not answer is marked
        failed (its sessions move). True when it answers: it is only slow, and stays in use."""
        replica = self._replicas.get(address)
        if replica is None or replica.state != READY:
            return False
        if await self._answers(replica):
            return True
        if self._replicas.get(address) is replica:
            self.mark_failed(address)
        return False

    async def _answers(self, replica: Replica) -> bool:
        """Whether the replica answers SERVING to a health check within the probe timeout."""
        try:
            health = health_pb2_grpc.HealthStub(replica.client.channel)
            response = await health.Check(health_pb2.HealthCheckRequest(), timeout=self.probe_timeout_s)
            return response.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            return False

    def describe(self) -> str:
        parts = [f"{address} {r.state}" + (f" ({r.error})" if r.error else "")
                 for address, r in sorted(self._replicas.items())]
        return f"{self.kind} replicas: {', '.join(parts) or 'none discovered'}"

    # ---- admission ----------------------------------------------------------------------------

    async def first_info(self, timeout_s: float) -> ModelDescription:
        """The model info of the first replica to answer (the start-up reference)."""
        def answered() -> ModelDescription | None:
            infos = [r for r in self._replicas.values() if r.info is not None]
            return min(infos, key=lambda r: r.answered_at).info if infos else None
        return await self._wait(answered, timeout_s)

    async def accept(self, check: Check, timeout_s: float) -> ModelDescription:
        """From now on replicas must pass check; waits until one is usable and returns its info.
        Raises the check's error when every replica found is refused."""
        self._check = check
        for replica in self._replicas.values():
            if replica.info is not None and replica.state == PROBING:
                self._evaluate(replica)

        def usable() -> ModelDescription | None:
            ready = [r for r in self._replicas.values() if r.state == READY]
            if ready:
                return min(ready, key=lambda r: r.answered_at).info
            refused = [r for r in self._replicas.values() if r.state == REFUSED]
            if refused and len(refused) == len(self._replicas):
                raise refused[0].error
            return None
        return await self._wait(usable, timeout_s)

    async def _wait(self, done: Callable[[], Any], timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            self._changed.clear()
            result = done()
            if result is not None:
                return result
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Unavailable(
                    f"no {self.kind} replica answered within {timeout_s:g}s ({self.describe()})")
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    def _evaluate(self, replica: Replica) -> None:
        """Ready when its info passes the check, refused (and logged) when not."""
        self._changed.set()
        if self._check is None:
            return
        try:
            self._check(replica.info)
        except Exception as exc:  # noqa: BLE001 -- the check's error names the difference
            if replica.state != REFUSED or str(replica.error) != str(exc):
                log.error("refusing %s replica %s: %s", self.kind, replica.address, exc)
            replica.state, replica.error = REFUSED, exc
            replica.next_probe = time.monotonic() + REFUSED_RECHECK_S
            return
        log.info("%s replica %s %s (%s)", self.kind, replica.address,
                 "answers again" if replica.state == FAILED else "joined", replica.info.model_id)
        replica.state, replica.error = READY, None
        replica.next_refresh = time.monotonic() + INFO_REFRESH_S

    # ---- health checks ------------------------------------------------------------------------

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        while True:
            self._wake.clear()
            now = time.monotonic()
            for replica in list(self._replicas.values()):
                if replica.probing:
                    continue
                if replica.state != READY and replica.next_probe <= now:
                    replica.probing = True
                    self._spawn(self._probe(replica))
                elif replica.state == READY and replica.next_refresh <= now:
                    replica.probing = True
                    self._spawn(self._refresh(replica))
            try:
                await asyncio.wait_for(self._wake.wait(), self.probe_interval_s)
            except asyncio.TimeoutError:
                pass

    async def _probe(self, replica: Replica) -> None:
        size = self.fingerprint_vocab_size
        try:
            health = health_pb2_grpc.HealthStub(replica.client.channel)
            response = await health.Check(health_pb2.HealthCheckRequest(), timeout=self.probe_timeout_s)
            if response.status != health_pb2.HealthCheckResponse.SERVING:
                raise Unavailable(f"health status {response.status}")
            info = await replica.client.info(self.probe_timeout_s, fingerprint_vocab_size=size)
        except (grpc.aio.AioRpcError, SpecdecError) as exc:
            replica.next_probe = time.monotonic() + self.probe_interval_s
            replica.last_error = str(exc)
            log.debug("%s replica %s does not answer: %s", self.kind, replica.address, exc)
            return
        finally:
            replica.probing = False
        if self._replicas.get(replica.address) is not replica or size != self.fingerprint_vocab_size:
            return  # it left while we asked, or the question changed
        replica.last_error = ""
        replica.info = info
        replica.answered_at = replica.answered_at or time.monotonic()
        self._evaluate(replica)

    async def _refresh(self, replica: Replica) -> None:
        """Read a ready replica's model info again (cheaply: no tokenizer fingerprint asked for);
        one that serves another model now is checked as a joining replica is."""
        size = self.fingerprint_vocab_size
        try:
            info = await replica.client.info(self.probe_timeout_s, wait_for_ready=False)
            changed = _serves(info) != _serves(replica.info)
            if changed:
                info = await replica.client.info(self.probe_timeout_s, fingerprint_vocab_size=size)
        except (grpc.aio.AioRpcError, SpecdecError) as exc:
            log.debug("%s replica %s: its model info did not come (%s)", self.kind, replica.address, exc)
            return  # its calls tell whether it is down
        finally:
            replica.probing = False
            replica.next_refresh = time.monotonic() + INFO_REFRESH_S
        if (not changed or self._replicas.get(replica.address) is not replica or replica.state != READY
                or size != self.fingerprint_vocab_size):
            return
        log.info("%s replica %s serves %s now (was %s)", self.kind, replica.address, info.model_id,
                 replica.info.model_id)
        replica.info = info
        self._evaluate(replica)

    def _spawn(self, coro: Awaitable) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(r.client.close() for r in self._replicas.values()), return_exceptions=True)
        self._replicas.clear()


class Routes:
    """Both tiers' pools, fed by a discovery; picks a session's replica per tier."""

    def __init__(self, discovery: Discovery, drafts: ReplicaPool, targets: ReplicaPool):
        self.discovery = discovery
        self.drafts = drafts
        self.targets = targets
        self.pools = {Tier.DRAFT: drafts, Tier.TARGET: targets}
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> None:
        for pool in self.pools.values():
            pool.start()
        self.discovery.start(asyncio.get_running_loop(),
                             lambda tier, addresses: self.pools[tier].update(addresses))

    def describe(self) -> str:
        return "; ".join(pool.describe() for pool in self.pools.values())

    def usable(self, tier: Tier) -> bool:
        return bool(self.pools[tier].ready())

    def pick(self, tier: Tier, record: SessionRecord) -> ServiceClient:
        """The session's replica of this tier (Unavailable when none is usable). When that is not
        the replica the record names, the record is moved there holding nothing, and the copy the
        previous replica holds is released."""
        pool = self.pools[tier]
        client = pool.pick(record.session_id)
        if client is None:
            raise Unavailable(f"no {tier} replica is usable ({pool.describe()}); retry when one is back")
        previous = record.placement(tier).address
        if previous != client.address:
            record.place(tier, Placement(client.address, 0))
            stale = pool.ready_client(previous)
            if stale is not None:
                self._spawn(release_quietly(stale, record.session_id))
            log.debug("session %s: %s replica %s -> %s", record.session_id, tier, previous or "-",
                      client.address)
        return client

    def place(self, record: SessionRecord) -> None:
        """Record the session's replicas now (where there are usable ones)."""
        for tier in Tier:
            try:
                self.pick(tier, record)
            except Unavailable:
                pass

    def failed(self, tier: Tier, address: str) -> None:
        self.pools[tier].mark_failed(address)

    def suspect(self, tier: Tier, address: str) -> None:
        """A call to address timed out: checked at once, marked failed only if it is not alive."""
        self.pools[tier].suspect(address)

    async def check_alive(self, tier: Tier, address: str) -> bool:
        """As suspect, awaited: True when the replica answers (slow, not down) and stays in use."""
        return await self.pools[tier].check_alive(address)

    async def release(self, record: SessionRecord) -> None:
        """Free the session's KV caches on the replicas that hold them (best effort)."""
        clients = [self.pools[tier].ready_client(record.placement(tier).address) for tier in Tier]
        await asyncio.gather(*(release_quietly(c, record.session_id) for c in clients if c is not None))

    def _spawn(self, coro: Awaitable) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        await self.discovery.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(pool.close() for pool in self.pools.values()))
