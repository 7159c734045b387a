"""The draft's tree loop on the device: every depth of a batch's token trees, no host read inside.

What this module decides:
- After the first forward of a Propose batch (each tree call's feed, the root last), the loop
  picks depth 1's children of every tree from the root's logits (`batched_tree_drafting.select`:
  the host loop's choice, node for node), runs them as one forward, picks depth 2's from their
  logits, ... : S selections and S − 1 forwards, S the batch's deepest tree. A tree whose depth
  is reached goes on with the others (its extra depths are dropped when read back).
- Every depth runs TREE_WIDTH node slots per tree, whether or not that many were kept (a slot
  left empty runs token 0 and nothing sees it), so every forward's inputs but its tokens and
  tree window are known up front: depth d's nodes sit at the root's position + d, in the K/V
  slots allocated before the loop (graph/engine.py appends TREE_WIDTH · (S − 1) positions to
  each session and drops them all after: the session keeps its history only, as after the host
  loop). The tokens come from the selection, and each node's window row (itself and its
  ancestors among the tree's slots) is its parent's row plus its own slot, built on the device.
- The kept children of every depth stay on the device; the caller reads them back once
  ([C, S, TREE_WIDTH, 4]): the round's one host synchronisation.
- Each depth's forward goes through the engine's buckets (`CudaGraphRunner.forward_on_device`: the
  batch padded on the device, a captured graph replayed on CUDA for windows up to its 16 nodes,
  i.e. trees up to 5 deep; eager in the bucket's shape on a CPU, the same code); the selections
  between them are launched eagerly: the loop as a whole is not one captured graph yet.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Sequence

import torch

from specdec.maths.tree import TREE_WIDTH
from specdec.runtime.graph.batched_proposal import RowWarps
from specdec.runtime.graph.batched_tree_drafting import DepthInputs, next_inputs, pick_depth
from specdec.runtime.graph.batch import ForwardBatch
from specdec.types import SamplingParams


@dataclass
class TreeLoopInputs:
    """What a tree loop reads (one device)."""

    first_logits: torch.Tensor  # [C, vocab] float32: each tree's root logits (after its feed)
    base: torch.Tensor  # [C] int64: each tree's first node's index in its session (the root's + 1)
    slots: torch.Tensor  # [C, S − 1, TREE_WIDTH] int64: pool slot of each depth's nodes run
    block_tables: torch.Tensor  # [C, B] int64: each row's blocks, the loop's slots included
    warps: RowWarps  # [C] each tree's sampling warp (the rows' candidates)
    params: Sequence[SamplingParams]  # the same on the host (the candidates' top-k widths)


def expanded(warps: RowWarps, times: int) -> RowWarps:
    """Each row's warp repeated `times` times in a row: [C] -> [C · times]."""
    return RowWarps(*(getattr(warps, f.name)[:, None].expand(-1, times).reshape(-1) for f in fields(RowWarps)))


def run_tree_loop(forward: Callable[[ForwardBatch], torch.Tensor], inputs: TreeLoopInputs, depths: int) -> torch.Tensor:
    """The loop (module docstring) -> [C, depths, TREE_WIDTH, 4] float64 on the device: per depth
    and slot `select`'s (valid, pool index, token, path score), the pool's frontier rows being
    the previous depth's slots (the root at depth 1). forward: a ForwardBatch built on the device
    -> its logits [C, TREE_WIDTH, vocab] (CudaGraphRunner.forward_on_device)."""
    n = TREE_WIDTH
    logits = inputs.first_logits[:, None]  # [C, F, vocab], F = 1 at depth 1
    C, _, vocab = logits.shape
    device = logits.device
    window = max(1, n * (depths - 1))  # W: the slots of every depth run
    state = DepthInputs(torch.ones((C, 1), dtype=torch.float64, device=device),
                        torch.ones((C, 1), dtype=torch.bool, device=device),
                        torch.zeros((C,), dtype=torch.long, device=device))
    warps = {1: inputs.warps, n: expanded(inputs.warps, n)}
    params = {F: [p for p in inputs.params for _ in range(F)] for F in warps}
    own = torch.eye(n, window, dtype=torch.bool, device=device)  # [n, W]: depth 1's slots
    columns = torch.arange(n, device=device)[None, :]  # [1, n]
    w = min(n, vocab)  # candidates per frontier row
    rows_seen = None  # [C, n, W]: each slot of the last depth run sees these slots
    kept_all = []
    for d in range(1, depths + 1):
        F = logits.shape[1]
        kept = pick_depth(logits, state, params[F], warps[F])  # [C, n, 4]
        kept_all.append(kept)
        if d == depths:
            break
        state = next_inputs(kept, state, w)
        mine = own.roll(n * (d - 1), dims=1)[None].expand(C, n, window)  # [C, n, W]: each slot itself
        if rows_seen is not None:  # and what its parent (a slot of the depth before) sees
            parents = (kept[..., 1].long() // w).clamp(0, n - 1)[:, :, None].expand(C, n, window)
            mine = mine | rows_seen.gather(1, parents)
        rows_seen = mine
        first = inputs.base[:, None] + n * (d - 1)  # [C, 1]: this depth's first slot's index
        positions = (inputs.base + d - 1)[:, None].expand(C, n)  # the root's position + d
        tokens = torch.where(state.live, kept[..., 2].long(), 0)  # [C, n]
        step = ForwardBatch(tokens, positions, inputs.slots[:, d - 1], first + columns, inputs.block_tables,
                            first[:, 0] + n, inputs.base, rows_seen)
        logits = forward(step).float()  # [C, n, vocab]
    return torch.stack(kept_all, dim=1)
