"""Per-session KV caches: preallocated buffers (rollback = a length decrement), an LRU bound by
count and memory with incremental byte accounting.

A session's K/V live in one tensor [layers, 2, kv_heads, capacity, head_dim] whose first
len(tokens) positions are valid: appending writes past them, a rollback only shortens the token
list, and the capacity grows geometrically, so the history is copied O(1) times amortised
instead of once per forward (as concatenating caches do). Models whose cache cannot be held that
way (sliding-window or linear-attention layers) keep a transformers DynamicCache per session.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
from transformers import DynamicCache

from specdec.fingerprint import PrefixHashes

GRAIN = 4  # tokens: capacities are multiples of this
HEADROOM = 16  # a growth leaves room for needed/HEADROOM more tokens (at least GRAIN)


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


def grown_capacity(capacity: int, needed: int) -> int:
    """The capacity to grow to for `needed` tokens: needed plus a sixteenth (at least GRAIN
    tokens), rounded up to GRAIN. The unused tail stays within 1/16 of the K/V plus a few
    tokens, so a session's buffer is within ~7-8 % of its theoretical K/V size from ~100 tokens
    on, while growing geometrically keeps the copying amortised O(1) per token (at most ≈16
    token copies per appended token)."""
    if needed <= capacity:
        return capacity
    target = needed + max(GRAIN, needed // HEADROOM)
    return -(-target // GRAIN) * GRAIN


@dataclass(frozen=True)
class KVSpec:
    """The shape of one token's K/V across the model: what a buffer row holds."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @property
    def bytes_per_token(self) -> int:
        """The model's theoretical K/V size of one token."""
        return self.layers * 2 * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


class KVBuffer:
    """One session's K/V: data [layers, 2, kv_heads, capacity, head_dim] (None until first use)."""

    __slots__ = ("spec", "data")

    def __init__(self, spec: KVSpec):
        self.spec = spec
        self.data: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return 0 if self.data is None else self.data.shape[3]

    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.numel() * self.data.element_size()

    def growth_bytes(self, needed: int) -> int:
        """What `reserve(needed, ...)` would add to this buffer's bytes."""
        if needed <= self.capacity:
            return 0
        return (grown_capacity(self.capacity, needed) - self.capacity) * self.spec.bytes_per_token

    def reserve(self, needed: int, held: int) -> None:
        """Room for `needed` tokens, keeping the first `held` (the only valid ones)."""
        if needed <= self.capacity:
            return
        s = self.spec
        capacity = grown_capacity(self.capacity, needed)
        # zeros, not empty: a batch reads whole rows, and garbage could hold NaN / inf
        data = torch.zeros((s.layers, 2, s.kv_heads, capacity, s.head_dim), dtype=s.dtype, device=s.device)
        if self.data is not None and held:
            data[:, :, :, :held].copy_(self.data[:, :, :, :held])
        self.data = data

    def crop(self, held: int, length: int) -> bool:
        """Keep the first `length` positions: nothing to do (positions past the token count are
        overwritten by the next append)."""
        return True

    def close(self) -> None:
        """The session is dropped: nothing to do (the tensor is freed with the object)."""


class DynamicKV:
    """Fallback for caches a buffer cannot hold: a transformers DynamicCache (grown by concatenation)."""

    __slots__ = ("cache",)

    def __init__(self) -> None:
        self.cache: Any = DynamicCache()

    def nbytes(self) -> int:
        total = 0
        for layer in getattr(self.cache, "layers", []):
            for name in ("keys", "values"):
                tensor = getattr(layer, name, None)
                if tensor is not None:
                    total += tensor.numel() * tensor.element_size()
        return total

    def crop(self, held: int, length: int) -> bool:
        if not getattr(self.cache, "is_croppable", True):
            return False
        self.cache.crop(length - held)  # transformers >= 5: a negative count removes that many tokens
        return True

    def close(self) -> None:
        """The session is dropped: nothing to do (the tensors are freed with the object)."""


@dataclass
class SessionCache:
    """The K/V of one session (`kv`: a KVBuffer, a DynamicKV or an engine's own, with nbytes,
    crop and close), the token ids it holds and their prefix fingerprints. The first
    len(tokens) positions of `kv` are valid."""

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
