"""Prompt lookup as a proposal source: the tokens that followed the latest earlier occurrence of
the session's last n-gram (coordinator/sources/lookup_index.py), looked up while the round is planned (the
policy needs to know how many there are), proposed with a one-hot q and no model call. In a
draft round that grows a token tree, the same tokens, and what followed earlier occurrences of
the suffix, can be grafted onto the draft's tree as branches of their own
(`with_lookup_branches`): the target verifies them all in one pass."""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from specdec.tree import TokenTree, graft
from specdec.types import Proposal, Proposer, SparseDist

from coordinator.sources.base import ProposalSource
from coordinator.rounds import Drafts, Round


def one_hot_dists(tokens: Sequence[int]) -> list[SparseDist]:
    """The proposal distribution of deterministic drafts: q(d) = 1. The acceptance step then
    accepts d with probability p(d) and recovers from p with d removed: lossless."""
    return [SparseDist.one_hot(token) for token in tokens]


def with_lookup_branches(proposal: Proposal, branches: Sequence[Sequence[int]],
                         max_nodes: int) -> tuple[Proposal, int]:
    """The draft's tree `proposal` with prompt lookup's `branches` grafted on in turn
    (specdec.tree.graft: each follows the nodes it repeats and adds the rest after them, up to
    `max_nodes` nodes in all), and how many nodes they added. An added node is deterministic
    given the history, as the draft's ranked children are, so its q is one-hot and the tree walk
    stays exact."""
    tree = grown = TokenTree(tuple(proposal.draft_tokens), proposal.parents)
    for branch in branches:
        grown = graft(grown, branch, max_nodes)
    added = len(grown) - len(tree)
    if not added:
        return proposal, 0
    return replace(proposal, draft_tokens=list(grown.tokens), parents=grown.parents,
                   draft_probs=list(proposal.draft_probs) + one_hot_dists(grown.tokens[len(tree):])), added


class PromptLookup(ProposalSource):
    proposer = Proposer.PROMPT_LOOKUP

    async def propose(self, rnd: Round) -> Drafts:
        tokens = list(rnd.plan.tokens)
        if not tokens:
            return Drafts()
        return Drafts(Proposal(tokens, one_hot_dists(tokens)), Proposer.PROMPT_LOOKUP,
                      propose_seconds=rnd.plan.propose_seconds)
