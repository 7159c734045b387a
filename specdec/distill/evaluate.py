"""α of a draft against a target on held-out sequences, through the acceptance maths the
services use (specdec/maths/alignment.py): per position Σ min(p, q), p the target's warped
distribution, q what the draft service would propose from (greedy: its argmax; sampled: its
top-K truncated warp), averaged over the scored positions of every sequence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specdec.distill.data import Scored
from specdec.maths.alignment import acceptance_per_position
from specdec.types import SamplingParams

# the modes α is reported for: greedy requests, and sampling at temperature 1
ROWS = 128  # positions whose α is computed at once
MODES = {"greedy": SamplingParams(temperature=0.0), "sampled_t1": SamplingParams(temperature=1.0)}


@dataclass(frozen=True)
class Alignment:
    """α per mode over the held-out positions."""

    alpha: dict[str, float]  # mode -> mean per-position acceptance
    positions: int           # positions scored

    def to_json(self) -> dict:
        return {"alpha": {mode: round(value, 4) for mode, value in self.alpha.items()}, "positions": self.positions}


@torch.no_grad()
def scored_logits(model: Any, sequence: Scored, chunk: int = 1024) -> torch.Tensor:
    """The model's logits at a sequence's scored positions, [positions, vocab] float32 (run in
    one forward per `chunk` tokens, the cache carried across)."""
    device = next(model.parameters()).device
    tokens = torch.tensor([sequence.tokens], device=device)
    rows, past = [], None
    for begin in range(0, tokens.shape[1], chunk):
        out = model(input_ids=tokens[:, begin:begin + chunk], cache=past, use_cache=True)
        past = out.cache
        first = max(sequence.start - 1 - begin, 0)  # the rows before the scored ones are not kept
        rows.append(out.logits[0, first:].float().cpu())
    return torch.cat(rows)


@torch.no_grad()
def alignment(draft: Any, target: Any, held_out: list[Scored], proposal_top_k: int = 32) -> Alignment:
    """α of `draft` against `target` per mode (the draft's proposals top-K truncated as the draft
    service's --proposal-top-k does). Models on any device; the maths runs on the host."""
    was_training = draft.training
    draft.eval()
    sums = {mode: 0.0 for mode in MODES}
    positions = 0
    try:
        for sequence in held_out:
            p_logits, q_logits = scored_logits(target, sequence), scored_logits(draft, sequence)
            for begin in range(0, p_logits.shape[0], ROWS):  # bounded temporaries: [ROWS, vocab]
                p_rows, q_rows = p_logits[begin:begin + ROWS], q_logits[begin:begin + ROWS]
                for mode, params in MODES.items():
                    sums[mode] += float(acceptance_per_position(p_rows, q_rows, params, proposal_top_k).sum())
            positions += p_logits.shape[0]
    finally:
        draft.train(was_training)
    return Alignment({mode: total / max(positions, 1) for mode, total in sums.items()}, positions)
