"""What the draft learns: the target's next-token distributions, kept as top-k, and the two
losses that pull the draft's towards them.

The target's distribution at a position is kept as its k most likely ids with their
probabilities, plus the mass of everything else (`rest`): memory O(k) per position, and the
draft's distribution is compared on the same k + 1 outcomes (its probabilities of those ids,
and the rest). On those outcomes:

* forward KL, Σ p log(p / q): the usual distillation loss; it punishes q for missing mass p
  has, so the draft spreads over what the target might say;
* total variation, ½ Σ |p − q|: 1 − TV is exactly the chance the target accepts a token drawn
  from q (specdec/maths/alignment.py), so minimising TV maximises α directly (DistillSpec,
  Zhou et al. 2024); computed on the k + 1 outcomes it is a lower bound of the full TV.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

EPS = 1e-12
TV_SMOOTHING = 1e-4  # in probability: the TV loss is exact above it
MATCHED = 1e-5       # a position whose loss is below this is matched (Pinsker: TV < 0.003 at KL 1e-5)


class Loss(StrEnum):
    KL = "kl"  # forward KL(p_target || q_draft)
    TV = "tv"  # total variation: 1 - α
    CE = "ce"  # heads only (specdec/distill/heads_training.py): cross-entropy on the data's token


@dataclass
class TopK:
    """The target's distributions over a batch of windows, top-k kept."""

    ids: torch.Tensor       # [..., k] int64, the k most likely ids per position
    probs: torch.Tensor     # [..., k] float32, their probabilities
    # (the rest, 1 - probs.sum(-1), is what all other ids hold)

    def to(self, device: torch.device | str) -> "TopK":
        return TopK(self.ids.to(device), self.probs.to(device))

    def __getitem__(self, index) -> "TopK":
        return TopK(self.ids[index], self.probs[index])


def top_k_of(logits: torch.Tensor, k: int, temperature: float = 1.0) -> TopK:
    """The top-k of softmax(logits / temperature): logits [..., vocab] -> TopK [..., k]."""
    if temperature <= 0:
        raise ValueError(f"the distillation temperature must be > 0, got {temperature}")
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    values, ids = torch.topk(log_probs, min(k, log_probs.shape[-1]), dim=-1)
    return TopK(ids, values.exp())


def _outcomes(student_logits: torch.Tensor, target: TopK, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, q) over the k + 1 outcomes (the target's top-k ids, then the rest), [..., k + 1]."""
    q_all = torch.softmax(student_logits.float() / temperature, dim=-1)
    q_top = q_all.gather(-1, target.ids)  # [..., k]
    q_rest = (1.0 - q_top.sum(-1, keepdim=True)).clamp_min(0.0)
    p_rest = (1.0 - target.probs.sum(-1, keepdim=True)).clamp_min(0.0)
    return torch.cat([target.probs, p_rest], -1), torch.cat([q_top, q_rest], -1)


def per_position(student_logits: torch.Tensor, target: TopK, loss: Loss, temperature: float = 1.0) -> torch.Tensor:
    """The loss at each position: student logits [..., vocab] (cut to the target's ids) -> [...]."""
    p, q = _outcomes(student_logits, target, temperature)
    return outcome_loss(p, q, loss)


def outcome_loss(p: torch.Tensor, q: torch.Tensor, loss: Loss) -> torch.Tensor:
    """The loss between the target's p and the student's q over the same outcomes, [..., n] -> [...]."""
    if loss == Loss.KL:
        return torch.where(p > 0, p * (torch.log(p.clamp_min(EPS)) - torch.log(q.clamp_min(EPS))), 0.0).sum(-1)
    if loss == Loss.TV:  # |x| smoothed below TV_SMOOTHING: its kink at p = q would turn float
        #                    rounding into full-size gradients at the optimum
        return 0.5 * (torch.sqrt((p - q) ** 2 + TV_SMOOTHING ** 2) - TV_SMOOTHING).sum(-1)
    raise ValueError(f"unknown loss {loss!r}")


def training_loss(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of the per-position losses `values` where `mask` is true, the positions already
    matched to within float rounding (a loss below MATCHED) counted as 0: their gradients are
    rounding noise, which Adam, scaling every step to the learning rate, would turn into full-size
    steps away from the optimum (a draft equal to the target would drift away from it)."""
    values = torch.where(values > MATCHED, values, 0.0)
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)
