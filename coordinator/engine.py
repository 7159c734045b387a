"""The speculation loop: propose, verify, commit, stream."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from specdec.config import CoordinatorConfig
from specdec.errors import (
    CacheMiss, FailedPrecondition, InvalidArgument, ResourceExhausted, ServiceFault, SpecdecError,
    Unavailable,
)
from specdec.fingerprint import PrefixHashes
from specdec.logtag import session_tag
from specdec.rng import RequestRng
from specdec.types import ModelDescription, Proposal, SamplingParams, Verdict

from coordinator.chat import render_messages
from coordinator.clients import release_quietly
from coordinator.detokenizer import IncrementalDetokenizer, StopStrings
from coordinator.lease_keeper import LeaseKeeper
from coordinator.routing import Routes
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


@dataclass
class Chunk:
    """One streamed piece: new text and tokens; the last one has finish_reason and stats."""

    session_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stats: GenerationStats | None = None


@dataclass
class _Run:
    """State of one request while it runs."""

    record: SessionRecord
    stats: GenerationStats
    hashes: PrefixHashes = field(default_factory=PrefixHashes)  # fingerprints of record.token_ids' prefixes
    calls: dict[str, int] = field(default_factory=lambda: {"draft": 0, "target": 0})

    def commit(self, tokens: list[int]) -> None:
        self.record.token_ids.extend(tokens)
        self.hashes.extend(tokens)


class Engine:
    def __init__(self, config: CoordinatorConfig, store: SessionStore, routes: Routes, tokenizer: Any,
                 draft_info: ModelDescription, target_info: ModelDescription):
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

    # ---- validation -------------------------------------------------------------------------

    def _limits(self, request: GenerationRequest) -> tuple[int, int]:
        """(max_new_tokens, γ) after defaults, validated."""
        request.params.validate()
        max_new = request.max_new_tokens
        if max_new is None:
            max_new = self.config.default_max_new_tokens
        if not 1 <= max_new <= self.config.max_new_tokens_limit:
            raise InvalidArgument(
                f"max_new_tokens must be in [1, {self.config.max_new_tokens_limit}], got {max_new}")
        gamma = request.num_speculative_tokens
        if gamma is None:
            gamma = min(self.config.default_num_speculative_tokens, self.max_gamma)
        if not 0 <= gamma <= self.max_gamma:
            raise InvalidArgument(
                f"num_speculative_tokens must be in [0, {self.max_gamma}] (0 disables speculation), "
                f"got {gamma}")
        if len(request.stop) > MAX_STOP_STRINGS:
            raise InvalidArgument(f"at most {MAX_STOP_STRINGS} stop strings, got {len(request.stop)}")
        return max_new, gamma

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
        max_new, gamma = self._limits(request)
        if self.active >= self.config.max_concurrent_generations:
            raise ResourceExhausted(
                f"{self.active} generations are running, the limit of this coordinator "
                "(--max-concurrent-generations); retry in a second", retry_after_s=1.0)
        self.active += 1
        try:
            lease, added = await self._open(request)
            record = lease.record
            finished = False
            try:
                # renewed on a timer, whatever a round takes; lost (taken over) stops the request
                async with LeaseKeeper(self.store, lease, self.config.session_lease_s / 3) as keeper:
                    async for chunk in self._run(request, record, lease, added, max_new, gamma):
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

    async def _abandon(self, record: SessionRecord, lease: Lease) -> None:
        """Free the KV caches a request leaves behind; its committed tokens stay in the store."""
        await self.routes.release(record)
        record.draft_held = record.target_held = 0
        try:
            await self.store.save(record, lease)
        except SpecdecError as exc:
            log.info("session %s: could not record the released caches (%s)", session_tag(record.session_id), exc)

    async def _run(self, request: GenerationRequest, record: SessionRecord, lease: Lease,
                   added: list[int], max_new: int, gamma: int) -> AsyncIterator[Chunk]:
        started = time.perf_counter()
        run = _Run(record, GenerationStats(prompt_tokens=len(added)), PrefixHashes(record.token_ids))
        run.commit(added)
        record.requests += 1
        self._forget_other_replicas(record)
        await self.store.save(record, lease)
        rng = RequestRng(request.seed)
        detok = IncrementalDetokenizer(self.tokenizer, record.token_ids)
        stops = StopStrings(request.stop)
        text, streamed, searched = "", 0, 0
        generated: list[int] = []
        finish: str | None = None
        while finish is None:
            base = len(record.token_ids)
            room = self.context_length - base
            if room <= 0:
                finish = FINISH_CONTEXT
                round_tokens: list[int] = []
            else:
                g = max(0, min(gamma, max_new - len(generated) - 1, room - 1,
                               self.draft_info.max_context_length - base))
                verdict, drafts = await self._round(run, g, request.params, rng)
                round_tokens = []
                for token in verdict.committed(drafts):
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
                record.draft_held = min(record.draft_held, len(record.token_ids))
                record.target_held = min(record.target_held, len(record.token_ids))
                run.stats.generated_tokens = len(generated)
                await self.store.save(record, lease)
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

    def _forget_other_replicas(self, record: SessionRecord) -> None:
        """KV held by another replica (or none recorded) is worth nothing here."""
        self.routes.place(record)

    async def _round(self, run: _Run, gamma: int, params: SamplingParams,
                     rng: RequestRng) -> tuple[Verdict, list[int]]:
        """One round: γ drafts (none when γ is 0 or the draft is failing), one verification;
        updates the held lengths."""
        record, stats = run.record, run.stats
        base = len(record.token_ids)
        draft_seed, target_seed = rng.round_seeds()
        proposal = Proposal([], [])
        if gamma > 0 and not self.routes.usable("draft"):
            stats.fallback_rounds += 1
        elif gamma > 0:
            t0 = time.perf_counter()
            try:
                proposal = await self._propose(run, gamma, params, draft_seed)
            except (Unavailable, ResourceExhausted, ServiceFault, InvalidArgument) as exc:
                self.routes.failed("draft", record.draft_address)  # its sessions move
                stats.fallback_rounds += 1
                log.warning("draft failed (%s); target-only round", exc)
            stats.draft_seconds += time.perf_counter() - t0
        drafts = proposal.draft_tokens
        t0 = time.perf_counter()
        verdict = await self._verify(run, drafts, proposal, params, target_seed)
        stats.target_seconds += time.perf_counter() - t0
        stats.record_round(len(drafts), verdict.num_accepted)
        if drafts:  # the draft fed d1..dγ-1; those the target accepted are committed
            record.draft_held = base + min(verdict.num_accepted, len(drafts) - 1)
        record.target_held = base + verdict.num_accepted
        return verdict, drafts

    async def _propose(self, run: _Run, gamma: int, params: SamplingParams, seed: int) -> Proposal:
        sid = run.record.session_id
        return await self._with_resend(run, "draft", lambda draft, prefix, new_tokens: draft.propose(
            sid, prefix, run.hashes.at(prefix), new_tokens, gamma, params, seed,
            timeout_s=self.config.draft_timeout_s))

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
