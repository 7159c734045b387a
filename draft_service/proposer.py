"""Proposers: return γ draft tokens and the distribution each was sampled from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.errors import InvalidArgument
from specdec.rng import make_generator
from specdec.runtime.runner import ModelRunner
from specdec.sampling import target_probs, truncate_top_k
from specdec.types import Proposal, SamplingParams, SparseDist


@dataclass(frozen=True)
class ProposeCall:
    """A validated Propose request."""

    session_id: str
    prefix_len: int
    prefix_hash: int
    new_tokens: list[int]
    gamma: int
    params: SamplingParams
    seed: int


class Proposer(Protocol):
    """What the draft service serves. Rollback is implicit: a call's prefix_len says how
    much of the previous proposal the target accepted (prefix_len < cached length)."""

    def call(self, session_id: str, prefix_len: int, prefix_hash: int, new_tokens: list[int], gamma: int,
             params: SamplingParams, seed: int) -> ProposeCall: ...

    def propose(self, call: ProposeCall) -> Proposal: ...

    def release(self, session_id: str) -> bool: ...


class ModelProposer:
    """A small causal LM proposes autoregressively from its top-K truncated distribution."""

    def __init__(self, runner: ModelRunner, proposal_top_k: int):
        self.runner = runner
        self.proposal_top_k = proposal_top_k

    def call(self, session_id: str, prefix_len: int, prefix_hash: int, new_tokens: list[int], gamma: int,
             params: SamplingParams, seed: int) -> ProposeCall:
        """Validate a request without touching any cache."""
        limit = self.runner.description.max_speculative_tokens
        if not 1 <= gamma <= limit:
            raise InvalidArgument(f"num_speculative_tokens must be in [1, {limit}], got {gamma}")
        self.runner.check_request(session_id, prefix_len, new_tokens, gamma - 1)
        return ProposeCall(session_id, prefix_len, prefix_hash, new_tokens, gamma, params, seed)

    def _draw(self, logits: torch.Tensor, params: SamplingParams,
              generator: torch.Generator) -> tuple[int, SparseDist]:
        """logits [1, vocab] -> (token, the sparse q it was drawn from)."""
        if params.greedy:
            token = int(logits[0].argmax())
            return token, SparseDist((token,), (1.0,))
        ids, probs = truncate_top_k(target_probs(logits, params), self.proposal_top_k)  # [1, K]
        keep = probs[0] > 0
        ids, probs = ids[0][keep], probs[0][keep]  # [K']
        token = int(ids[torch.multinomial(probs, 1, generator=generator)].item())
        return token, SparseDist(tuple(ids.tolist()), tuple(probs.tolist()))

    def propose(self, call: ProposeCall) -> Proposal:
        """Run on the model worker: roll back, append the new tokens, draw γ tokens."""
        runner = self.runner
        entry, feed = runner.begin(call.session_id, call.prefix_len, call.prefix_hash, call.new_tokens)
        generator = make_generator(call.seed, runner.device)
        logits = runner.forward(call.session_id, entry, feed, keep_logits=1)  # [1, vocab]
        tokens: list[int] = []
        dists: list[SparseDist] = []
        for i in range(call.gamma):
            token, dist = self._draw(logits, call.params, generator)
            tokens.append(token)
            dists.append(dist)
            if i < call.gamma - 1:
                logits = runner.forward(call.session_id, entry, [token], keep_logits=1)
        cached = len(entry)
        runner.finish(call.session_id)
        return Proposal(tokens, dists, cached)

    def release(self, session_id: str) -> bool:
        return self.runner.release(session_id)
