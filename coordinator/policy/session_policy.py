"""Per session, each round's source and γ: the one with the largest expected tokens per second
(γ = 0, plain decoding, when nothing beats it), and what each round's outcome teaches.

`SessionPolicy.choose` picks among the sources eligible this round: a source's warm-up or probe
first (`_explore`), else the best estimated speedup (`_best`): chains of every γ, a draft tree
(`tree_expected_tokens`) or the heads' tree (heads_estimates.py) where they pay, switching
costs spread over the tokens left (`Horizon`, `spread_speedup`). `observe` feeds acceptance and
timings back; `wants_heads` says whether a round's Verify reads the heads for the next. The
model and the reasons behind each rule: docs/design.md, "Adaptive γ and the policy" and its
"Token trees in the policy" and "The target's heads in the policy".
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator

from specdec.maths.tree import TreeOutcome
from specdec.types import Source

from coordinator.policy.estimates import (
    SOURCES, AcceptanceEstimate, CostModel, argmax_speedup, check_alpha, expected_tokens, spread_speedup,
    tree_budgets, tree_expected_tokens)
from coordinator.policy.heads_estimates import HeadsAtHand, SessionHeads, warmup_nodes


@dataclass(frozen=True)
class PolicyConfig:
    max_gamma: int = 8                 # largest γ the policy picks by itself
    default_gamma: int = 4             # γ of the warm-up rounds of a source without data
    warmup_rounds: int = 2             # observed rounds before a source is judged on its data
    probe_gamma: int = 2               # γ of a probe of a source the policy stopped using
    probe_interval: int = 16           # eligible rounds without a source before it is probed
    lapsed_probe_interval: int = 4     # the same for a source that was winning until it stopped
    max_probe_interval: int = 256      # the interval doubles per probe up to this
    alpha_decay: float = 0.9           # weight kept by past rounds in α, per observed round
    timing_decay: float = 0.9          # the same for the timing fits
    default_cost_ratio: float = 0.1    # draft step / verify step until measured
    min_gain: float = 0.0              # speculation must beat plain decoding by this fraction
    max_timed_tokens: int = 0          # verify timings over more tokens (a prefill, a resend)
    #                                    are not round costs and are skipped; 0 = max_gamma + 1
    order_min_trials: float = 3.0      # trials before prompt lookup's α for a match length is used
    #                                    (a session's own; the coordinator's, as a session's prior)
    draft_prior_weight: float = 20.0  # trials' worth of the coordinator-wide draft α every session's
    #                                    draft α keeps (the pair's acceptance: a few rejections in a
    #                                    row must not price the draft out for a stretch of rounds)
    branch_prior_ratio: float = 0.5    # before tree rounds measure it, b (an alternative's acceptance
    #                                    where the spine was rejected) is taken as α times this
    branch_prior_weight: float = 2.0   # trials' worth of that prior the measured b keeps
    tree_min_gain: float = 0.05        # a tree replaces the best chain only when its estimated speedup
    #                                    is higher by this fraction (b and the verify fit's slope past
    #                                    the chains' sizes are estimates, and so is the draft's tree
    #                                    cost until tree rounds are timed)


HEADS_NEXT = "heads next"  # a plain round whose Verify reads the heads for the rounds after it


@dataclass(frozen=True)
class Horizon:
    """What switching source costs a round, and the tokens that cost is spread over."""

    tokens_left: int = 0    # the most tokens the request may still commit (0: unknown; switching is free)
    draft_lag: int = 0      # history tokens the draft must prefill before it proposes (0: it holds it all)
    heads_next: HeadsAtHand | None = None  # heads served but none at hand: a next round's (else None)


NO_HORIZON = Horizon()


@dataclass(frozen=True)
class Choice:
    """A round's plan. Unpacks as ``source, gamma = choice``."""

    source: Source   # DRAFT | PROMPT_LOOKUP | HEADS | NONE
    gamma: int         # tokens to propose (0 exactly when source is "none"; heads: the tree's depth)
    reason: str        # "best" | "warmup" | "probe" | "override" | "unavailable" | HEADS_NEXT
    speedup: float = 1.0  # estimated speedup over plain decoding (1.0 for none)
    tree_nodes: int = 0   # a draft or heads round: propose a tree of this many nodes, γ deep (0: a chain)

    def __iter__(self) -> Iterator:
        return iter((self.source, self.gamma))


@dataclass
class ProbeClock:
    """When an unused source is probed next: the rounds it has been eligible and not chosen, and
    the interval after which it is probed. A session's own, or one shared by the sessions of a
    coordinator (`SessionPolicy.probe_clock`)."""

    interval: int  # probe once idle reaches this
    idle: int = 0  # eligible rounds since it was last chosen


@dataclass
class _SourceState:
    acceptance: AcceptanceEstimate
    clock: ProbeClock  # the session's own, or the coordinator's shared one (a seeded draft)


@dataclass
class SessionPolicy:
    """One per session: ``choose(...)`` before a round, ``observe(...)`` after it."""

    config: PolicyConfig = field(default_factory=PolicyConfig)
    costs: CostModel | None = None
    draft_prior: AcceptanceEstimate | None = None  # the draft's α over all sessions (shared)
    probe_clock: ProbeClock | None = None  # the draft's probe clock over all sessions (shared)
    branch: AcceptanceEstimate | None = None  # trees: b, an alternative's acceptance (shared; None: own)
    lookup_prior: AcceptanceEstimate | None = None  # prompt lookup's α over all sessions (shared)
    order_priors: dict[int, AcceptanceEstimate] = field(default_factory=dict)  # ... per match length
    draft_model: str = ""  # the draft model (its fingerprint) the draft's estimates are of
    heads: SessionHeads | None = None  # what the session knows of the target's heads (None: none seen)

    def __post_init__(self) -> None:
        c = self.config
        if self.costs is None:
            self.costs = CostModel(c.timing_decay, c.default_cost_ratio)
        self.sources = {s: _SourceState(AcceptanceEstimate(c.alpha_decay), ProbeClock(c.probe_interval))
                        for s in SOURCES}
        self.lookup_orders: dict[int, AcceptanceEstimate] = {}  # prompt lookup's α per match length
        if self.branch is None:
            self.branch = AcceptanceEstimate(c.alpha_decay)
        self._last = Choice(Source.NONE, 0, "none")  # the latest round's choice

    def use_draft(self, draft_model: str, costs: CostModel, prior: AcceptanceEstimate, clock: ProbeClock,
                  branch: AcceptanceEstimate) -> None:
        """Another draft model proposes for this session now (its replica serves another
        fingerprint: a new model rolled out): what the session learnt of the draft is forgotten,
        and that model's coordinator-wide estimates are used (fresh ones for a model not seen)."""
        c = self.config
        self.draft_model, self.costs, self.draft_prior, self.probe_clock, self.branch = (
            draft_model, costs, prior, clock, branch)
        self.sources[Source.DRAFT] = _SourceState(AcceptanceEstimate(c.alpha_decay), ProbeClock(c.probe_interval))

    def use_heads(self, heads: SessionHeads) -> None:
        """The session's target serves these heads now (new ones, or the first seen): what it
        learnt of others is forgotten; where the coordinator has measured these, no warm-up."""
        c = self.config
        self.heads = heads
        state = self.sources[Source.HEADS] = _SourceState(AcceptanceEstimate(c.alpha_decay),
                                                            ProbeClock(c.probe_interval))
        if heads.warmed_up:
            state.acceptance.rounds = c.warmup_rounds

    def wants_heads(self, mode: Source, typical: HeadsAtHand | None = None, cap: int = 0,
                    load: int = 1) -> bool:
        """Whether the Verify of the round just chosen should read the heads' proposals for the
        next round. A request held to heads: always. Under auto only while the next round may
        take them: the heads still warm up, won this round, are due for a probe, or would beat
        this round's choice with proposals like `typical` (what the target's heads and the
        round's `cap` allow). Reading them costs the target one more pass of its output layer
        (all heads at once), which a CPU target pays on every round it is asked, so heads that
        lose are read again only to probe."""
        if self.heads is None or mode not in (Source.AUTO, Source.HEADS):
            return False
        if mode == Source.HEADS:
            return True
        state = self.sources[Source.HEADS]
        if (state.acceptance.rounds < self.config.warmup_rounds or self._last.source == Source.HEADS
                or self._last.reason == HEADS_NEXT or state.clock.idle >= state.clock.interval):
            return True
        if typical is None:
            return False
        found = self.heads.best_round(typical, cap, lambda nodes: self.costs.relative_heads_cost(nodes, load))
        return found is not None and found[2] > max(1.0, self._last.speedup)

    def draft_costs(self, gamma: int, lag: int, load: int) -> tuple[float, float]:
        """(a draft round of γ, a catch-up on `lag` history tokens), in plain-decode steps."""
        return self.costs.relative_cost(Source.DRAFT, gamma, load), self.costs.relative_catch_up(lag, load)

    def draft_steps_within_verify(self, verified_tokens: int, load: int) -> int | None:
        """Draft steps that take no longer than verifying `verified_tokens` at `load` (None: the
        timings do not say yet)."""
        budget = self.costs.verify_seconds(verified_tokens, load)
        return None if budget is None else self.costs.steps_within(Source.DRAFT, budget)

    def observe_catch_up(self, tokens: int, gamma: int, call_seconds: float) -> None:
        """A draft call of γ that first prefilled `tokens` it lacked took `call_seconds`."""
        self.costs.observe_catch_up(tokens, gamma, call_seconds)

    def observe_heads(self, outcome: TreeOutcome) -> None:
        """A heads round's outcome against its tree's spine: α per depth and b."""
        if self.heads is not None:
            self.heads.observe(outcome)

    def alpha(self, source: Source) -> float | None:
        """The current acceptance estimate of a source (None before its first observed round);
        the draft's keeps `draft_prior_weight` trials of the coordinator-wide α once that has
        warmed up (the pair's acceptance; design.md, "Adaptive γ and the policy")."""
        own = self.sources[source].acceptance
        shared = self._shared_draft_alpha() if source == Source.DRAFT else None
        if shared is None:
            return own.alpha
        weight = self.config.draft_prior_weight
        return (own.successes + weight * shared) / (own.trials + weight)

    def _shared_draft_alpha(self) -> float | None:
        """The coordinator-wide draft α once it has warmed up (None: no prior, or not yet)."""
        prior = self.draft_prior
        if prior is None or prior.alpha is None or prior.rounds < self.config.warmup_rounds:
            return None
        return prior.alpha

    def branch_alpha(self, alpha: float) -> float:
        """b: the probability that the target takes an alternative beside a spine node it
        rejected, per alternative tried — measured on tree rounds, holding `branch_prior_weight`
        trials of α·`branch_prior_ratio` (a draft whose ranks' probabilities fall geometrically
        would give b = α; its second choice is the target's less often than that)."""
        c, branch = self.config, self.branch
        weight = c.branch_prior_weight
        return (branch.successes + weight * alpha * c.branch_prior_ratio) / (branch.trials + weight)

    def observe_branches(self, tried: int, accepted: int) -> None:
        """A tree round tested `tried` alternatives beside the spine node the target rejected and
        accepted `accepted` (0 or 1, the last tried) of them."""
        self.branch.observe_trials(tried, accepted)

    def lookup_alpha(self, order: int = 0) -> float | None:
        """Prompt lookup's α for a match of `order` tokens (0: unknown): the session's own
        estimate at that length once it has `order_min_trials` trials, else `_order_prior` (None
        before any trial or prior)."""
        own = self.lookup_orders.get(order)
        if own is not None and own.trials >= self.config.order_min_trials:
            return own.alpha
        overall = self.alpha(Source.PROMPT_LOOKUP)
        return None if overall is None else self._order_prior(order, overall)

    def _order_prior(self, order: int, overall: float) -> float:
        """The prior of prompt lookup's α at match length `order`: the coordinator-wide α there,
        scaled by the session's overall α over the coordinator-wide one (at most 1: a session of
        new text is believed at every length at once); the session's overall α where the
        coordinator has too few trials at that length."""
        shared, at_order = self.lookup_prior, self.order_priors.get(order) if order else None
        if (shared is None or not shared.alpha or at_order is None or at_order.alpha is None
                or at_order.trials < self.config.order_min_trials):
            return overall
        return min(1.0, at_order.alpha * overall / shared.alpha)

    def lookup_gamma(self, available: int, order: int = 0, load: int = 1) -> int:
        """How many of prompt lookup's `available` tokens a round of its own would propose now
        (the γ of its best speedup; 0 when that does not beat plain decoding): what a draft
        tree round grafts on as a branch."""
        alpha = self.lookup_alpha(order) or 0.0
        costs = self.costs.relative_costs(Source.PROMPT_LOOKUP, min(available, self.config.max_gamma), load)
        gamma, speedup = argmax_speedup(alpha, costs)
        return gamma if speedup > 1.0 + self.config.min_gain else 0

    def seed(self, source: Source, alpha: float, weight: float) -> None:
        """Start a source from a prior α (what other sessions measured) instead of warm-up rounds.
        Prompt lookup's starts with `weight` trials of it, which the session's own rounds soon
        outweigh. The draft's estimate mixes the coordinator-wide α in already (`alpha`) once that
        has warmed up: then only the warm-up ends and the shared probe clock is joined (seeding
        trials too would count that α twice)."""
        check_alpha(alpha)
        estimate = self.sources[source].acceptance
        estimate.rounds = max(estimate.rounds, self.config.warmup_rounds)
        if source == Source.DRAFT and self.probe_clock is not None:  # judged with the others now
            self.sources[source].clock = self.probe_clock
        if source != Source.DRAFT or self._shared_draft_alpha() is None:
            estimate.successes, estimate.trials = alpha * weight, float(weight)

    def choose(self, max_gamma: int | None = None, lookup_available: int = 0,
               draft_available: bool = True, mode: Source = Source.AUTO,
               fixed_gamma: int | None = None, lookup_order: int = 0, load: int = 1,
               max_tree_nodes: int = 0, heads: HeadsAtHand | None = None,
               horizon: Horizon = NO_HORIZON) -> Choice:
        """The source and γ of the next round.

        max_gamma: this round's cap (tokens left, context room, the services' limits);
        lookup_available: how many tokens prompt lookup has for this round;
        lookup_order: the length of the suffix it matched (0: unknown);
        load: generations sharing the target now (this one included);
        draft_available: False while the draft tier is failing;
        mode / fixed_gamma: the request's override (fixed source and / or fixed γ);
        max_tree_nodes: an adaptive draft round may propose a tree of up to this many nodes
        instead of a chain when that pays (0: chains only — the target or the draft cannot, the
        request or the coordinator turned trees off, γ is fixed);
        heads: the target's heads' proposals read in the round before (None: none at hand). A
        heads choice's γ is its tree's depth and tree_nodes its size (a fixed γ: its size).
        horizon: the draft's catch-up and the heads' plain round, spread over the tokens left.
        """
        if not isinstance(mode, Source):
            mode = Source(mode)  # ValueError for anything else
        if fixed_gamma is not None and fixed_gamma < 0:
            raise ValueError(f"fixed_gamma must be >= 0, got {fixed_gamma}")
        cap = self.config.max_gamma if max_gamma is None else max_gamma
        caps = self._caps(mode, cap, lookup_available, draft_available, heads)
        if fixed_gamma == 0 or mode == Source.NONE:
            return self._chose(caps, Choice(Source.NONE, 0, "override"))
        if not caps:
            return self._chose(caps, Choice(Source.NONE, 0, "unavailable"))
        if fixed_gamma is not None and mode != Source.AUTO:
            choice = Choice(mode, min(fixed_gamma, caps[mode]), "override")
        else:
            horizon = horizon if fixed_gamma is None else NO_HORIZON  # a fixed γ gets what it asked for
            choice = self._explore(caps, fixed_gamma, horizon, load) or self._best(
                caps, fixed_gamma, lookup_order, load, 0 if fixed_gamma is not None else max_tree_nodes, heads,
                horizon)
        if choice.source == Source.HEADS and not choice.tree_nodes and heads is not None:
            nodes = (warmup_nodes(choice.gamma, heads) if fixed_gamma is None
                     else max(choice.gamma, min(fixed_gamma, heads.nodes_most(choice.gamma))))
            choice = replace(choice, tree_nodes=nodes)
        return self._chose(caps, choice)

    def observe(self, source: Source, proposed: int, accepted: int, *,
                propose_seconds: float | None = None, verify_seconds: float | None = None,
                verified_tokens: int | None = None, trials: bool = True, lookup_order: int = 0,
                batch_tokens: int | None = None, tree: bool = False) -> None:
        """After a round: what was proposed and accepted, and (optionally) how long it took.

        verified_tokens: the tokens the target's forward pass took (default proposed + 1).
        Pass None as a time to leave a round out of the timings (a resend after a cache miss).
        trials=False: the proposals were never tried (the round ended before them), so α is
        left as it was; the timings still count. lookup_order: a prompt-lookup round's match length.
        batch_tokens: the tokens verified across the coordinator's generations while this round's
        were (its own included; default verified_tokens): what the verify time is fitted against.
        tree: a draft round that grew a token tree, `proposed` deep (its spine): its time goes to
        the tree rounds' own fit.
        """
        if source not in (*SOURCES, Source.NONE):
            raise ValueError(f"source must be draft, ngram, heads or none, got {source!r}")
        if not 0 <= accepted <= proposed:
            raise ValueError(f"need 0 <= accepted <= proposed, got {accepted}, {proposed}")
        if source in SOURCES and proposed > 0:
            if trials:
                self.sources[source].acceptance.observe(proposed, accepted)
            else:  # a round all the same: warm-up ends even if its own tokens are never tried
                self.sources[source].acceptance.rounds += 1
            if trials and source == Source.PROMPT_LOOKUP and lookup_order > 0:
                self.lookup_orders.setdefault(lookup_order, AcceptanceEstimate(self.config.alpha_decay)).observe(
                    proposed, accepted)
            if propose_seconds is not None and tree:
                self.costs.observe_tree_propose(proposed, propose_seconds)
            elif propose_seconds is not None:
                self.costs.observe_propose(source, proposed, propose_seconds)
        tokens = proposed + 1 if verified_tokens is None else verified_tokens
        limit = self.config.max_timed_tokens or self.config.max_gamma + 1
        if verify_seconds is not None and 0 < tokens <= limit:
            self.costs.observe_verify(max(tokens, batch_tokens or 0), verify_seconds)

    def _caps(self, mode: Source, cap: int, lookup_available: int,
              draft_available: bool, heads: HeadsAtHand | None = None) -> dict[Source, int]:
        """Per eligible source, the most tokens it may propose this round (heads: how deep)."""
        caps = {}
        if mode in (Source.AUTO, Source.DRAFT) and draft_available and cap > 0:
            caps[Source.DRAFT] = cap
        if mode in (Source.AUTO, Source.PROMPT_LOOKUP) and min(cap, lookup_available) > 0:
            caps[Source.PROMPT_LOOKUP] = min(cap, lookup_available)
        if (mode in (Source.AUTO, Source.HEADS) and heads is not None and self.heads is not None
                and min(cap, heads.depth) > 0):
            caps[Source.HEADS] = min(cap, heads.depth)
        return caps

    def _explore(self, caps: dict[Source, int], fixed_gamma: int | None, horizon: Horizon = NO_HORIZON,
                 load: int = 1) -> Choice | None:
        """Warm-up of a source without enough data, or a probe of one left unused too long — but
        not of a draft that would first catch up on history (`horizon`): such a probe costs the
        catch-up whatever it finds, and the draft is still chosen where the α it is judged on
        (the coordinator's, once warmed up) makes it worth catching up (`_best`). Its probe waits
        for a round where it holds the history."""
        c = self.config
        for source, cap in caps.items():
            if self.sources[source].acceptance.rounds < c.warmup_rounds:
                return Choice(source, min(fixed_gamma or c.default_gamma, cap), "warmup")
        lagging = self.costs.relative_catch_up(horizon.draft_lag, load) > 0
        for source, cap in caps.items():
            clock = self.sources[source].clock
            if clock.idle >= clock.interval and not (source == Source.DRAFT and lagging):
                clock.interval = min(2 * clock.interval, c.max_probe_interval)
                return Choice(source, min(fixed_gamma or c.probe_gamma, cap), "probe")
        return None

    def _best(self, caps: dict[Source, int], fixed_gamma: int | None, lookup_order: int = 0,
              load: int = 1, max_tree_nodes: int = 0, heads: HeadsAtHand | None = None,
              horizon: Horizon = NO_HORIZON) -> Choice:
        """The eligible source and γ (a draft round: or tree; heads: their tree) with the largest
        estimated speedup over the tokens left (`horizon`: the draft's catch-up, a plain round
        that reads the heads); none when no source beats plain decoding (with a fixed γ a source
        is always used)."""
        options = [] if horizon.heads_next is None else self._heads_next(horizon, max(caps.values()), load)
        for source, cap in caps.items():
            if source == Source.HEADS:
                found = None if heads is None or self.heads is None else self.heads.best_round(
                    heads, cap, lambda nodes: self.costs.relative_heads_cost(nodes, load), fixed_gamma)
                if found is not None:
                    options.append(Choice(Source.HEADS, found[0], "best", found[2], tree_nodes=found[1]))
                continue
            alpha = (self.lookup_alpha(lookup_order) if source == Source.PROMPT_LOOKUP else self.alpha(source)) or 0.0
            if fixed_gamma is not None:
                gamma = min(fixed_gamma, cap)
                speedup = expected_tokens(alpha, gamma) / self.costs.relative_cost(source, gamma, load)
            else:
                costs = self.costs.relative_costs(source, min(cap, self.config.max_gamma), load)
                gamma, speedup = argmax_speedup(alpha, costs)
            best = Choice(source, gamma, "best", speedup) if gamma > 0 else None
            if source == Source.DRAFT and max_tree_nodes > 0:  # a tree where it beats the chain
                tree = self._best_tree(alpha, min(cap, self.config.max_gamma), min(max_tree_nodes, cap), load)
                if tree is not None and tree.speedup > (best.speedup if best else 1.0) * (
                        1.0 + self.config.tree_min_gain):
                    best = tree
            if best is not None and source == Source.DRAFT:  # the catch-up, spread over the tokens left
                best = replace(best, speedup=spread_speedup(
                    best.speedup, self.costs.relative_catch_up(horizon.draft_lag, load), horizon.tokens_left))
            if best is not None:
                options.append(best)
        if not options:
            return Choice(Source.NONE, 0, "best")
        top = max(options, key=lambda option: option.speedup)  # ties: the first (draft)
        if fixed_gamma is None and top.speedup <= 1.0 + self.config.min_gain:
            return Choice(Source.NONE, 0, "best")
        if top.speedup > 1.0 + self.config.min_gain and top.source in self.sources:  # it wins (not forced):
            # once it stops, it is probed soon (its α may have dipped on a few rounds)
            self.sources[top.source].clock.interval = self.config.lapsed_probe_interval
        return top

    def _heads_next(self, horizon: Horizon, cap: int, load: int) -> list[Choice]:
        """A plain round that reads the heads (none at hand now), priced as the heads' best round
        from the next round on (`HEADS_NEXT`; [] where that does not beat plain decoding)."""
        if self.heads is None or horizon.tokens_left <= 1:  # no round after this one to take them
            return []
        found = self.heads.best_round(horizon.heads_next, cap, lambda nodes: self.costs.relative_heads_cost(nodes, load))
        if found is None or found[2] <= 1.0:
            return []
        return [Choice(Source.NONE, 0, HEADS_NEXT, spread_speedup(found[2], 1.0 - 1.0 / found[2], horizon.tokens_left))]

    def _best_tree(self, alpha: float, max_depth: int, max_nodes: int, load: int) -> Choice | None:
        """The draft tree (depth, nodes) with the largest estimated speedup (None: no budget fits)."""
        b = self.branch_alpha(alpha)
        best: Choice | None = None
        for depth in range(1, max_depth + 1):
            for nodes in tree_budgets(depth, max_nodes):
                speedup = (tree_expected_tokens(alpha, b, depth, nodes)
                           / self.costs.relative_tree_cost(depth, nodes, load))
                if best is None or speedup > best.speedup:
                    best = Choice(Source.DRAFT, depth, "best", speedup, tree_nodes=nodes)
        return best

    def _chose(self, caps: dict[Source, int], choice: Choice) -> Choice:
        """Book-keeping: the chosen source is fresh, the other eligible ones idle one more round
        — the heads too on a round whose Verify before did not read them (`wants_heads`), so
        their probe comes due."""
        idle = set(caps)
        if self.heads is not None and Source.HEADS not in caps:
            idle.add(Source.HEADS)
        for source in idle:
            clock = self.sources[source].clock
            clock.idle = 0 if source == choice.source else clock.idle + 1
        self._last = choice
        return choice
