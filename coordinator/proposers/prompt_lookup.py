"""Prompt lookup as a proposal source: the tokens that followed the latest earlier occurrence of
the session's last n-gram (coordinator/ngram.py), looked up while the round is planned (the
policy needs to know how many there are), proposed with a one-hot q and no model call."""

from __future__ import annotations

from typing import Sequence

from specdec.types import Proposal, Proposer, SparseDist

from coordinator.proposers.base import ProposalSource
from coordinator.rounds import Drafts, Round


def one_hot_dists(tokens: Sequence[int]) -> list[SparseDist]:
    """The proposal distribution of deterministic drafts: q(d) = 1. The acceptance step then
    accepts d with probability p(d) and recovers from p with d removed: lossless."""
    return [SparseDist.one_hot(token) for token in tokens]


class PromptLookup(ProposalSource):
    proposer = Proposer.NGRAM

    async def propose(self, rnd: Round) -> Drafts:
        tokens = list(rnd.plan.tokens)
        if not tokens:
            return Drafts()
        return Drafts(Proposal(tokens, one_hot_dists(tokens)), Proposer.NGRAM,
                      propose_seconds=rnd.plan.propose_seconds)
