"""A request's calls to its session's draft and target replicas.

Each call sends what the replica lacks: the committed tokens past what the session record says
it holds (at least the last one, so a replica holding everything still has a token to run).
On a cache miss (the replica lost the session, or holds another history) the call is resent
with the full history from prefix_len 0; while the tier is unreachable it is retried, on the
next replica when there is one, for up to its retry budget — with the same seeds, so a retried
round draws the same numbers. A target call that ran out of time (a service that stopped
answering: its deadline follows its work, see coordinator/sessions/deadlines.py) is retried the
same way, but its replica is health-checked first and counted failed only when it does not
answer: a slow replica keeps its sessions, and the retry resumes from the chunks it finished. A draft replica's calls get --draft-cold-deadline-s until it has
answered one (its first call may run cold), --draft-timeout-s afterwards.

`SessionCalls` is also the one owner of what each replica holds (the session record's
`Placement.held`): only it records a held length, after its own calls (a miss: nothing; a
Verify: the history and the accepted drafts) and as the round loop reports the rest (what the
draft holds after a round, as its sources say; what is left once a round is committed or a
request abandons its caches). The replica itself is chosen by the routes (a move holds nothing).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from specdec.config import CoordinatorConfig
from specdec.errors import CacheMiss, DeadlineExceeded, FailedPrecondition, Unavailable
from specdec.logtag import session_tag
from specdec.types import Proposal, SamplingParams, Verdict

from coordinator.sessions.clients import ServiceClient
from coordinator.rounds import RequestRun
from coordinator.sessions.routing import Routes
from coordinator.sessions.session_store import SessionRecord
from coordinator.sessions.model_tiers import Tier

log = logging.getLogger(__name__)

Call = Callable[[Any, int, list[int]], Awaitable[Any]]  # (client, prefix_len, new_tokens) -> answer


class SessionCalls:
    """Propose and Verify for a request's session, with resends and retries (module docstring)."""

    def __init__(self, routes: Routes, config: CoordinatorConfig):
        self.routes = routes
        self.config = config

    async def propose(self, run: RequestRun, gamma: int, params: SamplingParams, seed: int,
                      hints: list[int] | None = None, min_confidence: float = 0.0,
                      tree_nodes: int = 0) -> Proposal:
        sid = run.record.session_id
        return await self._with_resend(run, Tier.DRAFT, lambda draft, prefix, new_tokens: draft.propose(
            sid, prefix, run.hashes.at(prefix), new_tokens, gamma, params, seed,
            timeout_s=propose_deadline_s(draft.answered, self.config), hints=hints, min_confidence=min_confidence,
            cache_salt=run.cache_salt, tree_nodes=tree_nodes))

    async def verify(self, run: RequestRun, drafts: list[int], proposal: Proposal, params: SamplingParams,
                     seed: int, head_candidates: int = 0) -> Verdict:
        """The target's verdict on `drafts` (with its heads' proposals for the next round when
        `head_candidates` > 0); the target then holds the history and the accepted drafts."""
        sid = run.record.session_id
        base = len(run.record.token_ids)
        verdict = await self._with_resend(run, Tier.TARGET, lambda target, prefix, new_tokens: target.verify(
            sid, prefix, run.hashes.at(prefix), new_tokens, drafts, proposal.draft_probs, params, seed,
            wait_for_ready=False, cache_salt=run.cache_salt, top_logprobs=run.top_logprobs,
            draft_parents=list(proposal.parents), head_candidates=head_candidates),
            retry_s=self.config.target_retry_s)
        run.record.hold(Tier.TARGET, base + verdict.num_accepted)
        return verdict

    # ---- what the replicas hold, as the round loop reports it ------------------------------------

    @staticmethod
    def draft_holds(record: SessionRecord, held: int | None) -> None:
        """After a round: the draft holds the first `held` committed tokens (None: as recorded)."""
        if held is not None:
            record.hold(Tier.DRAFT, held)

    @staticmethod
    def committed(record: SessionRecord) -> None:
        """A round was committed: a replica never holds more than is committed (a round may
        commit fewer tokens than were accepted: an end of sequence, a stop string, the length)."""
        for tier in Tier:
            if record.placement(tier).held > len(record.token_ids):
                record.hold(tier, len(record.token_ids))

    @staticmethod
    def released(record: SessionRecord) -> None:
        """The request released the session's caches: no replica holds any of it now."""
        for tier in Tier:
            record.hold(tier, 0)

    async def _with_resend(self, run: RequestRun, tier: Tier, call: Call, retry_s: float = 0.0) -> Any:
        """call(client, prefix_len, new_tokens) with the session's replica and what it lacks. On a
        cache miss, again with the full history from prefix_len 0; while the tier is unreachable,
        again for up to retry_s seconds, on the next replica when there is one."""
        record = run.record
        give_up_at: float | None = None
        backoff = 0.1
        while True:
            try:
                client: ServiceClient = self.routes.pick(tier, record)  # a moved session holds nothing there
                # a replica holding every committed token still needs one to run: resend the last
                prefix = min(record.placement(tier).held, len(record.token_ids) - 1)
                new_tokens = record.token_ids[prefix:]
                result = await call(client, prefix, new_tokens)
            except CacheMiss as miss:
                _after_miss(run, miss, prefix, tier)
                record.hold(tier, 0)
                continue
            except Unavailable as exc:
                if tier == Tier.DRAFT and isinstance(exc, DeadlineExceeded):
                    raise  # slow is not down: the draft source backs off (sources/draft_model.py)
                await self._after_failure(tier, record.placement(tier).address, exc)
                now = time.monotonic()
                give_up_at = now + retry_s if give_up_at is None else give_up_at
                if now >= give_up_at:
                    raise
                run.stats.target_retries += tier == Tier.TARGET
                if not self.routes.usable(tier):  # else at once, on the next replica
                    await asyncio.sleep(min(backoff, give_up_at - now))
                    backoff = min(backoff * 2, 1.0)
                continue
            if run.calls[tier] == 0 or prefix == 0:  # what the replica had to prefill
                run.stats.add_prefill(tier, len(new_tokens), result.restored_tokens)
            run.calls[tier] += 1
            return result


    async def _after_failure(self, tier: Tier, address: str, exc: Unavailable) -> None:
        """A call to address failed: an unreachable replica is marked failed; one that ran out of
        time is health-checked and marked failed only when it does not answer."""
        if not isinstance(exc, DeadlineExceeded):
            self.routes.failed(tier, address)
        elif await self.routes.check_alive(tier, address):
            log.warning("%s; it answers its health check: slow, not down, so the call is retried there", exc)
        else:
            log.warning("%s; it does not answer its health check: its sessions move", exc)


def propose_deadline_s(answered: bool, config: CoordinatorConfig) -> float:
    """A Propose call's budget: --draft-timeout-s once the replica has answered a Propose (warm),
    --draft-cold-deadline-s before (its first call may run cold), whichever is longer."""
    return config.draft_timeout_s if answered else max(config.draft_timeout_s, config.draft_cold_deadline_s)


def _after_miss(run: RequestRun, miss: CacheMiss, prefix: int, tier: Tier) -> None:
    if prefix == 0:
        raise FailedPrecondition(f"{tier} service reported a cache miss at prefix_len 0: {miss}")
    run.stats.cache_misses += 1
    log.info("%s cache miss for session %s (held %d, assumed %d): resending history",
             tier, session_tag(run.record.session_id), miss.held, prefix)
