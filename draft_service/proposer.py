"""Proposers: return γ draft tokens and the distribution each was sampled from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from specdec.errors import InvalidArgument
from specdec.rng import make_generator
from specdec.runtime.kv_cache import SessionCache
from specdec.runtime.runner import ModelRunner, Row
from specdec.sampling import proposal_top_k
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


@dataclass
class _Drafting:
    """A call while it drafts in a batch."""

    index: int
    call: ProposeCall
    entry: SessionCache
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    dists: list[SparseDist] = field(default_factory=list)

    def add(self, token: int, dist: SparseDist) -> None:
        self.tokens.append(token)
        self.dists.append(dist)


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

    def _draw_all(self, live: Sequence[_Drafting], logits: Sequence[torch.Tensor]) -> None:
        """One drafted token for every call: per call its token and the sparse q it was drawn
        from, appended to it. logits: per call [1, vocab]. Calls with the same sampling warp are
        warped together (top-k first: no sort of the vocabulary); each draws with its own generator."""
        groups: dict[SamplingParams, list[int]] = {}
        for i, drafting in enumerate(live):
            groups.setdefault(drafting.call.params, []).append(i)
        for params, members in groups.items():
            stacked = torch.cat([logits[i] for i in members])  # [g, vocab]
            if params.greedy:
                for i, token in zip(members, stacked.argmax(dim=-1).tolist()):
                    live[i].add(token, SparseDist((token,), (1.0,)))
                continue
            ids, probs = proposal_top_k(stacked, params, self.proposal_top_k)  # [g, K]
            for row, i in enumerate(members):
                keep = probs[row] > 0
                row_ids, row_probs = ids[row][keep], probs[row][keep]  # [K']
                token = int(row_ids[torch.multinomial(row_probs, 1, generator=live[i].generator)].item())
                live[i].add(token, SparseDist(tuple(row_ids.tolist()), tuple(row_probs.tolist())))

    def propose_batch(self, calls: Sequence[ProposeCall]) -> list[Proposal | Exception]:
        """Run on the model worker: roll each session back and append its new tokens in ONE
        forward, then draw step by step, one forward per step for every call still drafting
        (a call leaves when it has its γ tokens). Each call draws with its own generator; calls
        are of distinct sessions; a call's failure is its own result."""
        runner = self.runner
        results: list[Proposal | Exception | None] = [None] * len(calls)
        live: list[_Drafting] = []
        rows: list[Row] = []
        for index, call in enumerate(calls):
            try:
                entry, feed = runner.begin(call.session_id, call.prefix_len, call.prefix_hash, call.new_tokens)
            except Exception as exc:  # noqa: BLE001 - this call's error, not the batch's
                results[index] = exc
                continue
            live.append(_Drafting(index, call, entry, make_generator(call.seed, runner.device)))
            rows.append(Row(call.session_id, entry, feed, 1))
        while live:
            try:
                logits = runner.forward_batch(rows)  # per row [1, vocab]
            except Exception as exc:  # noqa: BLE001 - every call in the forward failed with it
                for drafting in live:
                    results[drafting.index] = exc
                break
            try:
                self._draw_all(live, logits)
            except Exception as exc:  # noqa: BLE001 - a bug: the calls drafting now fail with it
                for drafting in live:
                    results[drafting.index] = exc
                break
            still: list[_Drafting] = []
            for drafting in live:
                if len(drafting.tokens) < drafting.call.gamma:
                    still.append(drafting)
                else:
                    results[drafting.index] = Proposal(drafting.tokens, drafting.dists, len(drafting.entry))
            live = still
            rows = [Row(d.call.session_id, d.entry, d.tokens[-1:], 1) for d in live]
        runner.finish([call.session_id for call in calls])
        return results

    def release(self, session_id: str) -> bool:
        return self.runner.release(session_id)
