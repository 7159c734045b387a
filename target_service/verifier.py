"""Verification: one forward pass over new tokens + drafts, then the acceptance step."""

from __future__ import annotations

import torch

from specdec.acceptance import accept_greedy, accept_sampled
from specdec.errors import InvalidArgument
from specdec.rng import make_generator
from specdec.runtime.runner import ModelRunner
from specdec.sampling import densify, target_probs
from specdec.types import SamplingParams, SparseDist, Verdict


def _dense_q(dists: list[SparseDist], vocab: int, device: torch.device) -> torch.Tensor:
    """Sparse proposal rows -> [γ, vocab] float32 (ids outside the target vocab dropped)."""
    width = max(len(d.token_ids) for d in dists)
    ids = torch.zeros((len(dists), width), dtype=torch.long)
    probs = torch.zeros((len(dists), width), dtype=torch.float32)
    for row, dist in enumerate(dists):
        if len(dist.token_ids) != len(dist.probs):
            raise InvalidArgument(f"draft_probs[{row}]: token_ids and probs differ in length")
        ids[row, : len(dist.token_ids)] = torch.tensor(dist.token_ids, dtype=torch.long)
        probs[row, : len(dist.probs)] = torch.tensor(dist.probs, dtype=torch.float32)
    return densify(ids.to(device), probs.to(device), vocab)


class Verifier:
    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def verify(self, session_id: str, prefix_len: int, new_tokens: list[int], drafts: list[int],
               draft_probs: list[SparseDist], params: SamplingParams, seed: int) -> Verdict:
        runner = self.runner
        gamma = len(drafts)
        if gamma > runner.description.max_speculative_tokens:
            raise InvalidArgument(
                f"{gamma} draft tokens exceed this service's limit of "
                f"{runner.description.max_speculative_tokens}"
            )
        if not params.greedy and len(draft_probs) != gamma:
            raise InvalidArgument(f"{gamma} draft tokens need {gamma} draft_probs, got {len(draft_probs)}")
        runner.check_request(session_id, prefix_len, new_tokens, gamma)
        runner.check_token_ids(drafts, "draft_tokens")
        with runner.lock:
            entry = runner.session(session_id, prefix_len)
            logits = runner.forward(entry, new_tokens + drafts, keep_logits=gamma + 1)  # [γ+1, vocab]
            if params.greedy:
                verdict = accept_greedy(drafts, logits.argmax(dim=-1).tolist())
            else:
                generator = make_generator(seed, runner.device)
                p = target_probs(logits, params)  # [γ+1, vocab]
                q = _dense_q(draft_probs, runner.vocab_size, runner.device) if gamma else p[:0]
                verdict = accept_sampled(drafts, q, p, generator)
            entry.crop(prefix_len + len(new_tokens) + verdict.num_accepted)
            cached = len(entry)
            runner.finish(session_id)
        return Verdict(verdict.num_accepted, verdict.next_token, verdict.is_bonus,
                       verdict.accept_probs, cached)

    def release(self, session_id: str) -> bool:
        return self.runner.release(session_id)
