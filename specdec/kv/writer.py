"""The writer of K/V chunks: `ChunkWriter` writes to a chunk store (chunk_store.py) on a background
thread so that a model forward never waits for the store: ``offer()`` enqueues without blocking
(or refuses, counted, when the bounded queue is full), the chunk's bytes are produced (encoded)
on the writer thread, batched into pipelined ``put_many`` calls and dropped, counted, if the
store fails. A key queued or written recently is not written again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from specdec.kv.chunk_stats import ChunkStoreStats
from specdec.kv.chunk_store import ChunkStore, MiB, as_bytes, check_key

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    """A chunk offered to the writer and not written yet."""

    produce: Callable[[], bytes]  # returns the chunk's bytes; called once, on the writer thread
    nbytes: int  # the caller's estimate of len(produce()), for the queue and batch bounds


class _Throttle:
    """At most one log line per `interval_s`; counts the ones it held back."""

    def __init__(self, interval_s: float = 60.0):
        self.interval_s = interval_s
        self._next = 0.0
        self.suppressed = 0

    def ready(self) -> bool:
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.interval_s
            return True
        self.suppressed += 1
        return False


class ChunkWriter:
    """Writes chunks to `store` on a background daemon thread, so that a forward never waits.

    `offer()` never blocks: it queues the chunk or refuses it (False, counted as skipped) when
    the chunks offered but not written yet — queued, or in the batch being written — number
    `max_pending` or would exceed `max_pending_bytes` (a chunk is always accepted by an empty
    queue). A key already queued, or written less than `recent_s` ago (one of the last
    `recent_keys` written), is not queued again: True, counted as deduplicated. A later offer
    after `recent_s` writes it again, which refreshes its TTL.

    The thread takes up to `max_batch_items` chunks (at most `max_batch_bytes` by their
    estimates) at a time, calls each one's `produce()`, and writes them in one `put_many`. A
    chunk whose produce() raises, or whose batch the store fails, is counted as a failed write
    and dropped — never retried — and the thread goes on. While the store backs off after a
    failure the thread drops chunks without producing them.

    `produce` runs on the writer thread while the caller goes on: what it reads must not
    change after `offer()` (encode from a snapshot of the K/V, not a view of a buffer that the
    next forward overwrites)."""

    def __init__(self, store: ChunkStore, max_pending: int = 1024,
                 max_pending_bytes: int = 256 * MiB, max_batch_items: int = 16,
                 max_batch_bytes: int = 64 * MiB, recent_keys: int = 4096, recent_s: float = 60.0,
                 name: str = "chunk-writer"):
        for label, value in (("max_pending", max_pending), ("max_pending_bytes", max_pending_bytes),
                             ("max_batch_items", max_batch_items), ("max_batch_bytes", max_batch_bytes)):
            if value < 1:
                raise ValueError(f"ChunkWriter {label} must be at least 1, got {value!r}")
        if recent_keys < 0 or recent_s < 0:
            raise ValueError(f"ChunkWriter recent_keys and recent_s must be >= 0, "
                             f"got {recent_keys!r} and {recent_s!r}")
        self.store = store
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self.max_batch_items = max_batch_items
        self.max_batch_bytes = max_batch_bytes
        self.recent_keys = recent_keys
        self.recent_s = recent_s
        self._cond = threading.Condition()
        self._queue: OrderedDict[bytes, _Pending] = OrderedDict()  # offered, not taken yet (FIFO)
        self._inflight: dict[bytes, int] = {}  # key → nbytes of the batch being written
        self._pending_bytes = 0  # nbytes of the queue and the batch in flight
        self._recent: OrderedDict[bytes, float] = OrderedDict()  # key → monotonic time written
        self._closing = False
        self._produce_log = _Throttle()
        self._put_log = _Throttle()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def stats(self) -> ChunkStoreStats:
        """The counters of the store and this writer (they share them)."""
        return self.store.stats()

    @property
    def pending(self) -> int:
        """Chunks offered and not written (or dropped) yet."""
        with self._cond:
            return len(self._queue) + len(self._inflight)

    def offer(self, key: bytes, produce: Callable[[], bytes], nbytes: int) -> bool:
        """Queue the chunk `key` (its bytes are `produce()`, about `nbytes` of them) without
        blocking. True when queued or already queued / written recently, False when refused
        (the queue is full, or the writer is closed)."""
        check_key(key)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
        counters = self.store.counters
        with self._cond:
            if key in self._queue or key in self._inflight or self._written_recently(key):
                counters.add(writes_deduplicated=1)
                return True
            pending = len(self._queue) + len(self._inflight)
            if (self._closing or pending >= self.max_pending
                    or (pending and self._pending_bytes + nbytes > self.max_pending_bytes)):
                counters.add(writes_skipped=1)
                return False
            self._queue[key] = _Pending(produce, nbytes)
            self._pending_bytes += nbytes
            self._cond.notify_all()
        return True

    def _written_recently(self, key: bytes) -> bool:
        written_at = self._recent.get(key)
        if written_at is None:
            return False
        if time.monotonic() - written_at < self.recent_s:
            return True
        del self._recent[key]
        return False

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every chunk offered so far is written or dropped; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._inflight, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush (for up to `timeout_s`), then stop the thread; chunks still queued are dropped
        (counted as failed). Offers after close are refused. Does not close the store."""
        deadline = time.monotonic() + timeout_s
        self.flush(timeout_s)
        with self._cond:
            self._closing = True
            dropped = len(self._queue)
            for pending in self._queue.values():
                self._pending_bytes -= pending.nbytes
            self._queue.clear()
            self._cond.notify_all()
        if dropped:
            self.store.counters.add(writes_failed=dropped)
            log.warning("chunk writer closed with %d chunk(s) not written; dropped them", dropped)
        self._thread.join(max(0.0, deadline - time.monotonic()))

    def _take(self) -> dict[bytes, _Pending] | None:
        """The next batch, moved from the queue to in flight; None when closing."""
        with self._cond:
            self._cond.wait_for(lambda: self._queue or self._closing)
            if self._closing:
                return None
            batch: dict[bytes, _Pending] = {}
            size = 0
            while self._queue and len(batch) < self.max_batch_items:
                key, pending = next(iter(self._queue.items()))
                if batch and size + pending.nbytes > self.max_batch_bytes:
                    break
                del self._queue[key]
                batch[key] = pending
                self._inflight[key] = pending.nbytes
                size += pending.nbytes
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            written: list[bytes] = []
            try:
                written = self._write(batch)
            except Exception:  # a bug here must not stop the writer
                log.exception("chunk writer: unexpected error writing %d chunk(s); dropped them", len(batch))
                self.store.counters.add(writes_failed=len(batch))
            finally:
                self._done(batch, written)

    def _write(self, batch: dict[bytes, _Pending]) -> list[bytes]:
        """Produce and store `batch`; the keys written (the failed ones are counted here)."""
        counters = self.store.counters
        if not self.store.available():
            counters.add(writes_failed=len(batch))
            return []
        items: list[tuple[bytes, bytes]] = []
        for key, pending in batch.items():
            try:
                value = as_bytes(pending.produce())
            except Exception as exc:
                counters.add(writes_failed=1)
                if self._produce_log.ready():
                    log.warning("chunk writer: produce() of chunk %s failed (%s: %s); the chunk is "
                                "not written%s", key.hex()[:12], exc.__class__.__name__, exc,
                                _held_back(self._produce_log), exc_info=True)
                continue
            items.append((key, value))
        if not items:
            return []
        try:
            self.store.put_many(items)
        except Exception as exc:
            counters.add(writes_failed=len(items))
            if self._put_log.ready():
                log.warning("chunk writer: dropped %d chunk(s): %s%s", len(items), exc,
                            _held_back(self._put_log))
            return []
        return [key for key, _ in items]

    def _done(self, batch: dict[bytes, _Pending], written: list[bytes]) -> None:
        now = time.monotonic()
        with self._cond:
            for key, pending in batch.items():
                self._inflight.pop(key, None)
                self._pending_bytes -= pending.nbytes
            if self.recent_keys:
                for key in written:
                    self._recent[key] = now
                    self._recent.move_to_end(key)
                while len(self._recent) > self.recent_keys:
                    self._recent.popitem(last=False)
            self._cond.notify_all()


def _held_back(throttle: _Throttle) -> str:
    count, throttle.suppressed = throttle.suppressed, 0
    return f" ({count} similar message(s) held back)" if count else ""
