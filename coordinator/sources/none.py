"""No proposals: plain target decoding (γ = 0), the baseline and the fallback."""

from __future__ import annotations

from specdec.types import Source

from coordinator.sources.base import ProposalSource
from coordinator.rounds import Drafts, Round


class NoProposals(ProposalSource):
    kind = Source.NONE

    async def propose(self, rnd: Round) -> Drafts:
        return Drafts()
