"""The sampling warp and the draws, identical for every service.

All maths runs in float32 whatever the model dtype, so the draft's q and the
target's p are computed the same way everywhere (DESIGN.md, rules).
"""

from __future__ import annotations

import torch

from specdec.types import SamplingParams


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, then top-k, then top-p. Masked entries become -inf.

    logits: [n, vocab] (any float dtype) -> [n, vocab] float32.
    Not used for greedy requests (temperature 0): see `target_probs`.
    """
    logits = logits.float() / params.temperature  # [n, vocab]
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = logits.masked_fill(~_nucleus(logits, params.top_p), float("-inf"))
    return logits


TOP_P_FIRST_K = 64  # candidates ranked before falling back to a larger k (then a full sort)


def _nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The tokens top-p keeps: those with less than top_p of the mass ranked before them (the
    first is always kept). Ranks only the k most likely tokens (k = 64, then 16× more, then the
    whole vocabulary) until every row's top k holds at least top_p of the mass: every token past
    that has ≥ top_p before it and is dropped, so no full-vocabulary sort in the usual case.

    logits [n, vocab] float32 -> keep [n, vocab] bool."""
    vocab = logits.shape[-1]
    total = torch.logsumexp(logits, dim=-1, keepdim=True)  # [n, 1]
    k = min(vocab, TOP_P_FIRST_K)
    while True:
        values, ids = torch.topk(logits, k, dim=-1)  # [n, k], most likely first
        probs = torch.exp(values - total)  # [n, k]
        if k == vocab or bool((probs.sum(dim=-1) >= top_p).all()):
            break
        k = min(vocab, k * 16)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # [n, k]
    keep = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    return keep.scatter_(-1, ids, mass_before < top_p)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from. logits [n, vocab] -> probs [n, vocab] float32.

    Greedy requests get a one-hot vector on the argmax (first index on ties,
    as `torch.argmax` and transformers' greedy search do).
    """
    if params.greedy:
        probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        return probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.softmax(warp_logits(logits, params), dim=-1)


def truncate_top_k(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the k most likely entries of each row and renormalise.

    probs [n, vocab] -> (ids [n, k'] int64, probs [n, k'] float32), most likely
    first, k' = min(k, vocab). Zero-probability entries keep probability 0.
    """
    k = min(k, probs.shape[-1])
    top = torch.topk(probs, k, dim=-1)
    kept = top.values.float()  # [n, k]
    return top.indices, kept / kept.sum(dim=-1, keepdim=True)


def proposal_top_k(logits: torch.Tensor, params: SamplingParams, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's proposal distribution: the request's warp, truncated to its k most likely
    tokens and renormalised, without sorting the vocabulary.

    logits [n, vocab] -> (ids [n, k'], probs [n, k'] float32), most likely first; the same as
    truncate_top_k(target_probs(logits, params), k) for a sampled request: top-p needs only the
    warped mass of the tokens before each one, and every token kept is among the k most likely.
    Tokens the warp drops have probability 0. Not for greedy requests.
    """
    scaled = logits.float() / params.temperature  # [n, vocab]
    vocab = scaled.shape[-1]
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    values, ids = torch.topk(scaled, min(vocab, max(k, top_k)), dim=-1)  # [n, kk] most likely first
    if top_k:
        kth = values[:, top_k - 1:top_k]  # [n, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        values = values.masked_fill(values < kth, float("-inf"))
    values, ids = values[:, :k], ids[:, :k]  # [n, k']
    probs = torch.exp(values - torch.logsumexp(scaled, dim=-1, keepdim=True))  # warped p of each, [n, k']
    if params.top_p < 1.0:
        mass_before = torch.cumsum(probs, dim=-1) - probs
        probs = probs.masked_fill(mass_before >= params.top_p, 0.0)  # the first token is always kept
    return ids, probs / probs.sum(dim=-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from probs [vocab] with the request's generator."""
    return int(torch.multinomial(probs, 1, generator=generator).item())
