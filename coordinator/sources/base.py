"""The proposal-source interface: propose a round's tokens, then observe what the target did.

The shape of transformers' candidate generators (propose, then observe) and vLLM's proposers.
The round loop plans each round (speculation.py picks the source and γ), asks the planned source to
`propose`, runs every source's work `alongside` the verification (a source may have some on
rounds it did not propose: the draft model catches up on a prompt meanwhile), lets the planned
source `observe` the verdict, and tells every source when the round is committed and when the
request ends. Sources never see each other; what they share is here (`one_hot_dists`,
`with_lookup_branches`), and what prompt lookup found reaches the draft model only through the
round's plan (its hints and branches, chosen by the planner). A source records nothing of what a replica holds: `observe` and a side
call's `settle` return the draft's new held length, which the round loop hands to the one owner
of held lengths (coordinator/session_calls.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace
from typing import Protocol, Sequence

from specdec.maths.tree import TokenTree, graft
from specdec.types import Proposal, Source, SparseDist, Verdict

from coordinator.rounds import Drafts, Round, RoundResult


class SideCall(Protocol):
    """Work a source runs while a round is verified."""

    async def settle(self, verdict: Verdict) -> int | None:
        """After verification: take what the work produced (awaiting it); the draft's held
        length when the work changed it (None: unchanged)."""

    async def discard(self) -> None:
        """The verification failed: cancel the work and wait until it has ended."""

    def cancel(self) -> None:
        """Cancel it if it still runs (the round itself was cancelled meanwhile)."""


class ProposalSource(ABC):
    """One source of proposed tokens."""

    kind: Source  # which one

    @abstractmethod
    async def propose(self, rnd: Round) -> Drafts:
        """The round's proposals (fewer than planned, or none, when the source falls short)."""

    def alongside(self, rnd: Round, drafts: Drafts) -> SideCall | None:
        """Work to run while `drafts` are verified (None: nothing)."""
        return None

    def observe(self, rnd: Round, drafts: Drafts, verdict: Verdict) -> int | None:
        """After verification of the round this source proposed: what the target accepted. Returns
        the draft's held length when the round changed it (None: unchanged)."""
        return None

    def committed(self, session_id: str, result: RoundResult) -> None:
        """A round of the session was committed (every source sees every round)."""
        return None

    def forget(self, session_id: str) -> None:
        """The session's request ended."""
        return None


def one_hot_dists(tokens: Sequence[int]) -> list[SparseDist]:
    """The proposal distribution of deterministic drafts: q(d) = 1. The acceptance step then
    accepts d with probability p(d) and recovers from p with d removed: lossless."""
    return [SparseDist.one_hot(token) for token in tokens]


def with_lookup_branches(proposal: Proposal, branches: Sequence[Sequence[int]],
                         max_nodes: int) -> tuple[Proposal, int]:
    """The draft's tree `proposal` with prompt lookup's `branches` grafted on in turn
    (specdec.maths.tree.graft: each follows the nodes it repeats and adds the rest after them, up to
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
