"""Drafting ahead (--draft-ahead): while a draft round's d1..dγ are verified, the draft goes on
from dγ for the next round.

The call made ahead asks the draft (which holds the history and d1..dγ-1) for dγ plus some
steps, drawn with a seed of its own (the round's `seeds.ahead`). Its first token e1 is the
draft's guess of the target's bonus token. When the target accepts every draft and its bonus is
e1, e2.. become the next round's drafts with their q, and that round makes no draft call;
otherwise the call is dropped (what it left in the draft's cache lies past what the coordinator
counts as held, and the next Propose crops it). Lossless: each e_i is a draw from the q reported
with it, on the very history the target commits, and whether they are used depends on e1 and
the verdict only; e2.. are later draws of the call's own stream, independent of e1's. The next
round's own Propose, made exactly when the guess was wrong, must not replay the draws behind
that guess, hence the separate seed (specdec/rng.py).
Whether calls are made at all is `draft_ahead_trial.py`'s question.
"""

from __future__ import annotations

import asyncio
import logging

from specdec.errors import SpecdecError
from specdec.fingerprint import extend_hash
from specdec.logtag import session_tag
from specdec.types import Proposal, Source, SamplingParams, Verdict

from coordinator.sessions.clients import DraftClient
from coordinator.rounds import Predrafted, RequestRun, Round
from coordinator.tasks import discard

log = logging.getLogger(__name__)


def take_predrafted(run: RequestRun, base: int, rnd: Round) -> Proposal | None:
    """The drafts made ahead for this round, cut to what the plan asks (None: there are none,
    they continue another history, or this round does not use the draft model). Each is still a
    draw from the q reported with it, made on the committed history: lossless."""
    predrafted, run.predrafted = run.predrafted, None
    if predrafted is None or predrafted.base != base or rnd.plan.source != Source.DRAFT:
        return None
    limit = min(rnd.cap, rnd.plan.gamma + len(rnd.plan.tokens))
    drafts = predrafted.proposal
    if limit < 1:
        return None
    return Proposal(drafts.draft_tokens[:limit], drafts.draft_probs[:limit], drafts.cached_len)


def ahead_steps(rnd: Round, drafted: int, max_steps: int) -> int:
    """Draft steps the call made ahead takes: this round's γ + 1 (a fixed γ: exactly), under
    adaptive γ fewer when the measured timings say they would outlast the verification of
    `drafted` tokens (the next call would wait for them)."""
    steps = min(max(rnd.plan.gamma, 1) + 1, max_steps)
    if rnd.spec.fixed_gamma is None:  # adaptive: no longer than the verification it hides behind
        within = rnd.spec.draft_steps_within_verify(drafted + 1)
        if within is not None:
            steps = min(steps, max(2, within))  # (a guess and one draft at least)
    return steps


class AheadCall:
    """The call made ahead, running while the round's drafts are verified."""

    def __init__(self, rnd: Round, drafts: list[int], client: DraftClient, steps: int, timeout_s: float):
        run, k = rnd.run, len(drafts)
        self.run, self.base, self.drafts = run, rnd.base, drafts
        prefix_hash = extend_hash(run.hashes.at(rnd.base), drafts[:k - 1])
        self.future = asyncio.ensure_future(_propose_ahead(  # a seed of its own: see specdec/rng.py
            client, run.record.session_id, rnd.base + k - 1, prefix_hash, drafts[-1], steps, rnd.params,
            rnd.seeds.ahead, rnd.plan.min_confidence, timeout_s, k, run.cache_salt))

    async def settle(self, verdict: Verdict) -> int | None:
        """Keep the drafts made ahead for the next round when the target took every draft and
        its bonus token is the draft's guess (the draft then holds the history up to that
        bonus: returned); else drop the call."""
        drafts = self.drafts
        if not (verdict.is_bonus and verdict.num_accepted == len(drafts)):
            await self.discard()  # its work on the draft is wasted; the next call rolls it back
            return None
        proposal = await self.future
        if proposal is None or len(proposal.draft_tokens) < 2 or proposal.draft_tokens[0] != verdict.next_token:
            return None
        self.run.predrafted = Predrafted(self.base + len(drafts) + 1, Proposal(
            proposal.draft_tokens[1:], proposal.draft_probs[1:], proposal.cached_len))
        return self.base + len(drafts) + 1  # it fed dγ and the bonus too

    async def discard(self) -> None:
        await discard(self.future)

    def cancel(self) -> None:
        if not self.future.done():
            self.future.cancel()


async def _propose_ahead(client: DraftClient, session_id: str, prefix_len: int, prefix_hash: int, token: int,
                         steps: int, params: SamplingParams, seed: int, min_confidence: float,
                         timeout_s: float, drafted: int, cache_salt: str) -> Proposal | None:
    """The call made ahead; None when it fails (the next round then calls the draft as usual).
    Its history ends in the round's `drafted` drafts, which the target has not accepted yet."""
    try:
        return await client.propose(session_id, prefix_len, prefix_hash, [token], steps, params, seed,
                                    timeout_s=timeout_s, min_confidence=min_confidence, uncommitted=drafted,
                                    cache_salt=cache_salt)
    except SpecdecError as exc:
        log.debug("session %s: the draft call made ahead failed (%s)", session_tag(session_id), exc)
        return None
