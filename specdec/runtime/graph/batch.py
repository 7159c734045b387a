"""One forward's inputs as static-shape tensors: what the graph model reads and a CUDA graph's
static buffers hold.

What this module decides:
- A batch is R rows × Q query columns. Each row is one session; its n new tokens are
  right-aligned in the row (columns Q − n … Q − 1), so the last k columns hold every row's
  last k tokens and one slice serves all rows' logits.
- Each token carries its rotary position, the flat pool slot its K/V is written to, and its
  index in the row's sequence. A row reads its K/V through a block table of B entries.
- Attention: query i of row r sees key j < kv_lens[r] when either j is before the row's tree
  window and causally before it (j <= key_index), or j is in the window and window_mask says
  node j is i's ancestor or itself. A chain has an empty window (window_start = kv_lens).
  Padding tokens see only key 0 (never nothing: a fully masked row would give NaN).
- Building a batch appends the rows' tokens to their sessions in the pool (all rows or none).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch

from specdec.errors import InvalidArgument
from specdec.runtime.graph.paged_kv import NULL_BLOCK, PagedKV
from specdec.maths.tree import TokenTree


@dataclass(frozen=True)
class RowInput:
    """One session's part of a forward."""

    session_id: str  # the session in the PagedKV (created with new_session)
    tokens: Sequence[int]  # new tokens, appended to the session by this forward
    keep_logits: int = 1  # logits wanted for the row's last keep_logits tokens
    tree: TokenTree | None = None  # the session's last len(tree) tokens after this forward (None: a chain)


@dataclass(frozen=True)
class BatchShape:
    """The static dimensions of a batch (a CUDA-graph bucket is one)."""

    rows: int  # R: sessions
    tokens: int  # Q: query columns per row
    blocks: int  # B: block-table entries per row
    window: int  # W: tree nodes a window mask covers

    def holds(self, other: "BatchShape") -> bool:
        return (self.rows >= other.rows and self.tokens >= other.tokens and self.blocks >= other.blocks
                and self.window >= other.window)


@dataclass
class ForwardBatch:
    """The tensors of one forward (all on one device)."""

    tokens: torch.Tensor  # [R, Q] long: each row's new tokens, right-aligned (0 in padding)
    positions: torch.Tensor  # [R, Q] long: rotary position of each token (0 in padding)
    slots: torch.Tensor  # [R, Q] long: flat pool slot (block * block_size + offset) its K/V goes to
    key_index: torch.Tensor  # [R, Q] long: the token's index in its row's sequence (-1: padding)
    block_tables: torch.Tensor  # [R, B] long: the row's physical blocks (the null block past its end)
    kv_lens: torch.Tensor  # [R] long: keys valid in the row once this forward has written its tokens
    window_start: torch.Tensor  # [R] long: index of the row's first tree node (kv_lens for a chain)
    window_mask: torch.Tensor  # [R, Q, W] bool: query i sees tree node w (an ancestor or itself)

    @property
    def shape(self) -> BatchShape:
        rows, tokens = self.tokens.shape
        return BatchShape(rows, tokens, self.block_tables.shape[1], self.window_mask.shape[2])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "ForwardBatch":
        return ForwardBatch(**{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
                               for f in fields(self)})

    def copy_into(self, static: "ForwardBatch") -> None:
        """Copy every tensor into a batch of the same shape (a graph's static inputs)."""
        for f in fields(self):
            getattr(static, f.name).copy_(getattr(self, f.name), non_blocking=True)


def pad_batch(batch: ForwardBatch, shape: BatchShape, null_slot: int) -> ForwardBatch:
    """`batch` padded to `shape` where it lies (a batch built on the device, the tree loop's):
    padding rows and the columns before a row's tokens are padding tokens (token 0 writing to
    `null_slot`, the null block's first slot, seeing key 0 only), block tables end with the null
    block, windows with nodes no query sees."""
    R, Q = batch.tokens.shape
    rows, columns = shape.rows - R, shape.tokens - Q
    blocks, nodes = shape.blocks - batch.block_tables.shape[1], shape.window - batch.window_mask.shape[2]
    pad = torch.nn.functional.pad
    return ForwardBatch(pad(batch.tokens, (columns, 0, 0, rows)), pad(batch.positions, (columns, 0, 0, rows)),
                        pad(batch.slots, (columns, 0, 0, rows), value=null_slot),
                        pad(batch.key_index, (columns, 0, 0, rows), value=-1),
                        pad(batch.block_tables, (0, blocks, 0, rows), value=NULL_BLOCK),
                        pad(batch.kv_lens, (0, rows)), pad(batch.window_start, (0, rows)),
                        pad(batch.window_mask, (0, nodes, columns, 0, 0, rows)))


def ancestor_rows(tree: TokenTree) -> list[list[bool]]:
    """rows[i][j]: tree node i sees node j (j is i itself or one of its ancestors) -> [m][m]."""
    m = len(tree)
    rows = [[False] * m for _ in range(m)]
    for i, parent in enumerate(tree.parents):
        if parent:
            rows[i] = list(rows[parent - 1])  # parents come first: their rows are complete
        rows[i][i] = True
    return rows


def needed_shape(kv: PagedKV, rows: Sequence[RowInput]) -> BatchShape:
    """The smallest shape that holds these rows once their tokens are appended."""
    lengths = [kv.length(row.session_id) + len(row.tokens) for row in rows]
    return BatchShape(len(rows), max(len(row.tokens) for row in rows),
                      max(kv.blocks_needed(n) for n in lengths),
                      max((len(row.tree) for row in rows if row.tree is not None), default=1))


def check_rows(kv: PagedKV, rows: Sequence[RowInput]) -> None:
    """InvalidArgument for rows a batch cannot hold (before anything is appended)."""
    if not rows:
        raise InvalidArgument("a forward needs at least one row")
    ids = [row.session_id for row in rows]
    if len(set(ids)) != len(ids):
        raise InvalidArgument(f"a forward's rows must be distinct sessions, got {ids}")
    for row in rows:
        held = kv.length(row.session_id)
        if not row.tokens:
            raise InvalidArgument(f"row of session {row.session_id!r} has no tokens")
        if not 1 <= row.keep_logits <= len(row.tokens):
            raise InvalidArgument(f"keep_logits {row.keep_logits} is outside 1..{len(row.tokens)}")
        if row.tree is not None and not 1 <= len(row.tree) <= held + len(row.tokens) - 1:
            raise InvalidArgument(f"a tree of {len(row.tree)} nodes needs a root before it: session "
                                  f"{row.session_id!r} holds {held} + {len(row.tokens)} tokens")


def build_batch(kv: PagedKV, rows: Sequence[RowInput], shape: BatchShape) -> ForwardBatch:
    """Append each row's tokens to its session (allocating blocks; ResourceExhausted and nothing
    appended when the pool is full) and lay the forward out in `shape` (host tensors)."""
    check_rows(kv, rows)
    if not shape.holds(needed_shape(kv, rows)):
        raise InvalidArgument(f"rows need {needed_shape(kv, rows)}, more than the shape {shape}")
    R, Q, B, W = shape.rows, shape.tokens, shape.blocks, shape.window
    pasts = [kv.length(row.session_id) for row in rows]
    kv.reserve({row.session_id: len(row.tokens) for row in rows})
    tokens = [[0] * Q for _ in range(R)]
    positions = [[0] * Q for _ in range(R)]
    slots = [[NULL_BLOCK * kv.spec.block_size] * Q for _ in range(R)]
    key_index = [[-1] * Q for _ in range(R)]
    tables = [[NULL_BLOCK] * B for _ in range(R)]
    kv_lens = [0] * R
    window_start = [0] * R
    window_mask = [[[False] * W for _ in range(Q)] for _ in range(R)]
    for r, (row, past) in enumerate(zip(rows, pasts)):
        n = len(row.tokens)
        pad = Q - n
        row_slots = kv.append(row.session_id, n)
        end = past + n
        tokens[r][pad:] = list(row.tokens)
        positions[r][pad:] = range(past, end)
        slots[r][pad:] = row_slots
        key_index[r][pad:] = range(past, end)
        table = kv.block_table(row.session_id)
        tables[r][:len(table)] = table
        kv_lens[r] = end
        window_start[r] = end
        if row.tree is not None:
            place_tree(row.tree, r, n, end, positions, window_start, window_mask)
    as_long = lambda rows_: torch.tensor(rows_, dtype=torch.long)  # noqa: E731
    return ForwardBatch(as_long(tokens), as_long(positions), as_long(slots), as_long(key_index),
                        as_long(tables), as_long(kv_lens), as_long(window_start),
                        torch.tensor(window_mask, dtype=torch.bool))


def place_tree(tree: TokenTree, r: int, n: int, end: int, positions: list[list[int]],
               window_start: list[int], window_mask: list[list[list[bool]]]) -> None:
    """Row r's last len(tree) tokens are a tree: new nodes sit at the root's position + their
    depth and see their ancestors; nodes cached already are the history's last tokens."""
    m = len(tree)
    new = min(m, n)  # nodes run now (the row's last tokens)
    cached = m - new  # nodes the session holds already
    start = end - m
    window_start[r] = start
    root = start - 1  # the position of the token before the tree
    depths = tree.depths()
    sees = ancestor_rows(tree)
    Q = len(positions[r])
    for k in range(new):
        node = cached + k
        column = Q - new + k
        positions[r][column] = root + depths[node]
        window_mask[r][column][:m] = sees[node]
