"""Per-session K/V caches, whatever the engine: a session's entry (its K/V in the engine's own
form, the tokens it holds and their fingerprints) and the LRU of the sessions, bound by count
and memory with incremental byte accounting. The torch engine's buffers are in
specdec/runtime/torch/kv_buffers.py, the graph engine's pool in specdec/runtime/graph/paged_kv.py.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from specdec.fingerprint import PrefixHashes

def _as_array(tokens: Sequence[int]) -> array:
    return tokens if isinstance(tokens, array) and tokens.typecode == "i" else array("i", tokens)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences (compared as C arrays)."""
    a, b = _as_array(a), _as_array(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class SessionCache:
    """The K/V of one session (`kv`: the torch engine's KVBuffer or DynamicKV, or another
    engine's own, with nbytes, crop and close), the token ids it holds and their prefix
    fingerprints. The first len(tokens) positions of `kv` are valid."""

    kv: Any
    tokens: array = field(default_factory=lambda: array("i"))
    hashes: PrefixHashes = field(default_factory=PrefixHashes)
    accounted: int = 0  # bytes counted for it in SessionCaches' total
    kept: bool = False  # in a SessionCaches (its bytes count there)
    chunks_kept_upto: int = 0  # leading tokens whose full chunks are in the prefix cache / store
    chunk_salt: str = ""  # the cache salt those chunks were keyed with

    def __len__(self) -> int:
        return len(self.tokens)

    def nbytes(self) -> int:
        return self.kv.nbytes()

    def append(self, tokens: Sequence[int]) -> None:
        """Record tokens the model has just run (their K/V are in `kv`)."""
        self.tokens.extend(tokens)
        self.hashes.extend(tokens)

    def holds(self, length: int, prefix_hash: int) -> bool:
        """True when the first `length` cached tokens have this fingerprint."""
        return length <= len(self.tokens) and self.hashes.at(length) == prefix_hash

    def crop(self, length: int) -> bool:
        """Keep the first `length` tokens. False when this cache cannot be cropped."""
        held = len(self.tokens)
        if held <= length:
            return True
        if not self.kv.crop(held, length):
            return False
        del self.tokens[length:]
        self.hashes.truncate(length)
        self.chunks_kept_upto = min(self.chunks_kept_upto, length)
        return True


class SessionCaches:
    """Caches by session id, least recently used first; thread-safe. The byte total is kept up
    to date call by call (`account`), never by scanning every session."""

    def __init__(self, max_sessions: int, max_bytes: int):
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, SessionCache] = OrderedDict()
        self._lock = threading.Lock()
        self._bytes = 0
        self.evictions = 0

    def get(self, session_id: str) -> SessionCache | None:
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is not None:
                self._entries.move_to_end(session_id)
            return entry

    def put(self, session_id: str, entry: SessionCache) -> None:
        with self._lock:
            old = self._entries.get(session_id)
            if old is not None and old is not entry:
                self._drop(session_id)
            self._entries[session_id] = entry
            entry.kept = True
            self._entries.move_to_end(session_id)
            self._account(entry)

    def account(self, entry: SessionCache) -> None:
        """Count an entry's current size (after it grew) in the total, if it is still kept."""
        with self._lock:
            self._account(entry)

    def _account(self, entry: SessionCache) -> None:
        if not entry.kept:  # released or evicted meanwhile: no longer counted
            return
        size = entry.nbytes()
        self._bytes += size - entry.accounted
        entry.accounted = size

    def _drop(self, session_id: str) -> SessionCache:
        entry = self._entries.pop(session_id)
        self._bytes -= entry.accounted
        entry.accounted, entry.kept = 0, False
        entry.kv.close()
        return entry

    def release(self, session_id: str) -> bool:
        with self._lock:
            if session_id not in self._entries:
                return False
            self._drop(session_id)
            return True

    def discard(self, session_id: str, entry: SessionCache) -> None:
        """Drop the session's cache if it is still `entry` (a failed forward left it inconsistent)."""
        with self._lock:
            if self._entries.get(session_id) is entry:
                self._drop(session_id)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._entries

    def total_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def enforce_limits(self, keep: Iterable[str] = (), extra_bytes: int = 0) -> list[str]:
        """Evict least recently used sessions (never those in `keep`) until within both bounds,
        with room for `extra_bytes` more (what a forward about to run will grow its buffers by)."""
        keep = {keep} if isinstance(keep, str) else set(keep)
        evicted: list[str] = []
        limit = self.max_bytes - extra_bytes
        with self._lock:
            if len(self._entries) <= self.max_sessions and self._bytes <= limit:
                return evicted
            for sid in list(self._entries):
                if len(self._entries) <= self.max_sessions and self._bytes <= limit:
                    break
                if sid in keep:
                    continue
                self._drop(sid)
                evicted.append(sid)
        self.evictions += len(evicted)
        return evicted
