"""The acceptance step of speculative sampling (Leviathan et al. 2023, Chen et al. 2023).

One pure function per mode: given γ draft tokens, the distributions q they were drawn from
and the target distributions p at the γ+1 positions, return the accepted drafts plus one
recovered (at the first rejection) or bonus (all accepted) token. The output is distributed
exactly as p, whatever q is — a one-hot q (prompt lookup) included.
"""

from __future__ import annotations

import torch

from specdec.maths.draft_q import DraftQ
from specdec.errors import InvalidArgument
from specdec.maths.sampling import sample
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
    draft_q: DraftQ,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> Verdict:
    """Speculative sampling.

    draft_tokens: γ ids; draft_q: the γ sparse rows of q; target_probs p: [γ+1, vocab]
    float32 on the generator's device. Accept dᵢ with probability min(1, p(dᵢ)/q(dᵢ)); at the
    first rejection draw from normalize(max(0, pᵢ − qᵢ)), else a bonus token from p_γ.
    """
    gamma = len(draft_tokens)
    if len(draft_q) != gamma or target_probs.shape[0] != gamma + 1:
        raise InvalidArgument(
            f"expected {gamma} draft distributions and {gamma + 1} target rows, "
            f"got {len(draft_q)} and {target_probs.shape[0]}"
        )
    if gamma == 0:
        return Verdict(0, sample(target_probs[0], generator), True, [])
    device = target_probs.device
    drafts = torch.tensor(draft_tokens, dtype=torch.long, device=device)  # [γ]
    p_of_drafts = target_probs[torch.arange(gamma, device=device), drafts]  # [γ]
    ratio = torch.clamp(p_of_drafts / draft_q.of_drafts, max=1.0)  # [γ]
    u = torch.rand(gamma, generator=generator, device=generator.device)  # [γ]
    rejected = torch.cat([(u >= ratio), torch.ones(1, dtype=torch.bool, device=device)])  # [γ+1]
    ratios = ratio.tolist()
    first = int(rejected.int().argmax())  # the one host sync of the decision
    if first == gamma:
        return Verdict(gamma, sample(target_probs[gamma], generator), True, ratios)
    residual = draft_q.residual(first, target_probs[first])  # [vocab]
    total = float(residual.sum())
    recovered = sample(residual / total if total > 0 else target_probs[first], generator)
    return Verdict(first, recovered, False, ratios[: first + 1])
