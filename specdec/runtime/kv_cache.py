"""Per-session KV caches with crop (the rollback) and an LRU bound by count and memory."""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

from transformers import DynamicCache

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
    """The KV cache of one session, the token ids it holds and their prefix fingerprints."""

    cache: Any = field(default_factory=DynamicCache)
    tokens: array = field(default_factory=lambda: array("i"))
    hashes: PrefixHashes = field(default_factory=PrefixHashes)

    def __len__(self) -> int:
        return len(self.tokens)

    def nbytes(self) -> int:
        total = 0
        for layer in getattr(self.cache, "layers", []):
            for name in ("keys", "values"):
                tensor = getattr(layer, name, None)
                if tensor is not None:
                    total += tensor.numel() * tensor.element_size()
        return total

    def append(self, tokens: Sequence[int]) -> None:
        """Record tokens the model has just run (their K/V are in `cache`)."""
        self.tokens.extend(tokens)
        self.hashes.extend(tokens)

    def holds(self, length: int, prefix_hash: int) -> bool:
        """True when the first `length` cached tokens have this fingerprint."""
        return length <= len(self.tokens) and self.hashes.at(length) == prefix_hash

    def crop(self, length: int) -> bool:
        """Keep the first `length` tokens. False when this cache cannot be cropped."""
        remove = len(self.tokens) - length
        if remove <= 0:
            return True
        if not getattr(self.cache, "is_croppable", True):
            return False
        self.cache.crop(-remove)  # transformers >= 5: a negative count removes that many tokens
        del self.tokens[length:]
        self.hashes.truncate(length)
        return True


class SessionCaches:
    """Caches by session id, least recently used first; thread-safe."""

    def __init__(self, max_sessions: int, max_bytes: int):
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, SessionCache] = OrderedDict()
        self._lock = threading.Lock()
        self.evictions = 0

    def get(self, session_id: str) -> SessionCache | None:
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is not None:
                self._entries.move_to_end(session_id)
            return entry

    def put(self, session_id: str, entry: SessionCache) -> None:
        with self._lock:
            self._entries[session_id] = entry
            self._entries.move_to_end(session_id)

    def release(self, session_id: str) -> bool:
        with self._lock:
            return self._entries.pop(session_id, None) is not None

    def discard(self, session_id: str, entry: SessionCache) -> None:
        """Drop the session's cache if it is still `entry` (a failed forward left it inconsistent)."""
        with self._lock:
            if self._entries.get(session_id) is entry:
                del self._entries[session_id]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._entries

    def total_bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes() for e in self._entries.values())

    def enforce_limits(self, keep: str | None = None) -> list[str]:
        """Evict least recently used sessions (never `keep`) until within both bounds."""
        evicted: list[str] = []
        with self._lock:
            sizes = {sid: e.nbytes() for sid, e in self._entries.items()}
            total = sum(sizes.values())
            for sid in list(self._entries):
                if len(self._entries) <= self.max_sessions and total <= self.max_bytes:
                    break
                if sid == keep:
                    continue
                del self._entries[sid]
                total -= sizes[sid]
                evicted.append(sid)
        self.evictions += len(evicted)
        return evicted
