"""Prompt lookup as a proposal source: the tokens that followed the latest earlier occurrence of
the session's last n-gram (lookup_index.py), proposed with a one-hot q and no model call.

It looks the session's tokens up before the round is planned (`look`: the policy needs to know
how many there are and how long the suffix was that matched) and hands the planner a `Lookup`;
the planner only chooses. A round it was chosen for proposes the looked-up tokens the plan kept.
The draft model gets the same tokens through the round's plan: as hints for a chain, or, for a
token tree, with what followed earlier occurrences of the suffix, as branches grafted onto the
draft's tree (base.with_lookup_branches): the target verifies them all in one pass."""

from __future__ import annotations

import time
from typing import Sequence

from specdec.types import Proposal, Source, Verdict

from coordinator.policy.speculation import Lookup
from coordinator.rounds import Drafts, Round
from coordinator.sources.base import ProposalSource, one_hot_dists
from coordinator.sources.lookup_index import SessionLookup


class PromptLookup(ProposalSource):
    kind = Source.PROMPT_LOOKUP

    def __init__(self, max_ngram: int, max_tokens: int) -> None:
        if max_ngram < 1 or max_tokens < 1:
            raise ValueError(f"need ngram_max >= 1 and ngram_max_tokens >= 1, got {max_ngram}, "
                             f"{max_tokens}")
        self.max_ngram, self.max_tokens = max_ngram, max_tokens  # --ngram-max, --ngram-max-tokens
        self._sessions: dict[str, SessionLookup] = {}  # the index of each running request's session

    def look(self, session_id: str, history: Sequence[int], cap: int) -> Lookup:
        """What followed the latest earlier occurrence of the session's suffix (at most `cap`
        tokens), indexing `history`'s new tokens first."""
        t0 = time.perf_counter()
        index = self._sessions.get(session_id)
        if index is None:
            index = self._sessions[session_id] = SessionLookup(self.max_ngram, 1, self.max_tokens)
        tokens = index.propose(history, cap)
        return Lookup(tokens, index.last_order if tokens else 0, time.perf_counter() - t0,
                      index.continuations)

    async def propose(self, rnd: Round) -> Drafts:
        tokens = list(rnd.plan.tokens)
        if not tokens:
            return Drafts()
        return Drafts(Proposal(tokens, one_hot_dists(tokens)), Source.PROMPT_LOOKUP,
                      propose_seconds=rnd.plan.propose_seconds)

    def observe(self, rnd: Round, drafts: Drafts, verdict: Verdict) -> None:
        index = self._sessions.get(rnd.run.record.session_id)
        if index is not None and drafts.source == Source.PROMPT_LOOKUP:
            index.observe(len(drafts.proposal.draft_tokens), verdict.num_accepted)

    def forget(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
