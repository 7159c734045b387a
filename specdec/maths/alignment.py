"""How often a target accepts a draft's proposal at a position: α, from the two models' logits.

The acceptance step (acceptance.py) accepts a draft d drawn from q with probability
min(1, p(d) / q(d)), so at a position the chance that the target accepts the draft's proposal is

    α = Σ_d q(d) · min(1, p(d) / q(d)) = Σ_x min(p(x), q(x)) = 1 − TV(p, q),

with p the target's distribution after the request's warp (`sampling.target_probs`) and q the
distribution the draft service proposes from: greedy, the one-hot of its argmax (accepted
exactly when it is the target's argmax, as `accept_greedy` does); sampled, its top-K truncated
warp (`sampling.proposal_top_k`, the draft's --proposal-top-k). Averaged over positions this is
the per-position α the coordinator's policy estimates from its rounds' accept/reject trials.
"""

from __future__ import annotations

import torch

from specdec.maths.sampling import proposal_top_k, target_probs
from specdec.types import SamplingParams


def proposal_probs(draft_logits: torch.Tensor, params: SamplingParams, top_k: int) -> torch.Tensor:
    """q, the distribution the draft service proposes from: [n, vocab] logits -> [n, vocab]
    float32 (greedy: one-hot on the argmax; sampled: the top-K truncated warp)."""
    if params.greedy:
        return target_probs(draft_logits, params)  # one-hot on the argmax, ties as torch.argmax
    ids, probs = proposal_top_k(draft_logits, params, top_k)  # [n, K]
    q = torch.zeros(draft_logits.shape, dtype=torch.float32, device=draft_logits.device)
    return q.scatter_(-1, ids, probs)


def acceptance_per_position(target_logits: torch.Tensor, draft_logits: torch.Tensor, params: SamplingParams,
                            top_k: int = 32) -> torch.Tensor:
    """α at each position: Σ min(p, q). Logits [n, vocab] each (the draft's may be wider or
    narrower: both are cut to the ids they share) -> [n] float32."""
    vocab = min(target_logits.shape[-1], draft_logits.shape[-1])
    p = target_probs(target_logits[..., :vocab], params)  # [n, vocab]
    q = proposal_probs(draft_logits[..., :vocab], params, top_k)  # [n, vocab]
    return torch.minimum(p, q).sum(dim=-1)
