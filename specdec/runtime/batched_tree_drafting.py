"""A depth of every growing token tree of a batch at once, on the device: one host read per depth.

The host loop's `tree_drafting.extend` reads each call's candidates to the host and picks its
children in Python: on a GPU a synchronisation per call per depth. `extend_batch` does the same
for all calls in tensor ops — each frontier row's TREE_WIDTH candidates, their path scores, the
beam's best TREE_WIDTH with the spine forced in — and reads the kept children of the whole batch
back in ONE packed read, from which each call's bookkeeping (`tree_drafting.keep`) goes on as
on the host. The trees are the host loop's, token for token, parent for parent, in order:

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
from specdec.runtime.batched_proposal import RowWarps
from specdec.runtime.tree_drafting import _Growing, keep
from specdec.types import SamplingParams


def topk_width(params: SamplingParams, width: int, vocab: int) -> int:
    """The top-k the host's proposal takes for a sampled row (`proposal_top_k`): the request's
    top-k where it is wider than `width`; 0 for a greedy row (its own path)."""
    if params.greedy:
        return 0
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    return min(vocab, max(width, top_k))


def warped_top(logits: torch.Tensor, warps: RowWarps, wide: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`proposal_top_k` of each row with its own warp, top-`wide` then cut to `width`.
    logits [N, vocab] -> (ids [N, width], probs [N, width] float32), most likely first."""
    vocab = logits.shape[-1]
    scaled = logits.float() / warps.temperature[:, None]  # [N, vocab]
    values, ids = torch.topk(scaled, wide, dim=-1)  # [N, wide] most likely first
    cuts = (warps.top_k > 0) & (warps.top_k < vocab)  # [N]
    kth = values.gather(1, (warps.top_k - 1).clamp(0, wide - 1)[:, None])  # [N, 1]
    kth = kth.masked_fill(~cuts[:, None], float("-inf"))  # nothing cut where top-k is off
    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    values = values.masked_fill(values < kth, float("-inf"))
    values, ids = values[:, :width], ids[:, :width]  # [N, width]
    probs = torch.exp(values - torch.logsumexp(scaled, dim=-1, keepdim=True))  # warped p of each
    mass_before = torch.cumsum(probs, dim=-1) - probs
    nucleus = probs.masked_fill(mass_before >= warps.top_p[:, None], 0.0)  # the first token is always kept
    probs = torch.where((warps.top_p < 1.0)[:, None], nucleus, probs)
    return ids, probs / probs.sum(dim=-1, keepdim=True)


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
        rows = _upload([wide_of == wide for wide_of in wides], torch.bool, logits.device)[:, None]  # [N, 1]
        ids, probs = torch.where(rows, wide_ids, ids), torch.where(rows, wide_probs, probs)
    return ids, probs


@dataclass
class DepthInputs:
    """What a depth's selection reads besides the logits: host values, for `select`."""

    above: torch.Tensor  # [C, F] float64: each frontier row's path score (1 for the root; 0 in padding)
    live: torch.Tensor  # [C, F] bool: a real frontier row (not padding)
    spine_row: torch.Tensor  # [C] int64: the frontier row the spine goes on under (-1: it stopped)

    @classmethod
    def of(cls, live: Sequence[_Growing], rows: int, device: torch.device) -> "DepthInputs":
        """The host's values for these trees, frontiers padded to `rows`, uploaded in one copy."""
        packed = []  # per tree: F scores, F flags, the spine's row
        for growing in live:
            scores = [1.0 if node < 0 else growing.scores[node] for node in growing.frontier]
            pad = rows - len(scores)
            parent = growing.spine_parent()
            spine_row = growing.frontier.index(parent) if parent in growing.frontier else -1
            packed.append(scores + [0.0] * pad + [1.0] * len(scores) + [0.0] * pad + [float(spine_row)])
        values = _upload(packed, torch.float64, device)  # [C, 2F + 1]
        return cls(values[:, :rows], values[:, rows:2 * rows] > 0, values[:, 2 * rows].long())


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


def extend_batch(live: Sequence[_Growing], logits: Sequence[torch.Tensor]) -> None:
    """A depth of every growing tree at once (`tree_drafting.ExtendAll`): per tree logits
    [frontier, vocab] on the device; one host read for the batch."""
    device = logits[0].device
    rows = max(len(growing.frontier) for growing in live)  # F
    padded = torch.cat([torch.nn.functional.pad(x, (0, 0, 0, rows - x.shape[0])) for x in logits])  # [C·F, vocab]
    params = [growing.params for growing in live for _ in range(rows)]
    ids, probs = candidate_rows(padded, params, RowWarps.of(params).to(device), TREE_WIDTH)  # [C·F, w]
    w = ids.shape[-1]
    keep_n = min(TREE_WIDTH, rows * w)
    kept = select(ids.view(len(live), rows, w), probs.view(len(live), rows, w), DepthInputs.of(live, rows, device),
                  keep_n).tolist()  # the batch's one host read this depth
    for growing, slots in zip(live, kept):
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


def _upload(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host data on the device without blocking the host (pinned on CUDA)."""
    tensor = torch.tensor(data, dtype=dtype)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
