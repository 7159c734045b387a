"""The draft model as a proposal source: a Propose call to the session's draft replica.

A draft round sends prompt lookup's tokens as hints under adaptive `auto` (the draft keeps the
leading ones it agrees with at no extra step) and, under adaptive γ, `min_confidence` (the draft
stops after a token it was unsure of, so γ is a ceiling). A draft that fails or is too slow makes
the round target-only: a failing replica is skipped for a while, a slow one (its call timed out)
is tried again by the request a few rounds later (rounds.DraftBackoff). Alongside the verification the
draft works on: a draft round's call made ahead for the next round (draft_ahead.py, when the
trial in draft_ahead_trial.py says it pays), or, on the first round of a request that does not
use the draft, the prompt it lacks, so a later draft round needs no long catch-up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from specdec.config import CoordinatorConfig
from specdec.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted, ServiceFault, Unavailable
from specdec.types import DraftAhead, ModelDescription, Source, SamplingParams, Verdict

from coordinator.session_calls import SessionCalls
from coordinator.policy.draft_ahead_trial import DraftAheadTrial
from coordinator.sources.base import ProposalSource, with_lookup_branches
from coordinator.sources.draft_ahead import AheadCall, ahead_steps, take_predrafted
from coordinator.rounds import Drafts, RequestRun, Round, RoundResult
from coordinator.sessions.routing import Routes
from coordinator.sessions.session_store import SessionRecord
from coordinator.tasks import discard
from coordinator.sessions.model_tiers import Tier

log = logging.getLogger(__name__)

DRAFT_FAILURES = (Unavailable, ResourceExhausted, ServiceFault, InvalidArgument)  # the round goes on without
PLAIN_ROUND_TOKENS = 2  # history a draft round sends the draft in steady use: more is a catch-up prefill


def catch_up_tokens(record: SessionRecord, base: int) -> int:
    """The history a draft round at `base` committed tokens would first prefill: what the call
    sends the draft (at least the last token), where that is more than a plain round's (else 0)."""
    lacking = base - min(record.draft.held, base - 1)
    return lacking if lacking > PLAIN_ROUND_TOKENS else 0


class DraftModel(ProposalSource):
    kind = Source.DRAFT

    def __init__(self, calls: SessionCalls, routes: Routes, config: CoordinatorConfig,
                 draft_info: ModelDescription, max_gamma: int, context_length: int,
                 load: Callable[[], int], beside_verification: bool = True):
        self.calls, self.routes, self.config = calls, routes, config
        # False where the tiers compete for the same cores: then the draft never works while the
        # target verifies (auto makes no calls ahead, no prompt is sent alongside)
        self.beside_verification = beside_verification
        self.draft_info, self.max_gamma, self.context_length = draft_info, max_gamma, context_length
        self.load = load  # generations running now (the trial's load band)
        self.trial = DraftAheadTrial(config.draft_ahead)  # whether draft rounds draft ahead

    async def propose(self, rnd: Round) -> Drafts:
        run, stats, plan = rnd.run, rnd.run.stats, rnd.plan
        predrafted = take_predrafted(run, rnd.base, rnd)
        if predrafted is not None:  # drafted while the last round was verified: no call now
            stats.draft_ahead_rounds += 1
            return Drafts(predrafted, Source.DRAFT if predrafted.draft_tokens else Source.NONE)
        record = run.record
        caught_up, misses = catch_up_tokens(record, rnd.base), stats.cache_misses
        t0 = time.perf_counter()
        proposal = None
        try:  # a tree's plan carries no hints and no early stop (they go with chains)
            proposal = await self.calls.propose(run, plan.gamma, rnd.params, rnd.seeds.draft, plan.tokens,
                                                plan.min_confidence, plan.tree_nodes)
            run.draft_backoff.answered()
        except DRAFT_FAILURES as exc:
            stats.fallback_rounds += 1
            self._failed(run, exc, "target-only round")
        seconds = time.perf_counter() - t0
        stats.draft_seconds += seconds
        if proposal is None or not proposal.draft_tokens:
            return Drafts(call_seconds=seconds)
        timed = not caught_up and stats.cache_misses == misses  # a plain round: its time is the round's
        grafted = 0
        if proposal.parents and plan.branches:
            proposal, grafted = with_lookup_branches(proposal, plan.branches, self.max_gamma)
        return Drafts(proposal, Source.DRAFT, seconds if timed else None, seconds, lookup_nodes=grafted,
                      caught_up=caught_up if stats.cache_misses == misses else 0)

    def alongside(self, rnd: Round, drafts: Drafts) -> AheadCall | _Prefetch | None:
        if rnd.plan.source != Source.DRAFT:
            rnd.run.predrafted = None  # drafts made ahead continue a draft round only
            return self._prefetch(rnd)
        if drafts.source != Source.DRAFT or drafts.proposal.parents:  # a tree's next round is not a chain's
            return None
        rnd.ahead = self._ahead_mode(rnd)
        if rnd.ahead != DraftAhead.ON:
            return None
        call = self._draft_ahead(rnd, drafts)
        rnd.run.stats.draft_ahead_calls += call is not None
        return call

    def observe(self, rnd: Round, drafts: Drafts, verdict: Verdict) -> int | None:
        """The draft fed d1..dγ-1: it holds those the target accepted."""
        if drafts.source != Source.DRAFT:
            return None
        if drafts.proposal.parents:
            return rnd.base  # a tree's draft keeps the history only
        return rnd.base + min(verdict.num_accepted, len(drafts.proposal.draft_tokens) - 1)

    def committed(self, session_id: str, result: RoundResult) -> None:
        if result.ahead is not None:
            self.trial.record(session_id, self.load(), result.ahead, result.verdict.num_accepted + 1,
                              result.seconds)

    def forget(self, session_id: str) -> None:
        self.trial.forget(session_id)

    # ---- drafting ahead -----------------------------------------------------------------------

    def _ahead_mode(self, rnd: Round) -> DraftAhead | None:
        """Whether a draft round drafts ahead (ON | OFF): as --draft-ahead on / off says, or as the
        trial of `auto` says for requests whose rounds follow measured timings anyway (adaptive γ,
        costs measured). Under `auto` a request that fixes γ, or a coordinator that pins
        --draft-cost-ratio, keeps reproducible rounds, and tiers that compete for the same cores
        never draft ahead: None (off, and not measured)."""
        if self.trial.setting == DraftAhead.AUTO and (rnd.spec.fixed_gamma is not None
                                                      or self.config.draft_cost_ratio > 0
                                                      or not self.beside_verification):
            return None
        return self.trial.mode(self.load())

    def _draft_ahead(self, rnd: Round, drafts: Drafts) -> AheadCall | None:
        """The call made ahead for the next round, or None when that round could not use it (no
        room, the draft holds something else, the session moved)."""
        record, tokens = rnd.run.record, drafts.proposal.draft_tokens
        k = len(tokens)
        steps = ahead_steps(rnd, k, self.draft_info.max_speculative_tokens)
        held = rnd.base + k - 1  # the draft holds the history and d1..dγ-1
        if (steps < 2 or drafts.proposal.cached_len < held
                or (rnd.cap < self.max_gamma and rnd.cap - k - 1 < 1)  # the next round proposes nothing
                or rnd.base + k + steps > min(self.context_length, self.draft_info.max_context_length)):
            return None
        address = record.draft.address
        try:
            client = self.routes.pick(Tier.DRAFT, record)
        except Unavailable:
            return None
        if client.address != address:  # the session moved: that replica holds none of it
            return None
        return AheadCall(rnd, tokens, client, steps, self.config.draft_timeout_s)

    # ---- prefetch -----------------------------------------------------------------------------

    def _prefetch(self, rnd: Round) -> _Prefetch | None:
        """On the first round of a request that does not use the draft, send it the history it
        lacks (the prompt) alongside the verification (not while the load governor holds plain
        decoding, nor where the tiers compete for the same cores: a later draft round catches up
        then, if the policy probes the draft at all)."""
        run = rnd.run
        if not (self.beside_verification and rnd.spec.uses_draft and rnd.draft_up and rnd.allowed and run.calls[Tier.DRAFT] == 0
                and catch_up_tokens(run.record, rnd.base)):
            return None
        return _Prefetch(rnd, asyncio.ensure_future(self._catch_up(run, rnd.params, rnd.seeds.draft)))

    async def _catch_up(self, run: RequestRun, params: SamplingParams, seed: int) -> bool:
        """True when the draft now holds the history (its one proposal is dropped)."""
        try:
            await self.calls.propose(run, 1, params, seed)
            run.draft_backoff.answered()
            return True
        except DRAFT_FAILURES as exc:
            self._failed(run, exc, "catching up on the history; the round goes on without it")
            return False

    def _failed(self, run: RequestRun, exc: Exception, consequence: str) -> None:
        """A draft call of this request failed. Timed out: the replica may only be slow, so the
        request backs off the draft for a few rounds (DraftBackoff) and the replica stays in use
        unless a health check finds it hung. Else (unreachable, refused, broken): the replica is
        skipped until it answers health checks again, and its sessions move."""
        address = run.record.draft.address
        if isinstance(exc, DeadlineExceeded):
            skipped = run.draft_backoff.timed_out(run.stats.rounds)
            self.routes.suspect(Tier.DRAFT, address)
            log.warning("draft call timed out (%s); %s; the draft is tried again after %d round%s",
                        exc, consequence, skipped, "s" * (skipped > 1))
            return
        self.routes.failed(Tier.DRAFT, address)
        log.warning("draft failed (%s); %s", exc, consequence)


class _Prefetch:
    """The draft catching up on the history while a round it did not propose is verified."""

    def __init__(self, rnd: Round, future: asyncio.Future):
        self.base, self.future = rnd.base, future

    async def settle(self, verdict: Verdict) -> int | None:
        return self.base if await self.future else None  # the draft now holds the history

    async def discard(self) -> None:
        await discard(self.future)

    def cancel(self) -> None:
        if not self.future.done():
            self.future.cancel()
