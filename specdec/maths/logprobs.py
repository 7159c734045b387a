"""The target's log-probabilities of the tokens a round emits, and their top alternatives.

They are the model's own distribution: log_softmax of the raw logits, before the request's
sampling warp (temperature, top-k, top-p), as vLLM returns them by default. So a greedy and a
sampled request report the same numbers for the same history, and a token the warp would
never have drawn still has its true log-probability.
"""

from __future__ import annotations

import torch

from specdec.types import TokenLogprobs


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprobs]:
    """Per emitted token, its log-probability and the `top` most likely tokens at its position.

    logits: [n, vocab] raw logits of the positions that emitted `tokens` (n = len(tokens)).
    Computed in float32, or the logits' dtype where it is wider (a float64 model)."""
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)  # [n, vocab]
    index = torch.tensor(tokens, dtype=torch.long, device=logp.device)  # [n]
    chosen = logp.gather(-1, index[:, None])[:, 0].tolist()  # [n]
    if top:
        best = torch.topk(logp, min(top, logp.shape[-1]), dim=-1)  # values, indices: [n, top]
        alternatives = [tuple(zip(ids, values)) for ids, values in
                        zip(best.indices.tolist(), best.values.tolist())]
    else:
        alternatives = [()] * len(tokens)
    return [TokenLogprobs(token, lp, alts) for token, lp, alts in zip(tokens, chosen, alternatives)]
