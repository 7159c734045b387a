"""Each round's plan: which source proposes (draft model, prompt lookup, the target's heads, none)
and how many tokens.

`Speculation` is one per coordinator: the round-cost model and the acceptance per source over
all sessions (a new session starts from it instead of warming up each source) and, per session
in a bounded LRU, a `SessionPolicy`. `Speculation.start(...)` gives a request its
`RequestSpeculation`, which holds the request's override (its source, fixed γ).

The planner only chooses: the round loop asks the sources once what they offer the round
(`Offers`: prompt lookup's `Lookup`, the draft's lag, the heads at hand), then
``plan = spec.plan(offers, cap, tokens_left)``. A prompt-lookup plan carries the tokens it chose;
under `auto` a draft-model plan carries them as hints, and an adaptive one `min_confidence` (γ
is a ceiling); a draft plan may carry `tree_nodes` (the request's, or under --trees auto the
policy's: `auto_tree_budget`), a heads plan its tree's depth and size. After verification
``spec.observe(source, proposed, accepted, ...)`` feeds acceptance and timings back (a tree's
spine and alternatives; a heads round's α per depth and b, per `heads_id` over all sessions).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Callable

from specdec.maths.tree import TokenTree, TreeOutcome, tree_outcome
from specdec.types import Source, Trees

from coordinator.policy.estimates import AcceptanceEstimate, CostModel
from coordinator.policy.heads_estimates import DepthAcceptance, HeadsAtHand, SessionHeads
from coordinator.policy.session_policy import NO_HORIZON, Horizon, PolicyConfig, ProbeClock, SessionPolicy

log = logging.getLogger(__name__)

MAX_POLICIES = 4096  # sessions whose acceptance estimates a coordinator remembers (LRU)
PRIOR_DECAY = 0.98   # the coordinator-wide α per source forgets this slowly (per observed round)
PRIOR_WEIGHT = 3.0   # a new session starts from that α worth this many trials
LOOKUP_BRANCHES = 3  # a tree round grafts on what followed up to this many earlier occurrences
MAX_DRAFT_MODELS = 8  # draft models (fingerprints) whose estimates a coordinator keeps (LRU)
MAX_HEADS = 8  # sets of heads (heads_id) whose estimates a coordinator keeps (LRU)


class FixedCosts(CostModel):
    """Leviathan's cost model with a given c: a round of γ draft tokens costs 1 + c·γ
    plain-decode steps, prompt lookup and verification nothing extra. Timings are ignored,
    so the choices depend only on acceptance (reproducible)."""

    def __init__(self, cost_ratio: float) -> None:
        super().__init__()
        self.cost_ratio = cost_ratio

    def relative_costs(self, source: Source, max_gamma: int, load: int = 1) -> list[float]:
        c = self.cost_ratio if source == Source.DRAFT else 0.0
        return [1.0 + c * gamma for gamma in range(max_gamma + 1)]

    def relative_tree_cost(self, depth: int, nodes: int, load: int = 1) -> float:
        return 1.0 + self.cost_ratio * depth  # a draft forward per depth; verification flat

    def relative_heads_cost(self, nodes: int, load: int = 1) -> float:
        return 1.0  # no proposal call; verification flat

    def relative_catch_up(self, tokens: int, load: int = 1) -> float:
        return 0.0  # switching sources is free


@dataclass(frozen=True)
class Lookup:
    """What prompt lookup found in the session's tokens for a round, for the planner to choose from."""

    tokens: list[int] = field(default_factory=list)  # what followed the suffix's latest earlier
    #                                                  occurrence, at most the round's cap ([]: no match)
    order: int = 0                                    # the length of the suffix that matched (0: none)
    seconds: float = 0.0                              # what looking up took
    # (γ, occurrences) -> γ tokens after each of the latest earlier occurrences, distinct, the latest first
    continuations: Callable[[int, int], list[list[int]]] = lambda gamma, occurrences: []


NO_LOOKUP = Lookup()  # the round does not look up (its request does not use prompt lookup)


@dataclass(frozen=True)
class Offers:
    """What each source offers a round, gathered once before it is planned (RoundLoop._offers)."""

    lookup: Lookup = NO_LOOKUP        # prompt lookup's match and its length (NO_LOOKUP: not looked up)
    draft_available: bool = True      # the draft tier answers (False: failing, or backed off after a timeout)
    draft_lag: int = 0                # history tokens the draft must prefill before it proposes (0: none)
    heads: HeadsAtHand | None = None  # the target's heads' proposals the round before read (None: none)
    heads_served: HeadsAtHand | None = None  # what a round of the heads could be, where the session's
    #                                          target serves them (None: no heads)


@dataclass(frozen=True)
class Plan:
    """One round: `gamma` tokens from `source`; `tokens` are prompt lookup's."""

    source: Source            # DRAFT | PROMPT_LOOKUP | HEADS | NONE
    gamma: int                  # tokens to propose (draft: its steps; kept hints come on top; heads: the depth)
    tokens: list[int] = field(default_factory=list)  # prompt lookup: the proposal; draft: the hints
    reason: str = ""
    propose_seconds: float = 0.0  # what planning the tokens took (prompt lookup)
    speedup: float = 1.0        # the policy's estimated speedup of this round over plain decoding
    min_confidence: float = 0.0  # draft: stop after a token it gave less probability (0 = exactly γ)
    tree_nodes: int = 0         # draft: grow a tree of this many nodes, γ deep (0: a chain); heads: the tree's size
    branches: list[list[int]] = field(default_factory=list)  # a draft tree: prompt lookup's continuations
    #                                                           to graft on (the latest occurrence's first)
    read_heads: bool = False    # the round's Verify reads the target's heads for the next round


def auto_tree_budget(trees: Trees, requested: int, fixed_gamma: int | None, pair_grows_trees: bool,
                     max_nodes: int) -> int:
    """The most nodes the policy may give an adaptive draft round's tree (0: chains only): the
    coordinator's --trees auto, a draft that grows trees and a target that verifies them, a
    request that leaves tree_nodes unset (0; 1 asks for chains, 2+ for trees of that size) and
    γ adaptive (a fixed γ stays a chain unless the request asks for a tree)."""
    if trees != Trees.AUTO or requested != 0 or fixed_gamma is not None or not pair_grows_trees:
        return 0
    return max_nodes


def is_governed(mode: Source, fixed_gamma: int | None) -> bool:
    """Whether a request is adaptive `auto` (neither source nor γ fixed): the load governor may
    switch it to plain decoding, and its draft rounds carry prompt lookup's hints."""
    return mode == Source.AUTO and fixed_gamma is None


class RequestSpeculation:
    """One request's planner: its override and the session's policy."""

    def __init__(self, policy: SessionPolicy, mode: Source,
                 fixed_gamma: int | None, priors: dict[Source, AcceptanceEstimate] | None = None,
                 draft_hints: bool = True, order_priors: dict[int, AcceptanceEstimate] | None = None,
                 min_confidence: float = 0.0, tree_nodes: int = 0, max_tree_nodes: int = 0) -> None:
        mode = Source(mode)  # ValueError for anything else
        self.policy, self.mode, self.fixed_gamma = policy, mode, fixed_gamma
        self.priors = priors if priors is not None else {}
        self.governed = is_governed(mode, fixed_gamma)
        self.draft_hints = draft_hints and self.governed  # a fixed γ is γ tokens
        self.min_confidence = min_confidence if fixed_gamma is None else 0.0  # likewise
        # prompt lookup's α per match length over all sessions (fed here, read by new sessions)
        self.order_priors = order_priors if order_priors is not None else {}
        self._order = 0  # the match length of the planned prompt-lookup round
        self._horizon = NO_HORIZON  # the planned round's switching costs (adaptive requests only)
        self.load = 1  # generations sharing the target (set by the round loop before each plan)
        self.tree_nodes = tree_nodes if tree_nodes > 1 else 0  # every draft round a tree of this many nodes
        self.max_tree_nodes = 0 if self.tree_nodes else max_tree_nodes  # or the policy's, up to this many
        self.draft_model = policy.draft_model  # the draft model (fingerprint) its estimates are of

    @property
    def uses_draft(self) -> bool:
        """Whether this request may call the draft model at all."""
        return self.mode in (Source.AUTO, Source.DRAFT) and self.fixed_gamma != 0

    @property
    def uses_heads(self) -> bool:
        """Whether this request's rounds may propose the target's heads' tokens (so its Verify
        calls ask for them)."""
        return self.mode in (Source.AUTO, Source.HEADS) and self.fixed_gamma != 0

    def looks_up(self, cap: int, allowed: bool = True) -> bool:
        """Whether the next round's plan would use what prompt lookup finds (else it need not look)."""
        return ((allowed or not self.governed) and self.mode in (Source.AUTO, Source.PROMPT_LOOKUP)
                and cap > 0 and self.fixed_gamma != 0)

    def plan(self, offers: Offers, cap: int, tokens_left: int = 0, allowed: bool = True) -> Plan:
        """The next round's source and γ (≤ `cap`: tokens left, context room, limits) from what the
        sources offer it, and whether its Verify reads the heads for the next round. An adaptive
        request weighs switching sources over the `tokens_left` it may still commit (0: unknown);
        a fixed source or γ gets what it asked for. allowed=False: speculation does not pay under
        the current load (load_governor.py): an adaptive request decodes plainly."""
        plan = self._choose(offers, cap, tokens_left, allowed)
        served = offers.heads_served
        return replace(plan, read_heads=served is not None and self.policy.wants_heads(
            self.mode, served, cap, self.load))

    def _choose(self, offers: Offers, cap: int, tokens_left: int, allowed: bool) -> Plan:
        if not allowed and self.governed:
            return Plan(Source.NONE, 0, [], "load")
        t0 = time.perf_counter()
        lookup, heads = offers.lookup, offers.heads
        candidates = lookup.tokens[:cap] if self.looks_up(cap) else []
        self._order = lookup.order if candidates else 0
        self._horizon = (Horizon(tokens_left, offers.draft_lag, offers.heads_served if heads is None else None)
                         if self.governed else NO_HORIZON)
        choice = self.policy.choose(max_gamma=cap, lookup_available=len(candidates),
                                    draft_available=offers.draft_available, mode=self.mode,
                                    fixed_gamma=self.fixed_gamma, lookup_order=self._order, load=self.load,
                                    max_tree_nodes=self.max_tree_nodes, heads=heads if self.uses_heads else None,
                                    horizon=self._horizon)
        if choice.source == Source.PROMPT_LOOKUP:
            return Plan(Source.PROMPT_LOOKUP, choice.gamma, candidates[:choice.gamma], choice.reason,
                        lookup.seconds + time.perf_counter() - t0, choice.speedup)
        if choice.source == Source.HEADS:
            return Plan(Source.HEADS, choice.gamma, [], choice.reason, speedup=choice.speedup,
                        tree_nodes=choice.tree_nodes)
        if choice.source == Source.DRAFT:
            tree_nodes = self.tree_nodes or choice.tree_nodes
            if tree_nodes:  # hints and the early stop go with chains; lookup's tokens as branches
                # the room left (cap) bounds a tree by its depth: γ ≤ cap, and every branch is cut
                # to lookup's candidates (≤ cap); its nodes, by the services' limit only
                gamma = (self.policy.lookup_gamma(len(candidates), self._order, self.load)
                         if candidates and self.governed else 0)  # a fixed γ: the tree asked for
                branches = lookup.continuations(gamma, LOOKUP_BRANCHES) if gamma else []
                return Plan(Source.DRAFT, choice.gamma, [], choice.reason, speedup=choice.speedup,
                            tree_nodes=tree_nodes, branches=branches)
            hints = candidates[:max(0, cap - choice.gamma)] if self.draft_hints else []
            return Plan(Source.DRAFT, choice.gamma, hints, choice.reason, speedup=choice.speedup,
                        min_confidence=self.min_confidence)
        return Plan(choice.source, choice.gamma, [], choice.reason, speedup=choice.speedup)

    def describe(self, plan: Plan) -> str:
        """A round's plan with the estimates behind it, for the debug log."""
        alpha, lookup_alpha = self.policy.alpha(Source.DRAFT), self.policy.lookup_alpha(self._order)
        shape = f" tree of {plan.tree_nodes}" if plan.tree_nodes else ""
        draft_round, catch_up = self.policy.draft_costs(4, self._horizon.draft_lag, self.load)
        return (f"{plan.source} γ={plan.gamma}{shape} ({plan.reason}, est. speedup {plan.speedup:.2f}; α draft "
                f"{_fmt(alpha)} prompt lookup {_fmt(lookup_alpha)}; draft round of 4 costs "
                f"{draft_round:.2f} plain steps; load {self.load}; "
                f"{self._horizon.tokens_left} tokens left, the draft lacks {self._horizon.draft_lag} "
                f"({catch_up:.2f} plain steps))")

    def draft_steps_within_verify(self, verified_tokens: int) -> int | None:
        """Draft steps no longer than verifying `verified_tokens` now (None: not measured yet)."""
        return self.policy.draft_steps_within_verify(verified_tokens, self.load)

    def observe_catch_up(self, tokens: int, gamma: int, call_seconds: float) -> None:
        """A draft call that first prefilled `tokens` of history it lacked took `call_seconds`."""
        self.policy.observe_catch_up(tokens, gamma, call_seconds)

    def observe(self, source: Source, proposed: int, accepted: int, *,
                propose_seconds: float | None, verify_seconds: float | None,
                verified_tokens: int, hints_kept: int = 0, batch_tokens: int | None = None,
                tree: TokenTree | None = None, accepted_nodes: tuple[int, ...] = (),
                lookup_nodes: int = 0) -> None:
        """After a round: `source` proposed `proposed` tokens (0 when it fell back to plain
        decoding), `accepted` of them kept; a draft round's first `hints_kept` were hints it
        kept. A time of None leaves the round out of the timings (a catch-up prefill, a resend
        after a cache miss).

        The draft's α and step cost are about its own tokens: the kept hints are left out of
        both (its own tokens were tried only when the target accepted every kept hint). A tree
        (`tree`, the target's `accepted_nodes`) counts as the chain of its spine for α, its time
        goes to the tree rounds' own fit of the draft (one forward per depth, each carrying
        several nodes), and its alternatives beside the spine node the target rejected measure b
        (policy.branch_alpha); its last `lookup_nodes` nodes, prompt lookup's grafted branches,
        are neither. A heads round (its tree or chain) feeds α per depth and b of the heads
        (heads_estimates.py), and its spine the heads' overall α."""
        if source == Source.HEADS and proposed:
            outcome = (tree_outcome(tree, accepted_nodes) if tree is not None
                       else TreeOutcome(proposed, accepted, 0, 0))
            self.policy.observe_heads(outcome)
            proposed, accepted, tree = outcome.spine_proposed, outcome.spine_accepted, None
        if tree is not None and proposed:
            outcome = tree_outcome(tree, accepted_nodes, len(tree) - lookup_nodes)
            self.policy.observe_branches(outcome.alternatives_tried, outcome.alternatives_accepted)
            proposed, accepted = outcome.spine_proposed, outcome.spine_accepted
        if proposed == 0:
            source = Source.NONE
        own, own_accepted = proposed - hints_kept, accepted - hints_kept
        tried = own_accepted >= 0
        order = self._order if source == Source.PROMPT_LOOKUP else 0
        self.policy.observe(source, own, max(own_accepted, 0), propose_seconds=propose_seconds,
                            verify_seconds=verify_seconds, verified_tokens=verified_tokens, trials=tried,
                            lookup_order=order, batch_tokens=batch_tokens,
                            tree=tree is not None and proposed > 0)
        if source in self.priors and tried:
            self.priors[source].observe(own, own_accepted)
        if order and own:
            self.order_priors.setdefault(order, AcceptanceEstimate(PRIOR_DECAY)).observe(own, own_accepted)


@dataclass
class DraftEstimates:
    """What the coordinator learnt of one draft model (one fingerprint) over all sessions."""

    costs: CostModel                # its step times; the verify fit is shared with other models'
    acceptance: AcceptanceEstimate  # its α: a new session starts from it
    branch: AcceptanceEstimate      # trees: b, an alternative's acceptance
    probe_clock: ProbeClock         # when it is probed next, over the sessions seeded from its α


class Speculation:
    """One per coordinator: the shared round costs and the sessions' policies.

    The draft's estimates (α, b, its step costs, its probe clock) belong to a draft model, so
    they are kept per model fingerprint (`DraftEstimates`, the most recent MAX_DRAFT_MODELS): a
    request runs on those of the model its draft replica serves, and a session whose replica
    serves another model than the one its policy learnt on forgets what it learnt of the draft.
    A distilled draft rolled out is judged on its own rounds, never on its predecessor's, and
    while old and new replicas both serve (a rolling update) neither's estimates are reset by the
    other's. `priors`, `branch`, `draft_probe_clock` and `costs` are the newest model's."""

    def __init__(self, max_gamma: int, default_gamma: int, cost_ratio: float = 0.0, max_sessions: int = MAX_POLICIES, draft_hints: bool = True,
                 min_confidence: float = 0.0, trees: Trees = Trees.OFF, draft_model: str = "") -> None:
        if cost_ratio < 0:
            raise ValueError(f"draft cost ratio must be >= 0 (0 = measure), got {cost_ratio}")
        if not 0.0 <= min_confidence < 1.0:
            raise ValueError(f"draft min confidence must be in [0, 1) (0 = off), got {min_confidence}")
        self.config = PolicyConfig(max_gamma=max_gamma, default_gamma=max(1, min(default_gamma, max_gamma)),
                                   probe_gamma=max(1, min(2, max_gamma)))
        costs = FixedCosts(cost_ratio) if cost_ratio > 0 else CostModel(
            self.config.timing_decay, self.config.default_cost_ratio)
        self.max_sessions, self.draft_hints, self.min_confidence = max_sessions, draft_hints, min_confidence
        self._policies: OrderedDict[str, SessionPolicy] = OrderedDict()
        # prompt lookup's α over all sessions: a new session starts from it instead of warming up
        self.lookup_prior = AcceptanceEstimate(PRIOR_DECAY)
        self.order_priors: dict[int, AcceptanceEstimate] = {}  # prompt lookup's, per match length
        self.trees = Trees(trees)  # --trees: whether adaptive draft rounds may propose trees
        self.draft_model = draft_model  # the newest draft model seen (its fingerprint)
        self._drafts: OrderedDict[str, DraftEstimates] = OrderedDict(
            [(draft_model, self._fresh(costs))])
        # the target's heads, per heads_id over all sessions: α per depth and b (heads_estimates.py)
        self._heads: OrderedDict[str, DepthAcceptance] = OrderedDict()

    def _fresh(self, costs: CostModel) -> DraftEstimates:
        return DraftEstimates(costs, AcceptanceEstimate(PRIOR_DECAY), AcceptanceEstimate(PRIOR_DECAY),
                              ProbeClock(self.config.probe_interval))

    # the newest draft model's estimates
    @property
    def current(self) -> DraftEstimates:
        return self._drafts[self.draft_model]

    @property
    def costs(self) -> CostModel:
        return self.current.costs

    @costs.setter
    def costs(self, costs: CostModel) -> None:
        self.current.costs = costs

    @property
    def priors(self) -> dict[Source, AcceptanceEstimate]:
        """α per source over all sessions (the draft's: of the newest draft model)."""
        return {Source.DRAFT: self.current.acceptance, Source.PROMPT_LOOKUP: self.lookup_prior}

    @property
    def branch(self) -> AcceptanceEstimate:
        return self.current.branch

    @property
    def draft_probe_clock(self) -> ProbeClock:
        return self.current.probe_clock

    def estimates(self, draft_model: str | None = None) -> DraftEstimates:
        """The estimates of a draft model (None: the newest), fresh ones for a model not seen:
        its step costs measured anew beside the shared verify fit."""
        key = self.draft_model if draft_model is None else draft_model
        found = self._drafts.get(key)
        if found is None:
            log.info("draft model %s: its acceptance and step costs are learnt anew (the other "
                     "models' are kept apart)", key or "-")
            found = self._drafts[key] = self._fresh(self.current.costs.for_another_draft())
            self.draft_model = key
            while len(self._drafts) > MAX_DRAFT_MODELS:
                self._drafts.popitem(last=False)
        self._drafts.move_to_end(key)
        return found

    def _seed(self, policy: SessionPolicy, estimates: DraftEstimates, draft_only: bool = False) -> None:
        """Start the session's sources from the coordinator-wide α of those that have warmed up."""
        priors = [(Source.DRAFT, estimates.acceptance)] + ([] if draft_only else [
            (Source.PROMPT_LOOKUP, self.lookup_prior)])
        for source, prior in priors:
            if prior.rounds >= self.config.warmup_rounds and prior.alpha is not None:
                policy.seed(source, prior.alpha, PRIOR_WEIGHT)

    def policy(self, session_id: str, draft_model: str | None = None) -> SessionPolicy:
        """The session's policy (a fresh one for a session not seen, or forgotten; it starts from
        the coordinator-wide α of the sources that have one), its draft estimates those of
        `draft_model` (None: the newest model)."""
        estimates = self.estimates(draft_model)
        key = self.draft_model if draft_model is None else draft_model
        policy = self._policies.get(session_id)
        if policy is None:
            policy = self._policies[session_id] = SessionPolicy(
                self.config, estimates.costs, estimates.acceptance, estimates.probe_clock, estimates.branch,
                self.lookup_prior, self.order_priors, draft_model=key)
            self._seed(policy, estimates)
            while len(self._policies) > self.max_sessions:
                self._policies.popitem(last=False)
        elif policy.draft_model != key:
            self._switch(policy, key, estimates)
        self._policies.move_to_end(session_id)
        return policy

    def _switch(self, policy: SessionPolicy, key: str, estimates: DraftEstimates) -> None:
        policy.use_draft(key, estimates.costs, estimates.acceptance, estimates.probe_clock, estimates.branch)
        self._seed(policy, estimates, draft_only=True)

    def use_draft_model(self, spec: RequestSpeculation, draft_model: str) -> None:
        """The request's draft replica serves `draft_model` now: from the next round the request
        plans with that model's estimates (the session forgets what it learnt of another)."""
        if draft_model == spec.draft_model:
            return
        estimates = self.estimates(draft_model)
        if spec.policy.draft_model != draft_model:
            self._switch(spec.policy, draft_model, estimates)
        spec.priors = {**spec.priors, Source.DRAFT: estimates.acceptance}
        spec.draft_model = draft_model

    def heads_estimates(self, heads_id: str) -> DepthAcceptance:
        """What the coordinator learnt of the heads `heads_id` (fresh ones for heads not seen)."""
        found = self._heads.get(heads_id)
        if found is None:
            log.info("target heads %s: their acceptance is learnt anew (other heads' are kept apart)",
                     heads_id[:12] or "-")
            found = self._heads[heads_id] = DepthAcceptance(PRIOR_DECAY)
            while len(self._heads) > MAX_HEADS:
                self._heads.popitem(last=False)
        self._heads.move_to_end(heads_id)
        return found

    def use_heads(self, spec: RequestSpeculation, heads_id: str) -> None:
        """The request's target replica serves the heads `heads_id`: its rounds plan with what was
        learnt of them; a session whose target serves other heads now forgets what it learnt of
        the old ones (ModelInfo.heads_id changed: new heads rolled out)."""
        heads = spec.policy.heads
        if heads is not None and heads.heads_id == heads_id:
            return
        c = self.config
        spec.policy.use_heads(SessionHeads(heads_id, self.heads_estimates(heads_id), c.draft_prior_weight,
                                           c.warmup_rounds, c.branch_prior_ratio, c.branch_prior_weight,
                                           c.alpha_decay))

    def forget(self, session_id: str) -> None:
        self._policies.pop(session_id, None)

    def start(self, session_id: str, mode: Source, fixed_gamma: int | None, tree_nodes: int = 0,
              pair_grows_trees: bool = False, draft_model: str | None = None) -> RequestSpeculation:
        """A request's planner. tree_nodes: the request's (0 unset, 1 chains, 2+ a tree of that
        many nodes every draft round); pair_grows_trees: the draft grows trees and the target
        verifies them (else every round is a chain); draft_model: the fingerprint of the model
        its draft replica serves (None: the newest seen)."""
        budget = auto_tree_budget(self.trees, tree_nodes, fixed_gamma, pair_grows_trees, self.config.max_gamma)
        policy = self.policy(session_id, draft_model)
        spec = RequestSpeculation(policy, mode, fixed_gamma,
                                  {Source.DRAFT: self.estimates(policy.draft_model).acceptance,
                                   Source.PROMPT_LOOKUP: self.lookup_prior},
                                  self.draft_hints, self.order_priors, self.min_confidence,
                                  tree_nodes if pair_grows_trees else 0, budget)
        spec.draft_model = policy.draft_model
        return spec


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
