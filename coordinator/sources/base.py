"""The proposal-source interface: propose a round's tokens, then observe what the target did.

The shape of transformers' candidate generators (propose, then observe) and vLLM's proposers.
The engine plans each round (speculation.py picks the source and γ), asks the planned source to
`propose`, runs every source's work `alongside` the verification (a source may have some on
rounds it did not propose: the draft model catches up on a prompt meanwhile), lets the planned
source `observe` the verdict, and tells every source when the round is committed and when the
request ends. Sources never see each other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

from specdec.types import Proposer, Verdict

from coordinator.rounds import Drafts, Round, RoundResult


class SideCall(Protocol):
    """Work a source runs while a round is verified."""

    async def settle(self, verdict: Verdict) -> None:
        """After verification: take what the work produced (awaiting it)."""

    async def discard(self) -> None:
        """The verification failed: cancel the work and wait until it has ended."""

    def cancel(self) -> None:
        """Cancel it if it still runs (the round itself was cancelled meanwhile)."""


class ProposalSource(ABC):
    """One source of proposed tokens."""

    proposer: Proposer  # which one

    @abstractmethod
    async def propose(self, rnd: Round) -> Drafts:
        """The round's proposals (fewer than planned, or none, when the source falls short)."""

    def alongside(self, rnd: Round, drafts: Drafts) -> SideCall | None:
        """Work to run while `drafts` are verified (None: nothing)."""
        return None

    def observe(self, rnd: Round, drafts: Drafts, verdict: Verdict) -> None:
        """After verification of the round this source proposed: what the target accepted."""
        return None

    def committed(self, session_id: str, result: RoundResult) -> None:
        """A round of the session was committed (every source sees every round)."""
        return None

    def forget(self, session_id: str) -> None:
        """The session's request ended."""
        return None
