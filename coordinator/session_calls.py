"""A request's calls to its session's draft and target replicas.

Each call sends what the replica lacks: the committed tokens past what the session record says
it holds (at least the last one, so a replica holding everything still has a token to run).
On a cache miss (the replica lost the session, or holds another history) the call is resent
with the full history from prefix_len 0; while the tier is unreachable it is retried, on the
next replica when there is one, for up to its retry budget — with the same seeds, so a retried
round draws the same numbers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from specdec.config import CoordinatorConfig
from specdec.errors import CacheMiss, FailedPrecondition, Unavailable
from specdec.logtag import session_tag
from specdec.types import Proposal, SamplingParams, Verdict

from coordinator.sessions.clients import ServiceClient
from coordinator.rounds import RequestRun
from coordinator.sessions.routing import Routes
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
            timeout_s=self.config.draft_timeout_s, hints=hints, min_confidence=min_confidence,
            cache_salt=run.cache_salt, tree_nodes=tree_nodes))

    async def verify(self, run: RequestRun, drafts: list[int], proposal: Proposal, params: SamplingParams,
                     seed: int) -> Verdict:
        sid = run.record.session_id
        return await self._with_resend(run, Tier.TARGET, lambda target, prefix, new_tokens: target.verify(
            sid, prefix, run.hashes.at(prefix), new_tokens, drafts, proposal.draft_probs, params, seed,
            wait_for_ready=False, cache_salt=run.cache_salt, top_logprobs=run.top_logprobs,
            draft_parents=list(proposal.parents)),
            retry_s=self.config.target_retry_s)

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
            except Unavailable:
                self.routes.failed(tier, record.placement(tier).address)
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


def _after_miss(run: RequestRun, miss: CacheMiss, prefix: int, tier: Tier) -> None:
    if prefix == 0:
        raise FailedPrecondition(f"{tier} service reported a cache miss at prefix_len 0: {miss}")
    run.stats.cache_misses += 1
    log.info("%s cache miss for session %s (held %d, assumed %d): resending history",
             tier, session_tag(run.record.session_id), miss.held, prefix)
