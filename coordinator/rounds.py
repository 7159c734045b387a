"""What a request and its rounds carry: the request's running state, one round as planned, the
drafts a source proposed for it, what it produced, and the chunks streamed to the client."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from specdec.fingerprint import PrefixHashes
from specdec.maths.tree import TokenTree
from specdec.rng import RequestRng, RoundSeeds
from specdec.types import DraftAhead, Proposal, Source, SamplingParams, TokenLogprobs, Verdict

from coordinator.policy.speculation import Plan, RequestSpeculation
from coordinator.stats import GenerationStats
from coordinator.sessions.session_store import SessionRecord
from coordinator.sessions.model_tiers import Tier

NO_PROPOSAL = Proposal([], [])


class FinishReason(StrEnum):
    EOS = "eos"                  # the target emitted an end-of-sequence token
    LENGTH = "length"            # max_new_tokens reached
    STOP = "stop"                # a stop string appeared (it is not streamed)
    CONTEXT = "context_length"   # the model context is full


@dataclass
class TokenTimes:
    """When a generation arrived and streamed its tokens: its time to first token and time per
    output token (as vLLM's benchmark_serving defines them), for the metrics."""

    arrived: float              # time.perf_counter() when the request arrived
    first: float | None = None  # ... when its first token left
    last: float | None = None   # ... when its latest token left
    tokens: int = 0             # tokens streamed so far

    def streamed(self, tokens: int, now: float) -> float | None:
        """`tokens` more tokens left at `now`: the time to first token when they are the first."""
        if not tokens:
            return None
        first = self.first is None
        if first:
            self.first = now
        self.last, self.tokens = now, self.tokens + tokens
        return now - self.arrived if first else None

    def per_output_token(self) -> float | None:
        """(last token's time - first token's) / (tokens - 1); None with fewer than 2 tokens."""
        if self.tokens < 2 or self.first is None or self.last is None:
            return None
        return (self.last - self.first) / (self.tokens - 1)


@dataclass(frozen=True)
class Predrafted:
    """Drafts a call made ahead proposed for the round that starts with `base` committed tokens."""

    base: int           # committed tokens the round they are for starts with
    proposal: Proposal  # the drafts and the q each was drawn from


@dataclass
class DraftBackoff:
    """The rounds a request skips the draft model after its calls timed out: the replica is alive
    but slow (a busy machine, a long prefill), so the request tries it again a few rounds later —
    1 round after a timeout, then twice as many after each further timeout in a row — instead of
    giving it up for the rest of the request. A call that answers ends the streak."""

    streak: int = 0      # draft calls in a row that timed out
    resume_at: int = 0   # the first round (numbered from 0 in the request) that may call the draft

    def ready(self, round_index: int) -> bool:
        """Whether round `round_index` may call the draft."""
        return round_index >= self.resume_at

    def timed_out(self, round_index: int) -> int:
        """A draft call of round `round_index` timed out: the rounds skipped now."""
        self.streak += 1
        skipped = 2 ** (self.streak - 1)
        self.resume_at = round_index + 1 + skipped
        return skipped

    def answered(self) -> None:
        self.streak = 0


@dataclass
class RequestRun:
    """State of one request while it runs."""

    record: SessionRecord  # the session as this request has it (committed tokens, placements)
    stats: GenerationStats  # this request's counters
    hashes: PrefixHashes = field(default_factory=PrefixHashes)  # fingerprints of record.token_ids' prefixes
    calls: dict[Tier, int] = field(default_factory=lambda: {tier: 0 for tier in Tier})  # answered calls per tier
    predrafted: Predrafted | None = None  # drafted ahead for the next round (--draft-ahead)
    cache_salt: str = ""  # the request's: mixed into the services' K/V chunk keys
    top_logprobs: int | None = None  # the request's: None, or the alternatives per token the target returns
    draft_backoff: DraftBackoff = field(default_factory=DraftBackoff)  # rounds without the draft after timeouts
    recording: Any = None  # coordinator/recording.py's buffer of this request (None: not begun; False: not recorded)

    def commit(self, tokens: list[int]) -> None:
        self.record.token_ids.extend(tokens)
        self.hashes.extend(tokens)


@dataclass
class Round:
    """One round as planned: what the sources and the verification work from."""

    run: RequestRun
    spec: RequestSpeculation  # the request's planner and policy
    plan: Plan                # the source and γ chosen for this round
    base: int                 # committed tokens when the round began
    cap: int                  # the most tokens it may propose
    params: SamplingParams
    rng: RequestRng
    seeds: RoundSeeds         # this round's seeds: the draft's, the target's, a call made ahead's
    draft_up: bool            # a draft replica was usable when it was planned
    allowed: bool             # the load governor lets adaptive requests speculate now
    started: float            # time.perf_counter() when it began
    ahead: DraftAhead | None = None  # a draft round's --draft-ahead mode (None: not the trial's)
    head_candidates: int = 0  # the heads' candidates its Verify asks for, for the next round (0: none)


@dataclass
class Drafts:
    """What a source proposed for a round."""

    proposal: Proposal = NO_PROPOSAL       # the tokens and the q each was drawn from
    source: Source = Source.NONE        # who proposed them: NONE when there are none
    propose_seconds: float | None = None    # what proposing took, where it prices the source
    #                                         (None: not a plain round, e.g. a catch-up prefill)
    call_seconds: float | None = None       # the draft call on the round's critical path (None: none)
    lookup_nodes: int = 0                   # a draft tree's last nodes that are prompt lookup's branches
    caught_up: int = 0                      # history tokens the draft call prefilled before it proposed
    #                                         (a catch-up; call_seconds holds both)


@dataclass
class RoundResult:
    """What one round did, for the commit, the stats, the policy and the metrics."""

    plan: Plan
    verdict: Verdict
    drafts: list[int]                  # the proposed tokens the target verified
    source: Source                   # who proposed them: NONE when nobody did (or the draft failed)
    propose_seconds: float | None      # what proposing took, where it prices the source
    call_seconds: float | None         # the draft call on the round's critical path (None: none)
    verify_seconds: float              # the Verify call
    verified_tokens: int               # tokens the Verify forward took (0 when it was not a plain round)
    started: float                     # time.perf_counter() when the round began
    hints_kept: int = 0                # leading drafts that are prompt-lookup hints the draft model kept
    batch_tokens: int = 0              # tokens verified across this coordinator's generations meanwhile
    ahead: DraftAhead | None = None    # a draft round's --draft-ahead mode (None: not the trial's)
    seconds: float = 0.0               # the round's own time: plan, propose, verify (not the store write)
    parents: tuple[int, ...] = ()      # the drafts as a tree (as on the wire); (): a chain
    lookup_nodes: int = 0              # the tree's last nodes that are prompt lookup's grafted branches
    base: int = 0                      # committed tokens when the round began
    caught_up: int = 0                 # history tokens the draft call prefilled first (Drafts.caught_up)

    @property
    def tree(self) -> TokenTree | None:
        """The drafts as a tree (None: a chain)."""
        return TokenTree(tuple(self.drafts), self.parents) if self.parents else None


@dataclass
class Chunk:
    """One streamed piece: new text and tokens; the last one has finish_reason and stats."""

    session_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stats: GenerationStats | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per token of token_ids, when asked for
