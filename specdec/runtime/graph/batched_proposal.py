"""The draft's proposal and its draw for a whole batch of rows on the device, no host reads.

`HostDrafting` (drafting.py) warps each group of calls with `sampling.proposal_top_k` and draws
each token with `torch.multinomial`, reading every draw back to the host: on a GPU a
synchronisation per token. Here every row carries its own warp as tensors (`RowWarps`), so one
static-shape computation serves a batch of mixed requests and a captured graph can run it for
every step of the draft loop (graph/draft_loop.py).

Row r's (ids, probs) equal `proposal_top_k(logits[r], params_r, K)` — the request's warp,
truncated to its K most likely tokens and renormalised — and a greedy row's are a one-hot on its
argmax (first index on ties, as the host path). A row whose top-k is wider than K needs the
host path (`fits_on_device`): the normaliser of its warp needs more than K ranked tokens.

Draws are inverse-CDF with one uniform per row and step, drawn up front from the request's own
generator (`batched_acceptance.row_uniforms`): what a row draws never depends on its neighbours.
The draws differ from the host path's (multinomial), so a seeded request reproduces on the same
engine and every engine's tokens are exact draws from the q reported with them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch

from specdec.maths.batched_acceptance import inverse_cdf
from specdec.types import SamplingParams


@dataclass
class RowWarps:
    """Each row's sampling warp as tensors (one device)."""

    greedy: torch.Tensor  # [R] bool: the row takes the argmax (temperature below GREEDY_BELOW)
    temperature: torch.Tensor  # [R] float32: the logits' divisor (1 in greedy and padding rows)
    top_k: torch.Tensor  # [R] int64: 0 = off; otherwise at most K (fits_on_device)
    top_p: torch.Tensor  # [R] float32: 1 = off

    @classmethod
    def of(cls, params: Sequence[SamplingParams], rows: int | None = None) -> "RowWarps":
        """Host tensors for these requests, padded to `rows` with greedy rows."""
        rows = len(params) if rows is None else rows
        pad = rows - len(params)
        greedy = [p.greedy for p in params] + [True] * pad
        return cls(torch.tensor(greedy, dtype=torch.bool),
                   torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)] + [1.0] * pad),
                   torch.tensor([p.top_k for p in params] + [0] * pad, dtype=torch.long),
                   torch.tensor([p.top_p for p in params] + [1.0] * pad))

    def to(self, device: torch.device | str) -> "RowWarps":
        """On `device`, copied without blocking the host (pinned first on CUDA)."""
        cuda = torch.device(device).type == "cuda"
        return RowWarps(**{f.name: (getattr(self, f.name).pin_memory() if cuda else getattr(self, f.name))
                           .to(device, non_blocking=cuda) for f in fields(self)})

    def copy_into(self, static: "RowWarps") -> None:
        """Copy into warps of the same shape (a captured graph's static inputs)."""
        for f in fields(self):
            getattr(static, f.name).copy_(getattr(self, f.name), non_blocking=True)


def fits_on_device(params: SamplingParams, k: int, vocab: int) -> bool:
    """The request's proposal is computed by `proposal_rows` (module docstring)."""
    return params.greedy or not 0 < params.top_k < vocab or params.top_k <= k


def proposal_rows(logits: torch.Tensor, warps: RowWarps, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, vocab] -> (ids [R, K'], probs [R, K'] float32), K' = min(K, vocab), most likely
    first: each row's proposal distribution (module docstring). Tokens its warp drops have
    probability 0; a greedy row has all its mass in column 0."""
    k = min(k, logits.shape[-1])
    ids, probs = warped_top(logits, warps, k, k)  # [R, K']
    first = torch.arange(k, device=logits.device)[None, :] == 0  # [1, K']
    greedy = warps.greedy[:, None]  # [R, 1]
    ids = torch.where(greedy & first, logits.argmax(dim=-1, keepdim=True), ids)
    probs = torch.where(greedy, first.to(probs.dtype), probs)
    return ids, probs


def warped_top(logits: torch.Tensor, warps: RowWarps, wide: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`sampling.proposal_top_k` of each row with its own warp: its top-`wide` tokens (at least
    its top-k where that is on) cut to `width`, top-p applied only where it is below 1, as the
    host does. logits [N, vocab] -> (ids [N, width], probs [N, width] float32), most likely first."""
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


def draw_rows(logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, warps: RowWarps,
              uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token and how sure the draft was of it -> (tokens [R] int64, confidence [R]
    float32). ids, probs [R, K'] from proposal_rows; uniforms [R]. Confidence: the q of the
    drawn token, or for a greedy row its argmax's probability at temperature 1 (as the host path)."""
    pick = inverse_cdf(probs, uniforms)  # [R]: column 0 for a greedy row
    tokens = ids.gather(1, pick[:, None]).squeeze(1)  # [R]
    raw = logits.float()
    sure_of_argmax = torch.exp(raw.max(dim=-1).values - torch.logsumexp(raw, dim=-1))  # [R]
    drawn_q = probs.gather(1, pick[:, None]).squeeze(1)  # [R]
    return tokens, torch.where(warps.greedy, sure_of_argmax, drawn_q)
