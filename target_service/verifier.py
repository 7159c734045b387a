"""Verification: one forward pass over new tokens + drafts, then the acceptance step."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.acceptance import accept_greedy, accept_sampled
from specdec.draft_q import DraftQ
from specdec.errors import InvalidArgument
from specdec.rng import make_generator
from specdec.runtime.runner import ModelRunner
from specdec.sampling import target_probs
from specdec.types import SamplingParams, SparseDist, Verdict


@dataclass(frozen=True)
class VerifyCall:
    """A validated Verify request."""

    session_id: str
    prefix_len: int
    prefix_hash: int
    new_tokens: list[int]
    drafts: list[int]
    draft_q: DraftQ | None  # None when greedy (q is not needed)
    params: SamplingParams
    seed: int


class Verifier:
    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def call(self, session_id: str, prefix_len: int, prefix_hash: int, new_tokens: list[int],
             drafts: list[int], draft_probs: list[SparseDist], params: SamplingParams, seed: int) -> VerifyCall:
        """Validate a request without touching any cache (InvalidArgument naming what is wrong)."""
        runner = self.runner
        gamma = len(drafts)
        if gamma > runner.description.max_speculative_tokens:
            raise InvalidArgument(
                f"{gamma} draft tokens exceed this service's limit of "
                f"{runner.description.max_speculative_tokens}"
            )
        runner.check_request(session_id, prefix_len, new_tokens, gamma)
        runner.check_token_ids(drafts, "draft_tokens")
        draft_q = None
        if not params.greedy and gamma:
            draft_q = DraftQ.from_sparse(draft_probs, drafts, runner.vocab_size, runner.device)
        return VerifyCall(session_id, prefix_len, prefix_hash, new_tokens, drafts, draft_q, params, seed)

    def verify(self, call: VerifyCall) -> Verdict:
        """Run on the model worker: roll back, one forward, accept, crop after the last accepted."""
        runner = self.runner
        gamma = len(call.drafts)
        entry, feed = runner.begin(call.session_id, call.prefix_len, call.prefix_hash, call.new_tokens)
        base = len(entry)
        logits = runner.forward(call.session_id, entry, list(feed) + call.drafts,
                                keep_logits=gamma + 1)  # [γ+1, vocab]
        if call.params.greedy:
            verdict = accept_greedy(call.drafts, logits.argmax(dim=-1).tolist())
        else:
            generator = make_generator(call.seed, runner.device)
            p = target_probs(logits, call.params)  # [γ+1, vocab]
            verdict = accept_sampled(call.drafts, call.draft_q or DraftQ.from_dense(p[:0], []), p, generator)
        entry.crop(base + len(feed) + verdict.num_accepted)
        cached = len(entry)
        runner.finish(call.session_id)
        return Verdict(verdict.num_accepted, verdict.next_token, verdict.is_bonus, verdict.accept_probs, cached)

    def release(self, session_id: str) -> bool:
        return self.runner.release(session_id)
