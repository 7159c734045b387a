"""The acceptance step of speculative sampling (Leviathan et al. 2023, Chen et al. 2023).

One pure function: given γ draft tokens, the distributions q they were drawn
from and the target distributions p at the γ+1 positions, return the accepted
drafts plus one recovered (at the first rejection) or bonus (all accepted)
token. The output is distributed exactly as p, whatever q is.
"""

from __future__ import annotations

import torch

from specdec.errors import InvalidArgument
from specdec.sampling import sample
from specdec.types import Verdict


def accept_greedy(draft_tokens: list[int], target_argmax: list[int]) -> Verdict:
    """Greedy verification: accept while d_i == argmax p_i; then the target's argmax.

    target_argmax: [γ+1] argmax token ids of the target at each position.
    """
    gamma = len(draft_tokens)
    accepted = 0
    while accepted < gamma and draft_tokens[accepted] == target_argmax[accepted]:
        accepted += 1
    probs = [1.0] * accepted + ([0.0] if accepted < gamma else [])
    return Verdict(accepted, target_argmax[accepted], accepted == gamma, probs)


def accept_sampled(
    draft_tokens: list[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> Verdict:
    """Speculative sampling.

    draft_tokens: γ ids; draft_probs q: [γ, vocab]; target_probs p: [γ+1, vocab];
    both float32 on the generator's device.
    """
    gamma = len(draft_tokens)
    if draft_probs.shape[0] != gamma or target_probs.shape[0] != gamma + 1:
        raise InvalidArgument(
            f"expected {gamma} draft distributions and {gamma + 1} target rows, "
            f"got {draft_probs.shape[0]} and {target_probs.shape[0]}"
        )
    accept_probs: list[float] = []
    for i, token in enumerate(draft_tokens):
        p = float(target_probs[i, token])
        q = float(draft_probs[i, token])
        if q <= 0.0:
            raise InvalidArgument(
                f"draft token {token} at position {i} has probability 0 in its own proposal distribution"
            )
        ratio = min(1.0, p / q)
        accept_probs.append(ratio)
        u = float(torch.rand((), generator=generator, device=generator.device))
        if u >= ratio:
            residual = torch.clamp(target_probs[i] - draft_probs[i], min=0.0)  # [vocab]
            total = float(residual.sum())
            recovered = sample(residual / total if total > 0 else target_probs[i], generator)
            return Verdict(i, recovered, False, accept_probs)
    return Verdict(gamma, sample(target_probs[gamma], generator), True, accept_probs)
