"""Per-session KV caches with crop (the rollback) and an LRU bound by count and memory."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from transformers import DynamicCache


@dataclass
class SessionCache:
    """The KV cache of one session and the token ids it holds, in order."""

    cache: Any = field(default_factory=DynamicCache)
    tokens: list[int] = field(default_factory=list)

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

    def crop(self, length: int) -> bool:
        """Keep the first `length` tokens. False when this cache cannot be cropped."""
        remove = len(self.tokens) - length
        if remove <= 0:
            return True
        if not getattr(self.cache, "is_croppable", True):
            return False
        self.cache.crop(-remove)  # transformers >= 5: a negative count removes that many tokens
        del self.tokens[length:]
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
