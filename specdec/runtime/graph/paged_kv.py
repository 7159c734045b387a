"""Paged K/V: every session's keys and values in fixed-size blocks of one preallocated pool.

What this module decides:
- The pool is allocated ONCE, at start, from a memory budget (bytes; on CUDA also a fraction of
  the free device memory): one tensor per layer, [2, blocks, block_size, kv_heads, head_dim]
  (keys then values), so a forward writes and reads a layer's K/V with one indexed copy.
- A session is a block table (physical block ids, in order) and a length. Sessions of any length
  share the pool; nothing is ever copied to grow one: appending takes blocks off a free list.
- Block 0 is never handed out: it is the "null block" that padding writes to and that padded
  block-table entries point at, so a batch padded to a static shape needs no special cases.
- Rollback is a length edit that frees the whole blocks past the new length; keeping a tree's
  accepted path moves those nodes' rows to consecutive slots, then rolls back.
- A full pool raises ResourceExhausted (RESOURCE_EXHAUSTED on the wire) and changes nothing.

One model worker thread drives a PagedKV (as with SessionCaches' users): no locking here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from specdec.errors import InvalidArgument, NotFound, ResourceExhausted

NULL_BLOCK = 0  # the block padding writes to; never allocated to a session
DEFAULT_BLOCK_SIZE = 16  # tokens per block


@dataclass(frozen=True)
class PoolSpec:
    """The shape of the pool: what one token's K/V is and how tokens are grouped."""

    layers: int  # decoder layers (one pool tensor each)
    kv_heads: int  # key/value heads per layer
    head_dim: int  # channels per head
    dtype: torch.dtype  # element type of the K/V
    device: torch.device  # where the pool lives
    block_size: int = DEFAULT_BLOCK_SIZE  # tokens per block

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across every layer."""
        return self.layers * 2 * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


def budget_bytes(memory: int | float, device: torch.device | str, reserve: int = 0) -> int:
    """The bytes a pool may take: `memory` bytes when it is an int (or a float > 1), else that
    fraction of the free memory of a CUDA device (0 < fraction <= 1) once `reserve` bytes (what
    capture will take) are set aside."""
    device = torch.device(device)
    if isinstance(memory, int) or memory > 1:
        if memory <= 0:
            raise InvalidArgument(f"the K/V pool budget must be > 0 bytes, got {memory}")
        return int(memory)
    if not 0 < memory <= 1:
        raise InvalidArgument(f"a K/V pool budget fraction must be in (0, 1], got {memory}")
    if device.type != "cuda":
        raise InvalidArgument(f"a K/V pool budget as a fraction of free memory needs a CUDA device; "
                              f"on {device} give it in bytes")
    free, _total = torch.cuda.mem_get_info(device)
    return fraction_of_free(free, memory, reserve)


def fraction_of_free(free: int, fraction: float, reserve: int) -> int:
    """The pool's bytes under --kv-cache-memory-fraction: the fraction of what is free once the
    capture's reserve is set aside (measured before capture, so the graphs still fit after)."""
    return int(max(0, free - reserve) * fraction)


def blocks_for(spec: PoolSpec, budget: int) -> int:
    """How many blocks (the null block included) fit in `budget` bytes; at least 2 are needed."""
    blocks = budget // spec.bytes_per_block
    if blocks < 2:
        raise InvalidArgument(f"a K/V pool budget of {budget} bytes holds {blocks} block(s) of "
                              f"{spec.bytes_per_block} bytes; at least 2 are needed (one is the null block)")
    return int(blocks)


@dataclass
class SessionBlocks:
    """One session's place in the pool."""

    blocks: list[int] = field(default_factory=list)  # physical block ids, in token order
    length: int = 0  # tokens whose K/V are valid (the first `length` slots of the table)


class PagedKV:
    """The pool, its free list and every session's block table."""

    def __init__(self, spec: PoolSpec, num_blocks: int):
        if num_blocks < 2:
            raise InvalidArgument(f"a K/V pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        # zeros, not empty: padded reads see finite values (a NaN times a zero weight is NaN)
        self.pools: list[torch.Tensor] = [
            torch.zeros((2, num_blocks, spec.block_size, spec.kv_heads, spec.head_dim),
                        dtype=spec.dtype, device=spec.device)
            for _ in range(spec.layers)]  # per layer: [2, blocks, block_size, kv_heads, head_dim]
        # a stack: the block freed last is reused first (it is likely still in a cache)
        self._free: list[int] = list(range(num_blocks - 1, NULL_BLOCK, -1))
        self.sessions: dict[str, SessionBlocks] = {}

    @classmethod
    def from_budget(cls, spec: PoolSpec, memory: int | float) -> "PagedKV":
        """A pool of as many blocks as `memory` allows (see budget_bytes)."""
        return cls(spec, blocks_for(spec, budget_bytes(memory, spec.device)))

    # ---- accounting --------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool holds when every block is in use."""
        return (self.num_blocks - 1) * self.spec.block_size

    def blocks_needed(self, length: int) -> int:
        return -(-length // self.spec.block_size)

    def _session(self, session_id: str) -> SessionBlocks:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise NotFound(f"no K/V for session {session_id!r} in the paged pool") from None

    def length(self, session_id: str) -> int:
        return self._session(session_id).length

    def block_table(self, session_id: str) -> list[int]:
        return list(self._session(session_id).blocks)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.sessions

    # ---- session operations ------------------------------------------------------------------

    def new_session(self, session_id: str) -> None:
        """An empty session (an existing one of that id is dropped first)."""
        self.drop(session_id)
        self.sessions[session_id] = SessionBlocks()

    def reserve(self, needs: dict[str, int]) -> None:
        """Make room for needs[session] more tokens in each session, all or nothing:
        ResourceExhausted (nothing allocated) when the pool cannot hold them all."""
        wanted = {sid: self.blocks_needed(self._session(sid).length + n) - len(self._session(sid).blocks)
                  for sid, n in needs.items()}
        total = sum(max(0, w) for w in wanted.values())
        if total > len(self._free):
            tokens = sum(needs.values())
            raise ResourceExhausted(
                f"the paged K/V pool is full: {tokens} more tokens need {total} blocks of "
                f"{self.spec.block_size} tokens, {len(self._free)} of {self.num_blocks - 1} are free; "
                "retry when sessions end, or give the pool a larger memory budget")
        for sid, w in wanted.items():
            blocks = self.sessions[sid].blocks
            for _ in range(w):
                blocks.append(self._free.pop())

    def append(self, session_id: str, n: int) -> list[int]:
        """Add n tokens to a session (allocating blocks): the flat pool slots their K/V go to."""
        if n < 0:
            raise InvalidArgument(f"cannot append {n} tokens")
        self.reserve({session_id: n})
        entry = self.sessions[session_id]
        start = entry.length
        entry.length += n
        return self.slots(session_id, start, entry.length)

    def slots(self, session_id: str, begin: int, end: int) -> list[int]:
        """The flat slots (block * block_size + offset) of a session's positions [begin, end)."""
        entry, size = self._session(session_id), self.spec.block_size
        if not 0 <= begin <= end <= len(entry.blocks) * size:
            raise InvalidArgument(f"positions [{begin}, {end}) are outside session {session_id!r}'s "
                                  f"{len(entry.blocks)} blocks")
        return [entry.blocks[i // size] * size + i % size for i in range(begin, end)]

    def truncate(self, session_id: str, length: int) -> None:
        """Keep a session's first `length` tokens (rollback): a length edit; whole blocks past
        it go back to the free list. A length at or past the current one changes nothing."""
        entry = self._session(session_id)
        if length < 0:
            raise InvalidArgument(f"cannot truncate to {length} tokens")
        if length >= entry.length:
            return
        entry.length = length
        keep = self.blocks_needed(length)
        while len(entry.blocks) > keep:
            self._free.append(entry.blocks.pop())

    def keep_path(self, session_id: str, base: int, path: Sequence[int]) -> None:
        """After a tree's forward: keep the first `base` tokens, then the tree nodes `path`
        (node indices counted from base, ascending) moved to the slots right after them."""
        entry = self._session(session_id)
        if list(path) != sorted(set(path)) or (path and (path[0] < 0 or base + path[-1] >= entry.length)):
            raise InvalidArgument(f"path {list(path)} is not ascending nodes within session "
                                  f"{session_id!r}'s {entry.length - base} tokens after {base}")
        moves = [(base + node, base + k) for k, node in enumerate(path) if node != k]
        if moves:
            self.move_slots(self.slots_of(entry, [s for s, _ in moves]), self.slots_of(entry, [d for _, d in moves]))
        self.truncate(session_id, base + len(path))

    def move_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy the K/V rows of pool slots `src` to slots `dst` in every layer (overlaps safe)."""
        src_t = torch.tensor(list(src), device=self.spec.device)
        dst_t = torch.tensor(list(dst), device=self.spec.device)
        for pool in self.pools:
            flat = pool.view(2, -1, self.spec.kv_heads, self.spec.head_dim)  # [2, slots, kv_heads, dim]
            flat[:, dst_t] = flat[:, src_t]  # the right side is gathered first: overlaps are safe

    def slots_of(self, entry: SessionBlocks, positions: Sequence[int]) -> list[int]:
        size = self.spec.block_size
        return [entry.blocks[p // size] * size + p % size for p in positions]

    def drop(self, session_id: str) -> bool:
        """Forget a session; its blocks go back to the free list. False when it was not held."""
        entry = self.sessions.pop(session_id, None)
        if entry is None:
            return False
        self._free.extend(reversed(entry.blocks))
        return True

    # ---- K/V rows in and out (for K/V chunks: a chunk of block_size tokens is one block) -----

    def read(self, session_id: str, begin: int, end: int) -> torch.Tensor:
        """A copy of a session's K/V at positions [begin, end) -> [layers, 2, kv_heads, n, head_dim]
        (the layout of the torch engine's chunks)."""
        entry = self._session(session_id)
        if not 0 <= begin <= end <= entry.length:
            raise InvalidArgument(f"positions [{begin}, {end}) are outside session {session_id!r}'s "
                                  f"{entry.length} tokens")
        slots = torch.tensor(self.slots_of(entry, range(begin, end)), device=self.spec.device)
        rows = [pool.view(2, -1, self.spec.kv_heads, self.spec.head_dim)[:, slots] for pool in self.pools]
        return torch.stack(rows).transpose(2, 3).contiguous()  # [layers, 2, kv_heads, n, dim]

    def extend(self, session_id: str, chunk: torch.Tensor) -> None:
        """Append tokens whose K/V are `chunk` [layers, 2, kv_heads, n, head_dim] to a session."""
        n = chunk.shape[3]
        slots = torch.tensor(self.append(session_id, n), device=self.spec.device)
        rows = chunk.to(device=self.spec.device, dtype=self.spec.dtype).transpose(2, 3)  # [layers, 2, n, kv_heads, dim]
        for layer, pool in enumerate(self.pools):
            pool.view(2, -1, self.spec.kv_heads, self.spec.head_dim)[:, slots] = rows[layer]
