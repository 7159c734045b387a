"""The counters of a chunk store and its writer: ``ChunkStoreStats``, a snapshot of them, and
``ChunkCounters``, the thread-safe counters behind it that a store (chunk_store.py) and its
writer (writer.py) share."""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class ChunkStoreStats:
    """Counters of one store and its writer since they were built (all monotonic)."""

    hits: int = 0  # chunks a get_many found
    misses: int = 0  # chunks a get_many asked for that the store does not hold (expired, never written)
    bytes_read: int = 0  # bytes of the chunks found
    chunks_written: int = 0  # chunks a put_many stored
    bytes_written: int = 0  # bytes of the chunks stored
    writes_skipped: int = 0  # offers refused because the writer's queue was full (or it was closed)
    writes_deduplicated: int = 0  # offers of a key already queued or written recently: not queued again
    # accepted chunks never stored: produce() raised, the store failed or backed off, or
    # close() dropped them
    writes_failed: int = 0
    read_errors: int = 0  # get_many calls that asked the store and failed: answered all None
    reads_skipped: int = 0  # get_many calls answered all None during the back-off, without asking the store


class ChunkCounters:
    """The thread-safe counters behind `ChunkStoreStats`, shared by a store and its writer."""

    _NAMES = frozenset(f.name for f in fields(ChunkStoreStats))

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self._NAMES, 0)

    def add(self, **deltas: int) -> None:
        unknown = deltas.keys() - self._NAMES
        if unknown:
            raise TypeError(f"unknown chunk store counter(s) {sorted(unknown)}; "
                            f"the counters are {sorted(self._NAMES)}")
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def snapshot(self) -> ChunkStoreStats:
        with self._lock:
            return ChunkStoreStats(**self._values)
