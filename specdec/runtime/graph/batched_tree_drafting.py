"""A depth of every growing token tree of a batch at once, in tensor ops on the device.

The host loop's `tree_drafting.extend` reads each call's candidates to the host and picks its
children in Python: on a GPU a synchronisation per call per depth. `pick_depth` does the same
for all calls at once — each frontier row's TREE_WIDTH candidates, their path scores, the
beam's best TREE_WIDTH with the spine forced in — and `next_inputs` turns the kept children
into the next depth's frontier, still on the device, so the graph engine's tree loop
(graph/tree_loop.py) grows every depth without a host read and reads all of them back once;
`keep_slots` then adds each depth's kept children to the host's tree as `extend` adds them.
The trees are the host loop's, token for token, parent for parent, in order:

- Candidates are computed by the same operations as `tree_drafting.candidates`, row by row:
  greedy rows softmax at T = 1 then top-TREE_WIDTH; sampled rows the request's warp
  (`sampling.proposal_top_k`'s steps, each row its own temperature, top-k and top-p as
  tensors), with the same top-k width as the host (rows of different widths computed apart),
  and top-p applied only where it is below 1, as the host.
- Path scores are float64 products, as the host's Python floats (`above * prob` of a float32
  prob).
- The pool is sorted by −score stably in (frontier row, rank) order — the host's stable sort
  of the same list — with the candidates the host leaves out (probability 0, padding rows)
  last; the first TREE_WIDTH valid ones are kept, and where the spine's candidate (its parent's
  rank-0 child) is not among them it replaces the last, as on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specdec.maths.tree import TREE_WIDTH
from specdec.runtime.transfer import upload
from specdec.runtime.graph.batched_proposal import RowWarps, warped_top
from specdec.runtime.tree_drafting import Growing, keep
from specdec.types import SamplingParams


def topk_width(params: SamplingParams, width: int, vocab: int) -> int:
    """The top-k the host's proposal takes for a sampled row (`proposal_top_k`): the request's
    top-k where it is wider than `width`; 0 for a greedy row (its own path)."""
    if params.greedy:
        return 0
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    return min(vocab, max(width, top_k))


def candidate_rows(logits: torch.Tensor, params: Sequence[SamplingParams], warps: RowWarps,
                   width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `width` likeliest children and the draft's probability of each, as
    `tree_drafting.candidates` gives them row by row. logits [N, vocab]; params per row (host);
    warps the same on the device -> (ids [N, w], probs [N, w] float32), w = min(width, vocab)."""
    vocab = logits.shape[-1]
    w = min(width, vocab)
    wides = [topk_width(p, width, vocab) for p in params]  # 0: greedy
    ids = probs = None
    if 0 in wides:  # greedy rows: the softmax at T = 1, its top w
        best = torch.topk(torch.softmax(logits.float(), dim=-1), w, dim=-1)
        ids, probs = best.indices, best.values
    for wide in sorted(set(wides) - {0}):  # sampled rows, each top-k width apart (ties as on the host)
        wide_ids, wide_probs = warped_top(logits, warps, wide, w)
        if ids is None:
            ids, probs = wide_ids, wide_probs
            continue
        rows = upload([wide_of == wide for wide_of in wides], torch.bool, logits.device)[:, None]  # [N, 1]
        ids, probs = torch.where(rows, wide_ids, ids), torch.where(rows, wide_probs, probs)
    return ids, probs


@dataclass
class DepthInputs:
    """What a depth's selection reads besides the logits (on the device, carried from depth to
    depth by `next_inputs`)."""

    above: torch.Tensor  # [C, F] float64: each frontier row's path score (1 for the root; 0 in padding)
    live: torch.Tensor  # [C, F] bool: a real frontier row (not padding)
    spine_row: torch.Tensor  # [C] int64: the frontier row the spine goes on under (-1: it stopped)


def select(ids: torch.Tensor, probs: torch.Tensor, inputs: DepthInputs, keep_n: int) -> torch.Tensor:
    """Each tree's kept children (module docstring). ids, probs [C, F, w] -> [C, keep_n, 4] float64:
    per kept slot (valid, pool index = frontier row · w + rank, token, path score), in order."""
    C, F, w = ids.shape
    scores = inputs.above[:, :, None] * probs.double()  # [C, F, w] as the host's Python floats
    valid = inputs.live[:, :, None] & (probs > 0)  # [C, F, w]: what the host puts in its pool
    scores, valid, tokens = scores.reshape(C, F * w), valid.reshape(C, F * w), ids.reshape(C, F * w)
    key = torch.where(valid, -scores, torch.full_like(scores, float("inf")))  # left out: last
    order = torch.sort(key, dim=-1, stable=True).indices[:, :keep_n]  # [C, n]: (row, rank) order on ties
    chain = (inputs.spine_row * w).clamp(min=0)  # [C]: the spine's candidate (its parent's rank 0)
    chain_valid = (inputs.spine_row >= 0) & valid.gather(1, chain[:, None])[:, 0]  # [C]
    kept_valid = valid.gather(1, order)  # [C, n]
    in_kept = ((order == chain[:, None]) & kept_valid).any(dim=-1)  # [C]
    forced = chain_valid & ~in_kept  # the spine replaces the last kept child (valid: the pool held more)
    last = torch.arange(keep_n, device=ids.device)[None, :] == keep_n - 1  # [1, n]
    order = torch.where(forced[:, None] & last, chain[:, None], order)
    return torch.stack([kept_valid.double(), order.double(), tokens.gather(1, order).double(),
                        scores.gather(1, order)], dim=-1)


def pick_depth(logits: torch.Tensor, state: DepthInputs, params: Sequence[SamplingParams],
               warps: RowWarps) -> torch.Tensor:
    """One depth of every tree: logits [C, F, vocab] of each tree's frontier rows (padding rows
    anything); params and warps per row ([C · F]) -> the kept children [C, TREE_WIDTH, 4]
    float64 (`select`'s slots, those past the pool's size invalid)."""
    C, F, vocab = logits.shape
    ids, probs = candidate_rows(logits.reshape(C * F, vocab), params, warps, TREE_WIDTH)  # [C·F, w]
    w = ids.shape[-1]
    kept = select(ids.view(C, F, w), probs.view(C, F, w), state, min(TREE_WIDTH, F * w))  # [C, ≤n, 4]
    return torch.nn.functional.pad(kept, (0, 0, 0, TREE_WIDTH - kept.shape[1]))


def next_inputs(kept: torch.Tensor, state: DepthInputs, w: int) -> DepthInputs:
    """The next depth's inputs from this depth's kept slots [C, TREE_WIDTH, 4], on the device:
    the kept slots are the next frontier's rows (valid ones first, as `keep` lists them), and the
    spine goes on under the slot that holds its candidate (the spine's row's rank 0), if any."""
    valid = kept[..., 0] > 0  # [C, n]
    index = kept[..., 1].long()
    is_chain = valid & (index == state.spine_row[:, None] * w) & (state.spine_row >= 0)[:, None]  # [C, n]
    spine_row = torch.where(is_chain.any(dim=-1), is_chain.long().argmax(dim=-1), -1)  # [C]
    return DepthInputs(torch.where(valid, kept[..., 3], 0.0), valid, spine_row)


def keep_slots(growing: Growing, slots: Sequence[Sequence[float]], w: int) -> None:
    """A depth's kept children as `select` gives them (per slot: valid, pool index, token,
    path score; w candidates per frontier row) added to the tree as `tree_drafting.extend` adds them."""
    parent = growing.spine_parent()
    chain_index = growing.frontier.index(parent) * w if parent in growing.frontier else -1
    chosen: list[tuple[float, int, int]] = []  # (path score, parent node or -1, token)
    chain = None  # (parent, token) of the spine's next node
    for valid, index, token, score in slots:
        if valid:
            chosen.append((score, growing.frontier[int(index) // w], int(token)))
            if int(index) == chain_index:
                chain = chosen[-1][1:]
    keep(growing, chosen, chain)
