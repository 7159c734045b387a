"""The speculation loop: propose, verify, commit, store, stream.

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
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from specdec.config import CoordinatorConfig
from specdec.errors import (
    CacheMiss, FailedPrecondition, InvalidArgument, ResourceExhausted, ServiceFault, SpecdecError,
    Unavailable,
)
from specdec.fingerprint import PrefixHashes, extend_hash
from specdec.logtag import session_tag
from specdec.metrics import Metrics
from specdec.rng import RequestRng
from specdec.types import ModelDescription, Proposal, SamplingParams, Verdict

from coordinator.ahead import ON, AheadGovernor
from coordinator.chat import render_messages
from coordinator.clients import release_quietly
from coordinator.detokenizer import IncrementalDetokenizer, StopStrings
from coordinator.governor import LoadGovernor
from coordinator.lease_keeper import LeaseKeeper
from coordinator.policy import DRAFT, NGRAM, NONE
from coordinator.routing import Routes
from coordinator.speculation import MODES, Plan, RequestSpeculation, Speculation, is_governed, one_hot_dists
from coordinator.stats import GenerationStats
from coordinator.store import Lease, SessionRecord, SessionStore

log = logging.getLogger(__name__)

MAX_STOP_STRINGS = 16

FINISH_EOS = "eos"
FINISH_LENGTH = "length"
FINISH_STOP = "stop"
FINISH_CONTEXT = "context_length"


@dataclass(frozen=True)
class GenerationRequest:
    """A Generate call as a domain object. Exactly one input (or none when continuing)."""

    session_id: str = ""
    prompt: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    max_new_tokens: int | None = None
    num_speculative_tokens: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    proposer: str | None = None  # auto | draft | ngram | none; None = the coordinator's default


@dataclass(frozen=True)
class SpeculationMode:
    """A request's speculation override: the proposer and a fixed γ (None = adaptive)."""

    proposer: str
    fixed_gamma: int | None


@dataclass
class _RoundResult:
    """What one round did, for the commit, the stats, the policy and the metrics."""

    plan: Plan
    verdict: Verdict
    drafts: list[int]
    source: str              # who proposed `drafts`: draft | ngram | none (the draft failed)
    draft_seconds: float     # the Propose call (0 without one)
    verify_seconds: float
    propose_timed: bool      # the Propose call was a plain round (no catch-up prefill, no resend)
    verified_tokens: int     # tokens the Verify forward took (0 when it was not a plain round)
    started: float = 0.0     # time.perf_counter() when the round began
    hints_kept: int = 0      # leading drafts that are prompt-lookup hints the draft model kept
    batch_tokens: int = 0    # tokens verified across this coordinator's generations meanwhile
    predrafted: bool = False  # the drafts came from a call made ahead (no Propose call this round)
    ahead: str | None = None  # a draft round's --draft-ahead mode (on | off; None: not the governor's)
    seconds: float = 0.0     # the round's own time: plan, propose, verify (the store write overlaps)


@dataclass
class Chunk:
    """One streamed piece: new text and tokens; the last one has finish_reason and stats."""

    session_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stats: GenerationStats | None = None


@dataclass(frozen=True)
class _Predrafted:
    """Drafts a call made ahead proposed for the round that starts with `base` committed tokens."""

    base: int
    proposal: Proposal


@dataclass
class _Run:
    """State of one request while it runs."""

    record: SessionRecord
    stats: GenerationStats
    hashes: PrefixHashes = field(default_factory=PrefixHashes)  # fingerprints of record.token_ids' prefixes
    calls: dict[str, int] = field(default_factory=lambda: {"draft": 0, "target": 0})
    predrafted: _Predrafted | None = None  # drafted ahead for the next round (--draft-ahead)

    def commit(self, tokens: list[int]) -> None:
        self.record.token_ids.extend(tokens)
        self.hashes.extend(tokens)


class Engine:
    # Start the next round while this round's store write runs (see the module docstring).
    # bench/overhead.py turns it off to measure what it saves.
    overlap_store = True

    def __init__(self, config: CoordinatorConfig, store: SessionStore, routes: Routes, tokenizer: Any,
                 draft_info: ModelDescription, target_info: ModelDescription, metrics: Metrics | None = None):
        self.config = config
        self.store = store
        self.routes = routes  # each session's draft and target replica
        self.tokenizer = tokenizer
        self.draft_info = draft_info
        self.target_info = target_info
        self.eos_ids = frozenset(target_info.eos_token_ids)
        self.vocab_limit = min(draft_info.vocab_size, target_info.vocab_size)
        self.max_gamma = min(config.max_num_speculative_tokens, draft_info.max_speculative_tokens,
                             target_info.max_speculative_tokens)
        self.context_length = target_info.max_context_length
        self.max_prompt_tokens = min(config.max_prompt_tokens or self.context_length - 1,
                                     self.context_length - 1)
        self.active = 0  # requests generating now
        self.adaptive = 0  # of them, adaptive `auto` ones (what the load governor can switch)
        self.verifying_tokens = 0  # tokens of the Verify calls in flight (what the target batches)
        self.governor = LoadGovernor() if config.load_governor else None
        self.ahead = AheadGovernor(config.draft_ahead)  # whether draft rounds draft ahead
        self.metrics = metrics or Metrics("coordinator")
        self.metrics.watch(active_sessions=lambda: self.active)
        self.speculation = Speculation(self.max_gamma, config.default_num_speculative_tokens,
                                       config.ngram_max, config.ngram_max_tokens, config.draft_cost_ratio,
                                       draft_hints=config.draft_hints,
                                       min_confidence=config.draft_min_confidence)

    # ---- validation -------------------------------------------------------------------------

    def _limits(self, request: GenerationRequest) -> tuple[int, SpeculationMode]:
        """(max_new_tokens, proposer and fixed γ) after defaults, validated."""
        request.params.validate()
        max_new = request.max_new_tokens
        if max_new is None:
            max_new = self.config.default_max_new_tokens
        if not 1 <= max_new <= self.config.max_new_tokens_limit:
            raise InvalidArgument(
                f"max_new_tokens must be in [1, {self.config.max_new_tokens_limit}], got {max_new}")
        gamma = request.num_speculative_tokens  # None: adaptive
        if gamma is not None and not 0 <= gamma <= self.max_gamma:
            raise InvalidArgument(
                f"num_speculative_tokens must be in [0, {self.max_gamma}] (0 disables speculation; "
                f"leave it unset for adaptive γ), got {gamma}")
        proposer = request.proposer or self.config.default_proposer
        if proposer not in MODES:
            raise InvalidArgument(
                f"proposer must be one of {', '.join(MODES)} (PROPOSER_AUTO, PROPOSER_DRAFT, "
                f"PROPOSER_NGRAM, PROPOSER_NONE), got {proposer!r}")
        if len(request.stop) > MAX_STOP_STRINGS:
            raise InvalidArgument(f"at most {MAX_STOP_STRINGS} stop strings, got {len(request.stop)}")
        return max_new, SpeculationMode(proposer, gamma)

    def _encode(self, request: GenerationRequest, continuing: bool) -> list[int]:
        """The request's input as token ids (possibly empty when continuing)."""
        if request.prompt is not None:
            if not request.prompt and not continuing:
                raise InvalidArgument("prompt is empty: give some text, token_ids or messages")
            return list(self.tokenizer(request.prompt, add_special_tokens=not continuing)["input_ids"])
        if request.messages is not None:
            return render_messages(self.tokenizer, request.messages, continuing)
        if request.token_ids is not None:
            ids = list(request.token_ids)
            if not ids and not continuing:
                raise InvalidArgument("token_ids is empty: give at least one token")
            return ids
        if not continuing:
            raise InvalidArgument("no input: set prompt, token_ids or messages")
        return []

    def _check_ids(self, ids: list[int]) -> list[int]:
        """Every input id must be one both models can take (a text prompt can encode to an added
        token past a model's embedding): refused before anything is committed."""
        bad = [t for t in ids if not 0 <= t < self.vocab_limit]
        if bad:
            raise InvalidArgument(f"the input holds token ids outside the vocabulary both models share "
                                  f"[0, {self.vocab_limit}): {bad[:5]}")
        return ids

    def _check_length(self, committed: int, added: int) -> None:
        if added > self.max_prompt_tokens:
            raise InvalidArgument(
                f"prompt is {added} tokens; the limit is {self.max_prompt_tokens} "
                f"(model context {self.context_length})")
        if committed + added >= self.context_length:
            raise InvalidArgument(
                f"session holds {committed} tokens; adding {added} leaves no room in the model "
                f"context of {self.context_length} tokens: start a new session")

    async def _open(self, request: GenerationRequest) -> tuple[Lease, list[int]]:
        """Lease (or create) the session and encode the input; nothing is committed yet."""
        if request.session_id:
            lease = await self.store.acquire(request.session_id)
            try:
                added = self._check_ids(self._encode(request, continuing=bool(lease.record.token_ids)))
                self._check_length(len(lease.record.token_ids), len(added))
            except BaseException:
                await self.store.release(lease)
                raise
            return lease, added
        added = self._check_ids(self._encode(request, continuing=False))
        self._check_length(0, len(added))
        created = await self.store.create()
        return await self.store.acquire(created.session_id), added

    # ---- the loop ---------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        max_new, mode = self._limits(request)
        if self.active >= self.config.max_concurrent_generations:
            raise ResourceExhausted(
                f"{self.active} generations are running, the limit of this coordinator "
                "(--max-concurrent-generations); retry in a second", retry_after_s=1.0)
        governed = is_governed(mode.proposer, mode.fixed_gamma)  # what the governor may switch
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

    async def _abandon(self, record: SessionRecord, lease: Lease) -> None:
        """Free the KV caches a request leaves behind; its committed tokens stay in the store."""
        await self.routes.release(record)
        record.draft_held = record.target_held = 0
        try:
            await self.store.save(record, lease)
        except SpecdecError as exc:
            log.info("session %s: could not record the released caches (%s)", session_tag(record.session_id), exc)

    async def _run(self, request: GenerationRequest, record: SessionRecord, lease: Lease,
                   added: list[int], max_new: int, mode: SpeculationMode) -> AsyncIterator[Chunk]:
        started = time.perf_counter()
        run = _Run(record, GenerationStats(prompt_tokens=len(added)), PrefixHashes(record.token_ids))
        run.commit(added)
        record.requests += 1
        self._forget_other_replicas(record)
        await self.store.save(record, lease)
        spec = self.speculation.start(record.session_id, mode.proposer, mode.fixed_gamma)
        rng = RequestRng(request.seed)
        detok = IncrementalDetokenizer(self.tokenizer, record.token_ids)
        stops = StopStrings(request.stop)
        text, streamed, searched = "", 0, 0
        generated: list[int] = []
        finish: str | None = None
        ahead: asyncio.Task | None = None  # the next round, started while this one is stored
        try:
            while finish is None:
                if self.context_length - len(record.token_ids) <= 0:
                    finish = FINISH_CONTEXT
                    round_tokens: list[int] = []
                else:
                    this_round = ahead if ahead is not None else self._round(
                        run, spec, self._cap(record, generated, max_new), request.params, rng)
                    ahead = None  # awaited: done (its result or error taken) however the await ends
                    result = await this_round
                    round_tokens = []
                    for token in result.verdict.committed(result.drafts):
                        round_tokens.append(token)
                        generated.append(token)
                        if token in self.eos_ids and not request.ignore_eos:
                            finish = FINISH_EOS
                            break
                        text += detok.add(token)
                        hit = stops.find(text, searched)
                        if hit >= 0:
                            text, finish = text[:hit], FINISH_STOP
                            break
                        searched = len(text)
                        if len(generated) >= max_new:
                            finish = FINISH_LENGTH
                            break
                    run.commit(round_tokens)
                    if self.governor is not None:
                        self.governor.record(len(round_tokens))
                    record.draft_held = min(record.draft_held, len(record.token_ids))
                    record.target_held = min(record.target_held, len(record.token_ids))
                    run.stats.generated_tokens = len(generated)
                    self._observe_policy(spec, result)  # before the next round is planned
                    if result.ahead is not None:
                        self.ahead.record(record.session_id, self.active, result.ahead,
                                          result.verdict.num_accepted + 1, result.seconds)
                    store_started = time.perf_counter()
                    committed = dataclasses.replace(record)  # what the store must hold before the chunk goes
                    if (finish is None and self.overlap_store
                            and self.context_length - len(record.token_ids) > 0):
                        ahead = asyncio.ensure_future(self._round(
                            run, spec, self._cap(record, generated, max_new), request.params, rng))
                    await self._save_snapshot(record, committed, lease)  # an error cancels `ahead` (finally)
                    self._observe_metrics(result, store_started)
                if finish is None:
                    end = stops.safe_length(text)
                else:
                    if finish != FINISH_STOP:
                        text += detok.flush()  # the last characters may complete a stop string
                        hit = stops.find(text, searched)
                        if hit >= 0:
                            text, finish = text[:hit], FINISH_STOP
                    end = len(text)
                chunk = Chunk(record.session_id, text[streamed:end] if end > streamed else "", round_tokens)
                streamed = max(streamed, end)
                if finish is not None:
                    run.stats.coordinator_seconds = max(
                        0.0, time.perf_counter() - started - run.stats.draft_seconds - run.stats.target_seconds)
                    chunk.finish_reason, chunk.stats = finish, run.stats
                    record.stats = GenerationStats.from_dict(record.stats).merged(run.stats).to_dict()
                    await self.store.save(record, lease)
                yield chunk
        finally:
            self.ahead.forget(record.session_id)
            if ahead is not None:
                await _discard(ahead)

    def _cap(self, record: SessionRecord, generated: list[int], max_new: int) -> int:
        """The most tokens the next round may propose (the context has room for one more)."""
        base = len(record.token_ids)
        return max(0, min(self.max_gamma, max_new - len(generated) - 1, self.context_length - base - 1,
                          self.draft_info.max_context_length - base))

    async def _save_snapshot(self, record: SessionRecord, snapshot: SessionRecord, lease: Lease) -> None:
        """Store `snapshot`, a shallow copy of `record` taken when a round was committed: the
        round started meanwhile may move what the services hold (record.*_held, *_address)
        before the write completes, and the write is not affected. The token list is shared:
        committed tokens only grow in the loop, between writes, never during one."""
        await self.store.save(snapshot, lease)
        record.stored_len, record.updated_at = snapshot.stored_len, snapshot.updated_at

    def _forget_other_replicas(self, record: SessionRecord) -> None:
        """KV held by another replica (or none recorded) is worth nothing here."""
        self.routes.place(record)

    @staticmethod
    def _observe_policy(spec: RequestSpeculation, result: _RoundResult) -> None:
        """Feed a finished round to the request's policy."""
        proposed, accepted = len(result.drafts), result.verdict.num_accepted
        propose_s = None
        if result.source == DRAFT and result.propose_timed:
            propose_s = result.draft_seconds
        elif result.source == NGRAM:
            propose_s = result.plan.propose_seconds
        spec.observe(result.source, proposed, accepted, propose_seconds=propose_s,
                     verify_seconds=result.verify_seconds if result.verified_tokens else None,
                     verified_tokens=result.verified_tokens or proposed + 1, hints_kept=result.hints_kept,
                     batch_tokens=result.batch_tokens)

    def _observe_metrics(self, result: _RoundResult, store_started: float) -> None:
        """Record a committed and stored round in the metrics."""
        now = time.perf_counter()
        proposed, accepted = len(result.drafts), result.verdict.num_accepted
        stages = {"verify": result.verify_seconds, "store": now - store_started}
        if result.plan.source == DRAFT and not result.predrafted:  # the Propose call, answered or failed
            stages["draft"] = result.draft_seconds
        stages["coordinator"] = max(0.0, now - result.started - sum(stages.values()))
        self.metrics.record_round(result.source if proposed else NONE, proposed, accepted, stages)

    async def _round(self, run: _Run, spec: RequestSpeculation, cap: int, params: SamplingParams,
                     rng: RequestRng) -> _RoundResult:
        """One round: plan it (draft model, prompt lookup or none; γ at most `cap`), propose
        (prompt lookup makes no draft call; a failing draft makes the round target-only), one
        verification; updates the held lengths. What the draft holds stays as it was when a
        round does not call it: its next call sends what it lacks."""
        started = time.perf_counter()
        record, stats = run.record, run.stats
        base = len(record.token_ids)
        draft_seed, target_seed = rng.round_seeds()
        draft_up = self.routes.usable("draft")
        if not draft_up and spec.uses_draft:
            stats.fallback_rounds += 1
        spec.load = max(1, self.active)  # the generations whose rounds share the target's batches
        allowed = self.governor is None or self.governor.speculate(self.adaptive)
        plan = spec.plan(record.token_ids, cap, draft_up, allowed)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("session %s round: %s γ=%d (%s, est. speedup %.2f; α draft %s ngram %s; draft round "
                      "of 4 costs %.2f plain steps; load %d)", session_tag(record.session_id), plan.source,
                      plan.gamma, plan.reason, plan.speedup, _fmt(spec.policy.alpha(DRAFT)),
                      _fmt(spec.policy.ngram_alpha(spec.ngram.last_order)),
                      spec.policy.costs.relative_cost(DRAFT, 4, spec.load), spec.load)
        proposal, draft_s, propose_timed = Proposal([], []), 0.0, False
        predrafted = self._take_predrafted(run, base, plan, cap)
        if plan.source == NGRAM:
            proposal = Proposal(list(plan.tokens), one_hot_dists(plan.tokens))
        elif predrafted is not None:  # drafted while the last round was verified: no call now
            proposal = predrafted
            stats.draft_ahead_rounds += 1
        elif plan.source == DRAFT:
            lacking, misses = base - min(record.draft_held, base - 1), stats.cache_misses
            t0 = time.perf_counter()
            try:
                proposal = await self._propose(run, plan.gamma, params, draft_seed, plan.tokens,
                                               plan.min_confidence)
            except (Unavailable, ResourceExhausted, ServiceFault, InvalidArgument) as exc:
                self.routes.failed("draft", record.draft_address)  # its sessions move
                stats.fallback_rounds += 1
                log.warning("draft failed (%s); target-only round", exc)
            draft_s = time.perf_counter() - t0
            stats.draft_seconds += draft_s
            # a plain round sends the draft at most 2 tokens; more is a catch-up prefill
            propose_timed = lacking <= 2 and stats.cache_misses == misses
        drafts = proposal.draft_tokens
        source = plan.source if drafts else NONE
        prefetch = None
        if (plan.source != DRAFT and spec.uses_draft and draft_up and allowed and run.calls["draft"] == 0
                and base - record.draft_held > 2):  # (not while the governor holds plain decoding)
            prefetch = asyncio.ensure_future(self._prefetch_draft(run, params, draft_seed))
        ahead = None  # the draft going on past `drafts` for the next round, while they are verified
        ahead_mode = self._ahead_mode(spec) if source == DRAFT else None
        if ahead_mode == ON:
            ahead = self._draft_ahead(run, spec, base, drafts, proposal, plan, cap, params, rng)
            stats.draft_ahead_calls += ahead is not None
        lacking, misses = base - min(record.target_held, base - 1), stats.cache_misses
        t0 = time.perf_counter()
        own = len(drafts) + 1
        self.verifying_tokens += own
        batch_tokens = self.verifying_tokens  # this round's and the other generations' in flight
        try:
            verdict = await self._verify(run, drafts, proposal, params, target_seed)
        except BaseException:
            for task in (prefetch, ahead):
                if task is not None:
                    await _discard(task)
            raise
        finally:
            self.verifying_tokens -= own
        verify_s = time.perf_counter() - t0
        try:
            if prefetch is not None and await prefetch:
                record.draft_held = base
            stats.target_seconds += verify_s
            stats.record_round(len(drafts), verdict.num_accepted, source, proposal.hints_kept)
            if source == DRAFT:  # the draft fed d1..dγ-1; those the target accepted are committed
                record.draft_held = base + min(verdict.num_accepted, len(drafts) - 1)
            if ahead is not None and await self._keep_ahead(run, ahead, base, drafts, verdict):
                record.draft_held = base + len(drafts) + 1  # it fed dγ and the bonus (its guess) too
        finally:
            if ahead is not None and not ahead.done():  # cancelled meanwhile: no call left behind
                ahead.cancel()
        record.target_held = base + verdict.num_accepted
        # a plain round sends the target its one new token; more is a prefill or a resend
        verified = lacking + len(drafts) if lacking == 1 and stats.cache_misses == misses else 0
        return _RoundResult(plan, verdict, drafts, source, draft_s, verify_s, propose_timed, verified, started,
                            proposal.hints_kept, batch_tokens, predrafted is not None, ahead_mode,
                            time.perf_counter() - started)

    # ---- drafting ahead (--draft-ahead) --------------------------------------------------------

    def _ahead_mode(self, spec: RequestSpeculation) -> str | None:
        """Whether a draft round drafts ahead (on | off): as --draft-ahead on / off says, or as the
        measurement of `auto` says for requests whose rounds follow measured timings anyway
        (adaptive γ, costs measured). Under `auto` a request that fixes γ, or a coordinator that
        pins --draft-cost-ratio, keeps reproducible rounds: None (off, and not measured)."""
        if self.ahead.setting == "auto" and (spec.fixed_gamma is not None or self.config.draft_cost_ratio > 0):
            return None
        return self.ahead.mode(self.active)

    @staticmethod
    def _take_predrafted(run: _Run, base: int, plan: Plan, cap: int) -> Proposal | None:
        """The drafts made ahead for this round, cut to what the plan asks (None: there are none,
        they continue another history, or this round does not use the draft model). Each is
        still a draw from the q reported with it, made on the committed history: lossless."""
        predrafted, run.predrafted = run.predrafted, None
        if predrafted is None or predrafted.base != base or plan.source != DRAFT:
            return None
        limit = min(cap, plan.gamma + len(plan.tokens))
        drafts = predrafted.proposal
        if limit < 1:
            return None
        return Proposal(drafts.draft_tokens[:limit], drafts.draft_probs[:limit], drafts.cached_len)

    def _draft_ahead(self, run: _Run, spec: RequestSpeculation, base: int, drafts: list[int], proposal: Proposal,
                     plan: Plan, cap: int, params: SamplingParams, rng: RequestRng) -> asyncio.Future | None:
        """Ask the draft, while `drafts` are verified, to go on from them: its first token is its
        guess of the target's bonus token, the rest are the next round's drafts if the target
        accepts every draft and its bonus is that guess. Drawn with the next round's draft seed;
        this round's γ + 1 steps (a fixed γ: exactly), under adaptive γ fewer when the measured
        timings say they would outlast the verification (the next call would wait for them).
        None when the next round could not use it (no room, the draft holds something else)."""
        record, k = run.record, len(drafts)
        steps = min(max(plan.gamma, 1) + 1, self.draft_info.max_speculative_tokens)
        if spec.fixed_gamma is None:  # adaptive: no longer than the verification it hides behind
            costs = spec.policy.costs
            budget = costs.verify_seconds(k + 1, spec.load)
            within = None if budget is None else costs.steps_within(DRAFT, budget)
            if within is not None:
                steps = min(steps, max(2, within))  # (a guess and one draft at least)
        held = base + k - 1  # the draft holds the history and d1..dγ-1
        if (steps < 2 or proposal.cached_len < held
                or (cap < self.max_gamma and cap - k - 1 < 1)  # the next round proposes nothing
                or base + k + steps > min(self.context_length, self.draft_info.max_context_length)):
            return None
        address = record.draft_address
        try:
            client = self.routes.pick("draft", record)
        except Unavailable:
            return None
        if client.address != address:  # the session moved: that replica holds none of it
            return None
        prefix_hash = extend_hash(run.hashes.at(base), drafts[:k - 1])
        seed = rng.peek_round_seeds()[0]
        return asyncio.ensure_future(self._propose_ahead(
            client, record.session_id, held, prefix_hash, drafts[-1], steps, params, seed, plan.min_confidence))

    async def _propose_ahead(self, client, session_id: str, prefix_len: int, prefix_hash: int, token: int,
                             steps: int, params: SamplingParams, seed: int, min_confidence: float
                             ) -> Proposal | None:
        """The call made ahead; None when it fails (the next round then calls the draft as usual)."""
        try:
            return await client.propose(session_id, prefix_len, prefix_hash, [token], steps, params, seed,
                                        timeout_s=self.config.draft_timeout_s, min_confidence=min_confidence)
        except SpecdecError as exc:
            log.debug("session %s: the draft call made ahead failed (%s)", session_tag(session_id), exc)
            return None

    @staticmethod
    async def _keep_ahead(run: _Run, ahead: asyncio.Future, base: int, drafts: list[int],
                          verdict: Verdict) -> bool:
        """After verification: keep the drafts made ahead for the next round when the target took
        every draft and its bonus token is the draft's guess (True: the draft then holds the
        history up to that bonus); else drop the call."""
        if not (verdict.is_bonus and verdict.num_accepted == len(drafts)):
            await _discard(ahead)  # its work on the draft is wasted; the next call rolls it back
            return False
        proposal = await ahead
        if proposal is None or len(proposal.draft_tokens) < 2 or proposal.draft_tokens[0] != verdict.next_token:
            return False
        run.predrafted = _Predrafted(base + len(drafts) + 1, Proposal(
            proposal.draft_tokens[1:], proposal.draft_probs[1:], proposal.cached_len))
        return True

    async def _prefetch_draft(self, run: _Run, params: SamplingParams, seed: int) -> bool:
        """The first round of a request that does not use the draft still sends it the history
        it lacks (the prompt), alongside the verification: a later draft round then needs no
        long catch-up. True when the draft now holds the history (its one proposal is dropped)."""
        try:
            await self._propose(run, 1, params, seed)
            return True
        except (Unavailable, ResourceExhausted, ServiceFault, InvalidArgument) as exc:
            self.routes.failed("draft", run.record.draft_address)  # its sessions move
            log.warning("draft failed (%s); target-only round", exc)
            return False

    async def _propose(self, run: _Run, gamma: int, params: SamplingParams, seed: int,
                       hints: list[int] | None = None, min_confidence: float = 0.0) -> Proposal:
        sid = run.record.session_id
        return await self._with_resend(run, "draft", lambda draft, prefix, new_tokens: draft.propose(
            sid, prefix, run.hashes.at(prefix), new_tokens, gamma, params, seed,
            timeout_s=self.config.draft_timeout_s, hints=hints, min_confidence=min_confidence))

    async def _verify(self, run: _Run, drafts: list[int], proposal: Proposal, params: SamplingParams,
                      seed: int) -> Verdict:
        sid = run.record.session_id
        return await self._with_resend(run, "target", lambda target, prefix, new_tokens: target.verify(
            sid, prefix, run.hashes.at(prefix), new_tokens, drafts, proposal.draft_probs, params, seed,
            wait_for_ready=False),
            retry_s=self.config.target_retry_s)

    async def _with_resend(self, run: _Run, service: str, call, retry_s: float = 0.0):
        """call(client, prefix_len, new_tokens) with the session's replica and what it lacks. On a
        cache miss, again with the full history from prefix_len 0; while the service is unreachable,
        again for up to retry_s seconds, on the next replica when there is one (the same seeds: a
        retried round draws the same numbers)."""
        record = run.record
        held_attr = f"{service}_held"
        give_up_at: float | None = None
        backoff = 0.1
        while True:
            try:
                client = self.routes.pick(service, record)  # a session that moves holds nothing there
                # a service holding every committed token still needs one to run: resend the last
                prefix = min(getattr(record, held_attr), len(record.token_ids) - 1)
                new_tokens = record.token_ids[prefix:]
                result = await call(client, prefix, new_tokens)
            except CacheMiss as miss:
                self._after_miss(run, miss, prefix, service)
                setattr(record, held_attr, 0)
                continue
            except Unavailable:
                self.routes.failed(service, getattr(record, f"{service}_address"))
                now = time.monotonic()
                give_up_at = now + retry_s if give_up_at is None else give_up_at
                if now >= give_up_at:
                    raise
                run.stats.target_retries += service == "target"
                if not self.routes.usable(service):  # else at once, on the next replica
                    await asyncio.sleep(min(backoff, give_up_at - now))
                    backoff = min(backoff * 2, 1.0)
                continue
            if run.calls[service] == 0 or prefix == 0:  # what the service had to prefill
                prefill_attr = f"{service}_prefill_tokens"
                setattr(run.stats, prefill_attr, getattr(run.stats, prefill_attr) + len(new_tokens))
            run.calls[service] += 1
            return result

    @staticmethod
    def _after_miss(run: _Run, miss: CacheMiss, prefix: int, service: str) -> None:
        if prefix == 0:
            raise FailedPrecondition(f"{service} service reported a cache miss at prefix_len 0: {miss}")
        run.stats.cache_misses += 1
        log.info("%s cache miss for session %s (held %d, assumed %d): resending history",
                 service, session_tag(run.record.session_id), miss.held, prefix)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


async def _discard(task: asyncio.Future) -> None:
    """Cancel work whose result is no longer wanted and wait until it has ended (its error, if
    any, is dropped: the request already ends for its own reason)."""
    task.cancel()
    await asyncio.wait([task])
    if not task.cancelled():
        task.exception()  # retrieved: not logged as never retrieved
