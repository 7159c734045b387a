"""The acceptance step for a whole batch of chains, on the device, with one host read.

`specdec/maths/acceptance.py` decides one row at a time and reads each decision back to the host
(`.item()`, `.tolist()`): on a GPU every read is a synchronisation, several per row. Here the
same rule (Leviathan et al. 2023; greedy as the argmax rule) runs as a few tensor operations
over every row of a verification batch at once, rows padded to the longest chain; the caller
reads the two result vectors back once (`Decisions.to_host`).

Exactness is the scalar rule's, draw for draw in distribution:
- a draft dᵢ is accepted when uᵢ < min(1, pᵢ(dᵢ) / qᵢ(dᵢ)) (sampled) or dᵢ = argmax pᵢ (greedy);
- n = the number of leading accepted drafts; at n < γ the next token is drawn from
  normalize(max(0, pₙ − qₙ)) (p itself where that is empty), at n = γ from p_γ (the bonus);
  greedy takes argmax pₙ;
- draws use inverse-CDF sampling with one more uniform per row, so a row's γ + 1 uniforms come
  from its request's own generator (`row_uniforms`) and a seeded request is reproducible
  whatever else shares its batch.

q arrives sparse (the draft's top-K rows), padded per row to a common width with probability 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class ChainBatch:
    """One verification batch of chains, padded to the longest (γ_max drafts)."""

    target_probs: torch.Tensor  # [R, γ_max+1, vocab] float32: p per position (the warped target)
    drafts: torch.Tensor        # [R, γ_max] int64: each row's drafts, padded with 0
    gammas: torch.Tensor        # [R] int64: each row's γ (its drafts past γ are padding)
    q_ids: torch.Tensor         # [R, γ_max, K] int64: the ids of each draft's sparse q
    q_probs: torch.Tensor       # [R, γ_max, K] float32: their probabilities (0 where padded)
    greedy: torch.Tensor        # [R] bool: the row decides by argmax (q unused)
    uniforms: torch.Tensor      # [R, γ_max+1] float32 in [0, 1): γ_max for the tests, 1 for the draw


@dataclass(frozen=True)
class Decisions:
    """What the target decided for each row, still on the device."""

    accepted: torch.Tensor    # [R] int64: leading drafts accepted
    next_token: torch.Tensor  # [R] int64: the recovered token (n < γ) or the bonus token (n = γ)
    ratios: torch.Tensor      # [R, γ_max] float32: min(1, p/q) of each draft (greedy: 1 or 0)
    gammas: torch.Tensor      # [R] int64: each row's γ (its ratios past γ are padding)

    def to_host(self) -> list[tuple[int, int, list[float]]]:
        """(accepted, next token, the ratios of the drafts examined: accepted + 1 at most) per
        row: the round's one host synchronisation."""
        columns = [self.accepted, self.next_token, self.gammas]
        both = torch.cat([torch.stack(columns, dim=1).double(), self.ratios.double()], dim=1).tolist()
        out = []
        for row in both:  # [3 + γ_max] each
            n, gamma = int(row[0]), int(row[2])
            out.append((n, int(row[1]), row[3:3 + min(n + 1, gamma)]))
        return out


def row_uniforms(generators: Sequence[torch.Generator | None], counts: Sequence[int], device: torch.device) -> torch.Tensor:
    """[R, max(counts)] uniforms: row r's counts[r] drawn from its request's generator and
    nothing more, so what a row draws does not depend on the rows beside it (greedy rows: None,
    zeros; padding: zeros). A verification row draws γ + 1, a drafting row γ."""
    out = torch.zeros((len(counts), max(counts, default=0)), device=device)
    for row, (generator, count) in enumerate(zip(generators, counts)):
        if generator is not None and count:
            out[row, :count] = torch.rand(count, generator=generator, device=device)
    return out


def decide(batch: ChainBatch) -> Decisions:
    """The acceptance step of every row at once (module docstring)."""
    p, drafts = batch.target_probs, batch.drafts
    rows, gamma_max = drafts.shape
    positions = torch.arange(gamma_max, device=p.device)  # [γ_max]
    real = positions[None, :] < batch.gammas[:, None]  # [R, γ_max]
    argmax = p.argmax(dim=-1)  # [R, γ_max+1]
    p_of_drafts = p[:, :gamma_max].gather(-1, drafts[..., None]).squeeze(-1)  # [R, γ_max]
    q_of_drafts = ((batch.q_ids == drafts[..., None]) * batch.q_probs).sum(-1)  # [R, γ_max]
    ratio = torch.clamp(p_of_drafts / q_of_drafts.clamp_min(torch.finfo(p.dtype).tiny), max=1.0)
    sampled_ok = batch.uniforms[:, :gamma_max] < ratio  # [R, γ_max]
    greedy_ok = drafts == argmax[:, :gamma_max]  # [R, γ_max]
    ok = torch.where(batch.greedy[:, None], greedy_ok, sampled_ok) & real  # [R, γ_max]
    accepted = ok.long().cumprod(dim=1).sum(dim=1)  # [R]: leading accepted drafts
    rejected = accepted < batch.gammas  # [R]
    at = torch.arange(rows, device=p.device)
    p_next = p[at, accepted]  # [R, vocab]: the position the next token is drawn at
    q_row = accepted.clamp(max=max(gamma_max - 1, 0))  # a valid index; used only where rejected
    q_dense = torch.zeros_like(p_next)
    if gamma_max:
        q_dense.scatter_add_(1, batch.q_ids[at, q_row], batch.q_probs[at, q_row])  # [R, vocab]
    residual = torch.clamp(p_next - q_dense, min=0.0)  # [R, vocab]
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    dist = torch.where(rejected[:, None] & ~empty, residual, p_next)  # [R, vocab]
    drawn = inverse_cdf(dist, batch.uniforms[at, batch.gammas])  # [R]
    next_token = torch.where(batch.greedy, argmax[at, accepted], drawn)
    ratios = torch.where(batch.greedy[:, None], greedy_ok.to(ratio.dtype), ratio)  # [R, γ_max]
    return Decisions(accepted, next_token, ratios, batch.gammas)


def inverse_cdf(dist: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[R] token ids drawn from the unnormalised rows dist [R, vocab] with uniforms u [R]: the
    first id whose cumulative mass reaches u × total (never an id of zero mass)."""
    cdf = dist.cumsum(dim=-1)  # [R, vocab]
    target = (u * cdf[:, -1]).clamp_min(torch.finfo(cdf.dtype).tiny)[:, None]  # [R, 1]
    return torch.searchsorted(cdf, target).squeeze(-1).clamp(max=dist.shape[-1] - 1)
