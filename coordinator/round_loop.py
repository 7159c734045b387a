"""The speculation loop: plan, propose, verify, commit, store, stream.

Rounds are pipelined: once a round is committed, its session-store write and the start of the
next round (its Propose, or its Verify when it proposes nothing remotely) run at the same
time, and the round's chunk is streamed only once the write has completed (commit before
stream: nothing reaches the client before the store holds it). A request that ends (finish
reason, error, cancel, lost lease) cancels the round started ahead and waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any, AsyncIterator

from specdec.config import CoordinatorConfig
from specdec.errors import FailedPrecondition, NotFound, ResourceExhausted, SpecdecError
from specdec.fingerprint import PrefixHashes
from specdec.logtag import session_tag
from specdec.metrics import Metrics
from specdec.rng import RequestRng
from specdec.maths.tree import TokenTree
from specdec.types import CoreSharing, ModelDescription, Source, SamplingParams, TokenLogprobs, Trees

from coordinator.session_calls import SessionCalls
from coordinator.sessions.lease_keeper import LeaseKeeper
from coordinator.policy.load_governor import LoadGovernor
from coordinator.recording import Recorder
from coordinator.sources.base import ProposalSource
from coordinator.sources.draft_model import DraftModel, catch_up_tokens
from coordinator.sources.heads_source import HeadsSource
from coordinator.sources.none import NoProposals
from coordinator.sources.prompt_lookup import PromptLookup
from coordinator.request import GenerationRequest, InputEncoder, SpeculationMode, request_limits
from coordinator.rounds import Chunk, FinishReason, RequestRun, Round, RoundResult, TokenTimes
from coordinator.sessions.routing import Routes, model_fingerprint
from coordinator.policy.speculation import NO_LOOKUP, Offers, RequestSpeculation, Speculation, is_governed
from coordinator.stats import GenerationStats
from coordinator.sessions.session_store import Lease, SessionRecord, SessionStore
from coordinator.streamed_text import StreamedText
from coordinator.tasks import discard
from coordinator.sessions.model_tiers import Tier, tiers_compete

log = logging.getLogger(__name__)


class RoundLoop:
    # Start the next round while this round's store write runs (see the module docstring).
    # bench/overhead.py turns it off to measure what it saves.
    overlap_store = True

    def __init__(self, config: CoordinatorConfig, store: SessionStore, routes: Routes, tokenizer: Any,
                 draft_info: ModelDescription, target_info: ModelDescription, metrics: Metrics | None = None,
                 recorder: Recorder | None = None):
        self.config = config
        self.recorder = recorder  # --record-dir / --record-stream (None: off)
        self.store = store
        self.routes = routes  # each session's draft and target replica
        self.tokenizer = tokenizer
        self.draft_info = draft_info
        self.target_info = target_info
        self.eos_ids = frozenset(target_info.eos_token_ids)
        self.max_gamma = min(config.max_num_speculative_tokens, draft_info.max_speculative_tokens,
                             target_info.max_speculative_tokens)
        self.context_length = target_info.max_context_length
        self.inputs = InputEncoder(
            tokenizer, vocab_limit=min(draft_info.vocab_size, target_info.vocab_size),
            max_prompt_tokens=min(config.max_prompt_tokens or self.context_length - 1, self.context_length - 1),
            context_length=self.context_length)
        self.active = 0  # requests generating now
        self.adaptive = 0  # of them, adaptive `auto` ones (what the load governor can switch)
        self.verifying_tokens = 0  # tokens of the Verify calls in flight (what the target batches)
        self.governor = LoadGovernor() if config.load_governor else None
        self.metrics = metrics or Metrics("coordinator")
        self.metrics.watch(active_sessions=lambda: self.active)
        self.speculation = Speculation(self.max_gamma, config.default_num_speculative_tokens,
                                       config.draft_cost_ratio, draft_hints=config.draft_hints,
                                       min_confidence=config.draft_min_confidence, trees=Trees(config.trees),
                                       draft_model=model_fingerprint(draft_info))
        self.calls = SessionCalls(routes, config)
        self.draft_model = DraftModel(self.calls, routes, config, draft_info, self.max_gamma,
                                      self.context_length, load=lambda: self.active,
                                      beside_verification=not tiers_compete(
                                          CoreSharing(config.tiers_share_cores), draft_info, target_info))
        self.prompt_lookup = PromptLookup(config.ngram_max, config.ngram_max_tokens)
        self.heads = HeadsSource(config.head_candidates)
        self.sources: dict[Source, ProposalSource] = {
            source.kind: source for source in (self.draft_model, self.prompt_lookup, self.heads, NoProposals())}

    # ---- sessions -----------------------------------------------------------------------------

    async def get_session(self, session_id: str) -> SessionRecord:
        return await self.store.get(session_id)

    async def delete_session(self, session_id: str) -> bool:
        """Forget a session: its record, what the policy learnt of it, and its KV caches."""
        try:
            record = await self.store.get(session_id)  # where its caches are
        except NotFound:
            record = None
        deleted = await self.store.delete(session_id)
        self.speculation.forget(session_id)
        if record is not None:
            await self.routes.release(record)
        return deleted

    async def _open(self, request: GenerationRequest) -> tuple[Lease, list[int]]:
        """Lease (or create) the session and encode the input; nothing is committed yet."""
        if request.session_id:
            lease = await self.store.acquire(request.session_id)
            try:
                added = self.inputs.input_ids(request, len(lease.record.token_ids))
            except BaseException:
                await self.store.release(lease)
                raise
            return lease, added
        added = self.inputs.input_ids(request, 0)
        created = await self.store.create()
        return await self.store.acquire(created.session_id), added

    async def _abandon(self, record: SessionRecord, lease: Lease) -> None:
        """Free the KV caches a request leaves behind; its committed tokens stay in the store."""
        await self.routes.release(record)
        self.calls.released(record)
        try:
            await self.store.save(record, lease)
        except SpecdecError as exc:
            log.info("session %s: could not record the released caches (%s)", session_tag(record.session_id), exc)

    # ---- the loop ---------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        max_new, mode = request_limits(request, self.config, self.max_gamma)
        if self.active >= self.config.max_concurrent_generations:
            raise ResourceExhausted(
                f"{self.active} generations are running, the limit of this coordinator "
                "(--max-concurrent-generations); retry in a second", retry_after_s=1.0)
        if mode.source == Source.HEADS:
            self._check_heads()
        governed = is_governed(mode.source, mode.fixed_gamma)  # what the governor may switch
        times = TokenTimes(time.perf_counter())
        self.active += 1
        self.adaptive += governed
        try:
            lease, added = await self._open(request)
            record = lease.record
            finished = False
            try:
                # renewed on a timer, whatever a round takes; lost (taken over) stops the request
                async with LeaseKeeper(self.store, lease, self.config.session_lease_s / 3) as keeper, \
                        contextlib.aclosing(self._run(request, record, lease, added, max_new, mode)) as chunks:
                    # aclosing: however this ends, the round _run started ahead is gone before
                    # the caches are released below
                    async for chunk in chunks:
                        self._observe_latency(times, chunk)
                        yield chunk
                        if chunk.finish_reason is None:
                            keeper.check()
                finished = True
            finally:
                if not finished:  # cancelled, past its deadline, failed or taken over
                    await self._abandon(record, lease)
                await self.store.release(lease)
        finally:
            self.active -= 1
            self.adaptive -= governed

    def _check_heads(self) -> None:
        """`proposer=heads` needs a target replica that serves heads, and a coordinator that asks
        for their proposals: FAILED_PRECONDITION otherwise, saying what to change."""
        known = self.routes.targets.infos()
        if known and not any(info.num_heads > 0 for info in known):
            raise FailedPrecondition("the target serves no heads: start it with --heads DIR, or use proposer auto")
        if self.config.head_candidates == 0:
            raise FailedPrecondition("this coordinator asks the target for no heads' proposals "
                                     "(--head-candidates 0): raise it, or use proposer auto")

    async def _run(self, request: GenerationRequest, record: SessionRecord, lease: Lease,
                   added: list[int], max_new: int, mode: SpeculationMode) -> AsyncIterator[Chunk]:
        started = time.perf_counter()
        run = RequestRun(record, GenerationStats(prompt_tokens=len(added)), PrefixHashes(record.token_ids),
                         cache_salt=request.cache_salt, top_logprobs=request.top_logprobs)
        run.commit(added)
        record.requests += 1
        self.routes.place(record)  # KV held by another replica (or none recorded) is worth nothing here
        await self.store.save(record, lease)
        spec = self.speculation.start(record.session_id, mode.source, mode.fixed_gamma, request.tree_nodes,
                                      self.draft_info.verifies_trees and self.target_info.verifies_trees,
                                      self.routes.drafts.model_of(record.draft.address))
        rng = RequestRng(request.seed)
        text = StreamedText(self.tokenizer, record.token_ids, request.stop)
        generated: list[int] = []
        finish: FinishReason | None = None
        ahead: asyncio.Task | None = None  # the next round, started while this one is stored
        try:
            while finish is None:
                if self.context_length - len(record.token_ids) <= 0:
                    finish = FinishReason.CONTEXT
                    result: RoundResult | None = None
                    round_tokens: list[int] = []
                    round_logprobs: list[TokenLogprobs] = []
                else:
                    this_round = ahead if ahead is not None else self._round(
                        run, spec, *self._room(record, generated, max_new), request.params, rng)
                    ahead = None  # awaited: done (its result or error taken) however the await ends
                    result = await this_round
                    round_tokens = []
                    for token in result.verdict.committed(result.drafts):
                        round_tokens.append(token)
                        generated.append(token)
                        if token in self.eos_ids and not request.ignore_eos:
                            finish = FinishReason.EOS
                            break
                        if text.add(token):
                            finish = FinishReason.STOP
                            break
                        if len(generated) >= max_new:
                            finish = FinishReason.LENGTH
                            break
                    run.commit(round_tokens)
                    round_logprobs = list(result.verdict.logprobs[:len(round_tokens)])
                    if self.governor is not None:
                        self.governor.record(len(round_tokens))
                    self.calls.committed(record)  # a replica never holds more than is committed
                    run.stats.generated_tokens = len(generated)
                    self._observe_policy(spec, result)  # before the next round is planned
                    for source in self.sources.values():
                        source.committed(record.session_id, result)
                    store_started = time.perf_counter()
                    committed = dataclasses.replace(record)  # what the store must hold before the chunk goes
                    if (finish is None and self.overlap_store
                            and self.context_length - len(record.token_ids) > 0):
                        ahead = asyncio.ensure_future(self._round(
                            run, spec, *self._room(record, generated, max_new), request.params, rng))
                    await self._save_snapshot(record, committed, lease)  # an error cancels `ahead` (finally)
                    self._observe_metrics(result, store_started)
                delta, finish = text.delta(finish)
                if self.recorder is not None:
                    self.recorder.observe(run, result, len(round_tokens), finish)
                chunk = Chunk(record.session_id, delta, round_tokens, logprobs=round_logprobs)
                if finish is not None:
                    run.stats.coordinator_seconds = max(
                        0.0, time.perf_counter() - started - run.stats.draft_seconds - run.stats.target_seconds)
                    chunk.finish_reason, chunk.stats = finish, run.stats
                    record.stats = GenerationStats.from_dict(record.stats).merged(run.stats).to_dict()
                    await self.store.save(record, lease)
                yield chunk
        finally:
            for source in self.sources.values():
                source.forget(record.session_id)
            if ahead is not None:
                await discard(ahead)

    def _room(self, record: SessionRecord, generated: list[int], max_new: int) -> tuple[int, int]:
        """(cap, tokens left): the most tokens the next round may propose (the context has room
        for one more), and the most the request may still commit."""
        base = len(record.token_ids)
        left = max(0, min(max_new - len(generated), self.context_length - base))
        return max(0, min(self.max_gamma, left - 1, self.draft_info.max_context_length - base)), left

    async def _save_snapshot(self, record: SessionRecord, snapshot: SessionRecord, lease: Lease) -> None:
        """Store `snapshot`, a shallow copy of `record` taken when a round was committed: the
        round started meanwhile may move what the services hold (the record's placements, which
        are replaced, never changed in place) before the write completes, and the write is not
        affected. The token list is shared: committed tokens only grow in the loop, between
        writes, never during one."""
        await self.store.save(snapshot, lease)
        record.stored_len, record.updated_at = snapshot.stored_len, snapshot.updated_at

    @staticmethod
    def _observe_policy(spec: RequestSpeculation, result: RoundResult) -> None:
        """Feed a finished round to the request's policy."""
        spec.observe(result.source, len(result.drafts), result.verdict.num_accepted,
                     propose_seconds=result.propose_seconds,
                     verify_seconds=result.verify_seconds if result.verified_tokens else None,
                     verified_tokens=result.verified_tokens or len(result.drafts) + 1,
                     hints_kept=result.hints_kept, batch_tokens=result.batch_tokens,
                     tree=result.tree, accepted_nodes=result.verdict.accepted_nodes,
                     lookup_nodes=result.lookup_nodes)
        if result.caught_up and result.call_seconds is not None:
            spec.observe_catch_up(result.caught_up, result.plan.gamma, result.call_seconds)

    def _observe_latency(self, times: TokenTimes, chunk: Chunk) -> None:
        """A chunk leaves: the request's time to first token, and at its end its time per output token."""
        first = times.streamed(len(chunk.token_ids), time.perf_counter())
        if first is not None:
            self.metrics.observe_first_token(first)
        if chunk.finish_reason is not None and (per_token := times.per_output_token()) is not None:
            self.metrics.observe_time_per_output_token(per_token)

    def _observe_metrics(self, result: RoundResult, store_started: float) -> None:
        """Record a committed and stored round in the metrics."""
        now = time.perf_counter()
        proposed, accepted = len(result.drafts), result.verdict.num_accepted
        stages = {"verify": result.verify_seconds, "store": now - store_started}
        if result.call_seconds is not None:  # the Propose call, answered or failed
            stages["draft"] = result.call_seconds
        stages["coordinator"] = max(0.0, now - result.started - sum(stages.values()))
        self.metrics.record_round(result.source if proposed else Source.NONE, proposed, accepted, stages,
                                  tree=bool(result.parents) and result.source == Source.DRAFT)

    # ---- one round ----------------------------------------------------------------------------

    def _plan(self, run: RequestRun, spec: RequestSpeculation, cap: int, tokens_left: int,
              params: SamplingParams, rng: RequestRng) -> Round:
        """The round's source and γ (at most `cap`): draft model, prompt lookup, the heads or none."""
        started = time.perf_counter()
        record, stats = run.record, run.stats
        seeds = rng.round_seeds()
        # a usable replica, and this request is not backing off the draft after a timeout
        draft_up = self.routes.usable(Tier.DRAFT) and run.draft_backoff.ready(stats.rounds)
        if not draft_up and spec.uses_draft:
            stats.fallback_rounds += 1
        spec.load = max(1, self.active)  # the generations whose rounds share the target's batches
        draft_model = self.routes.drafts.model_of(record.draft.address)
        if draft_model is not None and draft_model != spec.draft_model:  # its replica serves another model now
            self.speculation.use_draft_model(spec, draft_model)
        allowed = self.governor is None or self.governor.speculate(self.adaptive)
        plan = spec.plan(self._offers(spec, record, cap, draft_up, allowed), cap, tokens_left, allowed)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("session %s round: %s", session_tag(record.session_id), spec.describe(plan))
        return Round(run, spec, plan, len(record.token_ids), cap, params, rng, seeds, draft_up, allowed, started,
                     head_candidates=self.heads.candidates if plan.read_heads else 0)

    def _offers(self, spec: RequestSpeculation, record: SessionRecord, cap: int, draft_up: bool,
                allowed: bool) -> Offers:
        """What each source can offer the session's next round, asked once before it is planned:
        prompt lookup's match (where the plan would use one), what the draft lacks of the
        history, and where the request may use the target's heads and its target replica serves
        them, what a heads round could be and the proposals the round before read. The request
        plans with what is known of those heads (their id)."""
        base = len(record.token_ids)
        lookup = (self.prompt_lookup.look(record.session_id, record.token_ids, cap)
                  if spec.looks_up(cap, allowed) else NO_LOOKUP)
        target = self.routes.targets.info_of(record.target.address)
        if not spec.uses_heads or target is None or target.num_heads <= 0:
            served = at_hand = None
        else:
            self.speculation.use_heads(spec, target.heads_id)
            served, at_hand = self.heads.offer(record.session_id, base, target, self.config.max_num_speculative_tokens)
        return Offers(lookup, draft_up, catch_up_tokens(record, base), at_hand, served)

    async def _round(self, run: RequestRun, spec: RequestSpeculation, cap: int, tokens_left: int,
                     params: SamplingParams, rng: RequestRng) -> RoundResult:
        """One round: plan it, ask the planned source for its proposals (prompt lookup makes no
        draft call; a failing draft makes the round target-only), one verification with every
        source's side work alongside; records what the draft holds as the sources report it. What the draft holds stays
        as it was when a round does not call it: its next call sends what it lacks."""
        rnd = self._plan(run, spec, cap, tokens_left, params, rng)
        record, stats, base = run.record, run.stats, rnd.base
        source = self.sources[rnd.plan.source]
        drafts = await source.propose(rnd)
        side = [call for s in self.sources.values() if (call := s.alongside(rnd, drafts)) is not None]
        tokens, proposal = drafts.proposal.draft_tokens, drafts.proposal
        lacking, misses = base - min(record.target.held, base - 1), stats.cache_misses
        t0 = time.perf_counter()
        own = len(tokens) + 1
        self.verifying_tokens += own
        batch_tokens = self.verifying_tokens  # this round's and the other generations' in flight
        try:
            verdict = await self.calls.verify(run, tokens, proposal, params, rnd.seeds.target, rnd.head_candidates)
        except BaseException:
            for call in side:
                await call.discard()
            raise
        finally:
            self.verifying_tokens -= own
        verify_s = time.perf_counter() - t0
        try:
            stats.target_seconds += verify_s
            stats.record_round(len(tokens), verdict.num_accepted, drafts.source, proposal.hints_kept,
                               TokenTree(tuple(tokens), proposal.parents) if proposal.parents else None,
                               verdict.accepted_nodes, drafts.lookup_nodes)
            self.calls.draft_holds(record, source.observe(rnd, drafts, verdict))
            for call in side:
                self.calls.draft_holds(record, await call.settle(verdict))
        finally:
            for call in side:  # cancelled meanwhile: no call left behind
                call.cancel()
        # a plain round sends the target its one new token; more is a prefill or a resend
        verified = lacking + len(tokens) if lacking == 1 and stats.cache_misses == misses else 0
        return RoundResult(
            plan=rnd.plan, verdict=verdict, drafts=tokens, source=drafts.source,
            propose_seconds=drafts.propose_seconds, call_seconds=drafts.call_seconds, verify_seconds=verify_s,
            verified_tokens=verified, started=rnd.started, hints_kept=proposal.hints_kept,
            batch_tokens=batch_tokens, ahead=rnd.ahead, seconds=time.perf_counter() - rnd.started,
            parents=proposal.parents, lookup_nodes=drafts.lookup_nodes, base=base, caught_up=drafts.caught_up)
