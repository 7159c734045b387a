"""The torch engine's per-session K/V: preallocated buffers (rollback = a length decrement).

A session's K/V live in one tensor [layers, 2, kv_heads, capacity, head_dim] whose first
len(tokens) positions are valid: appending writes past them, a rollback only shortens the token
list, and the capacity grows geometrically, so the history is copied O(1) times amortised
instead of once per forward (as concatenating caches do). Models whose cache cannot be held that
way (sliding-window or linear-attention layers) keep a transformers DynamicCache per session.
Either is the `kv` of a session's entry (specdec/runtime/kv_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

GRAIN = 4  # tokens: capacities are multiples of this
HEADROOM = 16  # a growth leaves room for needed/HEADROOM more tokens (at least GRAIN)


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
