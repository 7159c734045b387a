"""A Redis primary SIGKILLed under load, nothing acknowledged lost (--session-durability
replicas=1): Sentinel (a primary, two replicas, three sentinels) and Cluster (a primary killed,
its replica promoted; a slot migrated). Several coordinators' stores drive sessions round after
round; a client "receives" a round's tokens only once its save returned, and on a retryable
status retries as a real client does (on any coordinator, after the retry-after hint), first
checking that the store holds everything it received. Token i of every session is i, so the
store's list shows any loss, gap or reordering."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import pytest

from coordinator.sessions.durability import Durability
from coordinator.sessions.redis_store import RedisSessionStore, _keys
from specdec.errors import FailedPrecondition, SessionBusy, Unavailable
from tests.redis_ha import ClusterGroup, SentinelGroup, _wait

COORDINATORS = 3
CLIENTS = 12
ROUNDS = 5          # rounds of a request
TOKENS = 2          # tokens of a round
RETRYABLE = (Unavailable, FailedPrecondition, SessionBusy)
GAP_GOAL_S = 5.0


@dataclass
class Load:
    """What the clients saw."""

    received: dict[str, list[int]] = field(default_factory=dict)  # session -> tokens streamed
    commits: list[tuple[float, str]] = field(default_factory=list)  # (monotonic time, session)
    retried: int = 0                                              # requests failed retryably
    completed: int = 0                                            # requests that ran all rounds
    lost_on_retry: int = 0                                        # received tokens a retry missed
    statuses: dict[str, int] = field(default_factory=dict)
    last_error: str = ""


async def _client(stores: list[RedisSessionStore], load: Load, rng: random.Random, stop: asyncio.Event) -> None:
    session_id = None
    while not stop.is_set():
        store = rng.choice(stores)
        try:
            if session_id is None:
                session_id = (await store.create()).session_id
                load.received[session_id] = []
            lease = await store.acquire(session_id)
        except RETRYABLE as exc:
            load.statuses[type(exc).__name__] = load.statuses.get(type(exc).__name__, 0) + 1
            await asyncio.sleep(min(getattr(exc, "retry_after_s", None) or 0.05, 0.5))
            continue
        record, received = lease.record, load.received[session_id]
        held = record.token_ids[:len(received)]
        load.lost_on_retry += sum(1 for a, b in zip(held, received) if a != b) + len(received) - len(held)
        try:
            for _ in range(ROUNDS):
                start = len(record.token_ids)
                record.token_ids += range(start, start + TOKENS)
                await store.save(record, lease)
                load.received[session_id] = list(record.token_ids)  # streamed only once stored
                load.commits.append((time.monotonic(), session_id))
            load.completed += 1
        except RETRYABLE as exc:
            load.last_error = str(exc)[:300]
            load.retried += 1
            load.statuses[type(exc).__name__] = load.statuses.get(type(exc).__name__, 0) + 1
            await asyncio.sleep(0.05)
        finally:
            await store.release(lease)


async def run_load(url: str, fault, settle_s: float = 1.0, after_s: float = 2.0) -> tuple[Load, float]:
    """Clients generate through COORDINATORS stores; `fault(load)` (a thread) runs after settle_s and
    returns its time; the load goes on until every session committed again, and after_s more.
    Returns the load and the commit gap: the longest any session went from the fault to its next
    commit (detection + promotion + reconnection, for the sessions the fault hit)."""
    stores = [RedisSessionStore(url, socket_timeout_s=1.0, durability=Durability(1, 500))
              for _ in range(COORDINATORS)]
    load, stop = Load(), asyncio.Event()
    clients = [asyncio.create_task(_client(stores, load, random.Random(i), stop)) for i in range(CLIENTS)]
    try:
        await asyncio.sleep(settle_s)
        deadline = time.monotonic() + 30
        while len(load.commits) < CLIENTS:  # every client under way (a Cluster client starts slowly)
            assert time.monotonic() < deadline, f"the load did not start ({load.statuses}, {load.last_error})"
            await asyncio.sleep(0.05)
        faulted_at = await asyncio.to_thread(fault, load)
        deadline = time.monotonic() + 40
        while set(load.received) - {s for t, s in load.commits if t > faulted_at}:
            assert time.monotonic() < deadline, (
                f"a session made no commit for 60 s after the fault ({load.statuses}, {load.last_error})")
            for task in clients:
                if task.done():
                    task.result()  # a client that died of anything not retryable fails the test
            await asyncio.sleep(0.05)
        await asyncio.sleep(after_s)
    finally:
        stop.set()
        await asyncio.gather(*clients)
        await asyncio.gather(*(store.close() for store in stores))
    resumed = {}
    for t, session_id in load.commits:
        if t > faulted_at:
            resumed.setdefault(session_id, t)
    return load, max(resumed.values()) - faulted_at


async def lost_in_store(url: str, load: Load) -> tuple[int, int]:
    """(tokens checked, tokens lost): every session's stored list against what its client
    received; and every stored list must be 0, 1, 2, ... (in order, no gap)."""
    store = RedisSessionStore(url)
    checked = lost = 0
    try:
        for session_id, received in load.received.items():
            stored = (await store.get(session_id)).token_ids
            assert stored == list(range(len(stored))), f"session tokens out of order: {stored[:40]}"
            checked += len(received)
            lost += max(0, len(received) - len(stored))
    finally:
        await store.close()
    return checked, lost


def _report(name: str, load: Load, gap_s: float, checked: int, lost: int) -> None:
    print(f"\n{name}: commit gap {gap_s:.2f}s; requests completed {load.completed}, retried "
          f"{load.retried}; statuses {load.statuses}; tokens checked {checked}, lost {lost}, "
          f"lost on retry {load.lost_on_retry}")


def _check(load: Load, gap_s: float, checked: int, lost: int, felt: bool = True) -> None:
    assert lost == 0 and load.lost_on_retry == 0
    assert checked > 0 and load.completed > CLIENTS
    assert not felt or load.retried > 0  # the fault failed requests, which their retries completed
    assert gap_s <= 2 * GAP_GOAL_S, f"no commit for {gap_s:.1f}s (goal {GAP_GOAL_S}s)"


def test_sentinel_primary_killed_under_load(tmp_path):
    group = SentinelGroup(tmp_path).start()
    try:
        first = group.primary()

        def kill(_load: Load) -> float:
            first.proc.kill()
            return time.monotonic()
        load, gap_s = asyncio.run(run_load(group.url, kill))
        assert group.primary() is not first  # a replica was promoted
        checked, lost = asyncio.run(lost_in_store(group.url, load))
        _report("sentinel, primary SIGKILLed", load, gap_s, checked, lost)
        _check(load, gap_s, checked, lost)
    finally:
        group.stop()


def test_cluster_primary_killed_under_load(tmp_path):
    group = ClusterGroup(tmp_path).start()
    try:
        def kill(load: Load) -> float:
            key = _keys(load.commits[-1][1])[0]  # a session's primary
            victim = group.primary_of(key)
            victim.proc.kill()
            killed = time.monotonic()
            victim.proc.wait()
            victim.proc = None
            # its replica is promoted; then it comes back (as a pod would), as that one's replica
            _wait(lambda: group.primary_of(key).port != victim.port, "the replica's promotion")
            victim.start()
            return killed
        load, gap_s = asyncio.run(run_load(group.url, kill))
        checked, lost = asyncio.run(lost_in_store(group.url, load))
        _report("cluster, primary SIGKILLed", load, gap_s, checked, lost)
        _check(load, gap_s, checked, lost)
    finally:
        group.stop()


def test_cluster_slot_migrated_under_load(tmp_path):
    group = ClusterGroup(tmp_path).start()
    try:
        def migrate(load: Load) -> float:
            key = _keys(load.commits[-1][1])[0]  # a session's slot, mid-request
            source = group.primary_of(key)
            target = next(s for s in group.servers[:3] if s.port != source.port
                          and s.client().info("replication")["role"] == "master")
            started = time.monotonic()
            group.migrate_slot(source.client().cluster("keyslot", key), source, target)
            assert group.primary_of(key).port == target.port
            return started
        load, gap_s = asyncio.run(run_load(group.url, migrate))
        checked, lost = asyncio.run(lost_in_store(group.url, load))
        _report("cluster, a slot migrated", load, gap_s, checked, lost)
        _check(load, gap_s, checked, lost, felt=False)  # MOVED and ASK are followed, not failed
    finally:
        group.stop()

