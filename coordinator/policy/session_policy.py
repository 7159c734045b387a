"""Per-session choice of proposal source and γ: maximise the expected tokens per second.

A round that proposes γ tokens from a source whose tokens the target accepts with per-position
probability α commits on average E(α, γ) = (1 − α^(γ+1)) / (1 − α) tokens (the accepted
prefix plus the target's own token) and costs t_propose(γ) + t_verify(γ + 1). Plain decoding
commits 1 token per t_verify(1). Measured in units of t_verify(1) the speedup of a round is

    speedup(γ) = E(α, γ) / ((t_propose(γ) + t_verify(γ + 1)) / t_verify(1)),

which is Leviathan et al.'s (1 − α^(γ+1)) / ((1 − α)(γc + 1)) when t_propose(γ) = γ·t_step and
t_verify is flat (c = t_step / t_verify). With t_verify(n) = a + b·n it is the same form with
c = (t_step + b) / t_verify(1). The policy keeps, per session and source ("draft", prompt lookup), an
estimate of α (exponentially forgetting per-position accept/reject trials), and round timings
(linear fits t_propose(γ) = d0 + d1·γ per source and t_verify(n) = a + b·n, shareable between
sessions), and each round picks the source and γ with the largest speedup — or no speculation
("none", γ = 0) when nothing beats plain decoding.

Under load the target runs many sessions' verifications as one batched forward whose time
grows with the batch's tokens, and every session speculating makes every batch bigger: a
session's own view (its verify takes as long with 1 token as with 5, the batch is what costs)
would keep γ high while γ = 0 gives more tokens per second in total. So verify timings are
fitted against the tokens being verified at the time across the coordinator's generations
(`batch_tokens`: what a batched forward of them runs), and with `load` generations running a
round's cost compares t_verify at load·(γ + 1) tokens with t_verify at load·1 — the cost if
every generation made the same choice: γ falls as the batch stops being free.

Prompt lookup's α also depends on how long a suffix it matched: a 3-token match inside a
copied passage is right far more often than a 1-token match in new text. So its α is kept per
match length n as well, and a round uses the session's estimate for the n it matched once that
has `order_min_trials` trials. Until then it uses a prior: the coordinator-wide α at that n
(once that has `order_min_trials` trials; else the session's overall α) scaled by the session's
overall α over the coordinator-wide one. The coordinator learns its per-length α mostly on
copying prompts; a session of new text that failed a round at one match length is then believed
at every length, instead of paying failed rounds at each.

The draft's acceptance belongs to the pair more than to the session, and a session's own
estimate, forgetting per round, dips after a few rejections in a row; so once the
coordinator-wide draft α has warmed up, a session's draft α keeps `draft_prior_weight` trials
of it, once (prompt lookup's stays the session's own: a rewrite and new text differ by far).

Exploration: a source with fewer than `warmup_rounds` observed rounds is tried with
`default_gamma`; a source left unused for `probe_interval` eligible rounds is probed with
`probe_gamma`, and the interval doubles after each probe (up to `max_probe_interval`) until
the source wins on its own again — so α never freezes, and a useless draft costs a bounded,
shrinking number of rounds. A source that was winning and stopped (a few rejections pulled its
α down) is first probed after `lapsed_probe_interval` rounds: a good draft comes back quickly.
A session that started from the coordinator-wide draft α (`seed`) counts the draft's idle rounds
and probe interval on the coordinator's shared `ProbeClock` instead of its own: the draft's
acceptance belongs to the pair, so one probe refreshes it for every session, and a draft that
does not pay is not probed again by each new session (each probe of a session that has not
called the draft yet carries its whole history as a catch-up prefill).

Token trees (`tree_expected_tokens`): where the target verifies trees and the draft grows them,
an adaptive draft round may propose a tree of n nodes, d deep, instead of a chain: the draft's
chain of d (the spine, accepted per position with α) plus n − d alternatives beside it. Each
alternative is modelled as a leaf sibling of a spine node: the target takes the r-th
alternative at a depth where it rejected the spine with probability b per alternative tried
(`branch_alpha`, measured on tree rounds, starting from α·`branch_prior_ratio`). A tree round
costs t_propose(d) + t_verify(n + 1): so a tree wins (by `tree_min_gain` over the best chain)
where verification is flat and the draft unsure, a chain where each verified token costs or the
draft is sure.

The target's heads (heads_estimates.py): where the round before read them, a round may verify
their tree instead, priced as such a tree with an α per depth and no proposal time; it is a
source like the others (warm-up, probes), eligible only with proposals at hand.

Switching costs (`Horizon`): a draft that lags the history (a new session's prompt; the tokens of
rounds it did not propose) first prefills what it lacks, a one-off cost the round's own fit
leaves out; heads not at hand need one plain round whose Verify reads them. Each is spread over
the tokens the request may still commit (`spread_speedup`), so a short answer is not worth the
draft catching up on a long prompt where the heads, one round away, do as well — and a long one is.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator

from specdec.maths.tree import TreeOutcome
from specdec.types import Proposer

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

    source: Proposer   # DRAFT | PROMPT_LOOKUP | HEADS | NONE
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
        self._last = Choice(Proposer.NONE, 0, "none")  # the latest round's choice

    def use_draft(self, draft_model: str, costs: CostModel, prior: AcceptanceEstimate, clock: ProbeClock,
                  branch: AcceptanceEstimate) -> None:
        """Another draft model proposes for this session now (its replica serves another
        fingerprint: a new model rolled out): what the session learnt of the draft is forgotten,
        and that model's coordinator-wide estimates are used (fresh ones for a model not seen)."""
        c = self.config
        self.draft_model, self.costs, self.draft_prior, self.probe_clock, self.branch = (
            draft_model, costs, prior, clock, branch)
        self.sources[Proposer.DRAFT] = _SourceState(AcceptanceEstimate(c.alpha_decay), ProbeClock(c.probe_interval))

    def use_heads(self, heads: SessionHeads) -> None:
        """The session's target serves these heads now (new ones, or the first seen): what it
        learnt of others is forgotten; where the coordinator has measured these, no warm-up."""
        c = self.config
        self.heads = heads
        state = self.sources[Proposer.HEADS] = _SourceState(AcceptanceEstimate(c.alpha_decay),
                                                            ProbeClock(c.probe_interval))
        if heads.warmed_up:
            state.acceptance.rounds = c.warmup_rounds

    def wants_heads(self, mode: Proposer, typical: HeadsAtHand | None = None, cap: int = 0,
                    load: int = 1) -> bool:
        """Whether the Verify of the round just chosen should read the heads' proposals for the
        next round. A request held to heads: always. Under auto only while the next round may
        take them: the heads still warm up, won this round, are due for a probe, or would beat
        this round's choice with proposals like `typical` (what the target's heads and the
        round's `cap` allow). Reading them costs the target one more pass of its output layer
        (all heads at once), which a CPU target pays on every round it is asked, so heads that
        lose are read again only to probe."""
        if self.heads is None or mode not in (Proposer.AUTO, Proposer.HEADS):
            return False
        if mode == Proposer.HEADS:
            return True
        state = self.sources[Proposer.HEADS]
        if (state.acceptance.rounds < self.config.warmup_rounds or self._last.source == Proposer.HEADS
                or self._last.reason == HEADS_NEXT or state.clock.idle >= state.clock.interval):
            return True
        if typical is None:
            return False
        found = self.heads.best_round(typical, cap, lambda nodes: self.costs.relative_heads_cost(nodes, load))
        return found is not None and found[2] > max(1.0, self._last.speedup)

    def observe_heads(self, outcome: TreeOutcome) -> None:
        """A heads round's outcome against its tree's spine: α per depth and b."""
        if self.heads is not None:
            self.heads.observe(outcome)

    def alpha(self, source: Proposer) -> float | None:
        """The current acceptance estimate of a source (None before its first observed round).
        The draft's keeps `draft_prior_weight` trials of the coordinator-wide α once that has
        warmed up: the draft's acceptance belongs to the pair more than to the session, and a
        session's own estimate, forgetting at alpha_decay per round, dips after a few rejections in
        a row, and a weak prompt lookup would then take the rounds that follow. Prompt lookup's α is the session's own: it differs by far
        between a rewrite and new text."""
        own = self.sources[source].acceptance
        shared = self._shared_draft_alpha() if source == Proposer.DRAFT else None
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
        overall = self.alpha(Proposer.PROMPT_LOOKUP)
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
        costs = self.costs.relative_costs(Proposer.PROMPT_LOOKUP, min(available, self.config.max_gamma), load)
        gamma, speedup = argmax_speedup(alpha, costs)
        return gamma if speedup > 1.0 + self.config.min_gain else 0

    def seed(self, source: Proposer, alpha: float, weight: float) -> None:
        """Start a source from a prior α (what other sessions measured) instead of warm-up rounds.
        Prompt lookup's starts with `weight` trials of it, which the session's own rounds soon
        outweigh. The draft's estimate mixes the coordinator-wide α in already (`alpha`) once that
        has warmed up: then only the warm-up ends and the shared probe clock is joined (seeding
        trials too would count that α twice)."""
        check_alpha(alpha)
        estimate = self.sources[source].acceptance
        estimate.rounds = max(estimate.rounds, self.config.warmup_rounds)
        if source == Proposer.DRAFT and self.probe_clock is not None:  # judged with the others now
            self.sources[source].clock = self.probe_clock
        if source != Proposer.DRAFT or self._shared_draft_alpha() is None:
            estimate.successes, estimate.trials = alpha * weight, float(weight)

    def choose(self, max_gamma: int | None = None, lookup_available: int = 0,
               draft_available: bool = True, mode: Proposer = Proposer.AUTO,
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
        if not isinstance(mode, Proposer):
            mode = Proposer(mode)  # ValueError for anything else
        if fixed_gamma is not None and fixed_gamma < 0:
            raise ValueError(f"fixed_gamma must be >= 0, got {fixed_gamma}")
        cap = self.config.max_gamma if max_gamma is None else max_gamma
        caps = self._caps(mode, cap, lookup_available, draft_available, heads)
        if fixed_gamma == 0 or mode == Proposer.NONE:
            return self._chose(caps, Choice(Proposer.NONE, 0, "override"))
        if not caps:
            return self._chose(caps, Choice(Proposer.NONE, 0, "unavailable"))
        if fixed_gamma is not None and mode != Proposer.AUTO:
            choice = Choice(mode, min(fixed_gamma, caps[mode]), "override")
        else:
            horizon = horizon if fixed_gamma is None else NO_HORIZON  # a fixed γ gets what it asked for
            choice = self._explore(caps, fixed_gamma, horizon, load) or self._best(
                caps, fixed_gamma, lookup_order, load, 0 if fixed_gamma is not None else max_tree_nodes, heads,
                horizon, held=mode == Proposer.HEADS)
        if choice.source == Proposer.HEADS and not choice.tree_nodes and heads is not None:
            nodes = (warmup_nodes(choice.gamma, heads) if fixed_gamma is None
                     else max(choice.gamma, min(fixed_gamma, heads.nodes_most(choice.gamma))))
            choice = replace(choice, tree_nodes=nodes)
        return self._chose(caps, choice)

    def observe(self, source: Proposer, proposed: int, accepted: int, *,
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
        if source not in (*SOURCES, Proposer.NONE):
            raise ValueError(f"source must be draft, ngram, heads or none, got {source!r}")
        if not 0 <= accepted <= proposed:
            raise ValueError(f"need 0 <= accepted <= proposed, got {accepted}, {proposed}")
        if source in SOURCES and proposed > 0:
            if trials:
                self.sources[source].acceptance.observe(proposed, accepted)
            else:  # a round all the same: warm-up ends even if its own tokens are never tried
                self.sources[source].acceptance.rounds += 1
            if trials and source == Proposer.PROMPT_LOOKUP and lookup_order > 0:
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

    def _caps(self, mode: Proposer, cap: int, lookup_available: int,
              draft_available: bool, heads: HeadsAtHand | None = None) -> dict[Proposer, int]:
        """Per eligible source, the most tokens it may propose this round (heads: how deep)."""
        caps = {}
        if mode in (Proposer.AUTO, Proposer.DRAFT) and draft_available and cap > 0:
            caps[Proposer.DRAFT] = cap
        if mode in (Proposer.AUTO, Proposer.PROMPT_LOOKUP) and min(cap, lookup_available) > 0:
            caps[Proposer.PROMPT_LOOKUP] = min(cap, lookup_available)
        if (mode in (Proposer.AUTO, Proposer.HEADS) and heads is not None and self.heads is not None
                and min(cap, heads.depth) > 0):
            caps[Proposer.HEADS] = min(cap, heads.depth)
        return caps

    def _explore(self, caps: dict[Proposer, int], fixed_gamma: int | None, horizon: Horizon = NO_HORIZON,
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
            if clock.idle >= clock.interval and not (source == Proposer.DRAFT and lagging):
                clock.interval = min(2 * clock.interval, c.max_probe_interval)
                return Choice(source, min(fixed_gamma or c.probe_gamma, cap), "probe")
        return None

    def _best(self, caps: dict[Proposer, int], fixed_gamma: int | None, lookup_order: int = 0,
              load: int = 1, max_tree_nodes: int = 0, heads: HeadsAtHand | None = None,
              horizon: Horizon = NO_HORIZON, held: bool = False) -> Choice:
        """The eligible source and γ (a draft round: or tree; heads: their tree) with the largest
        estimated speedup over the tokens left (`horizon`: the draft's catch-up, a plain round
        that reads the heads); none when no source beats plain decoding (with a fixed γ, or a
        request `held` to heads, whose every Verify pays for reading them, a source is used)."""
        options = [] if horizon.heads_next is None else self._heads_next(horizon, max(caps.values()), load)
        for source, cap in caps.items():
            if source == Proposer.HEADS:
                found = None if heads is None or self.heads is None else self.heads.best_round(
                    heads, cap, lambda nodes: self.costs.relative_heads_cost(nodes, load), fixed_gamma)
                if found is not None:
                    options.append(Choice(Proposer.HEADS, found[0], "best", found[2], tree_nodes=found[1]))
                continue
            alpha = (self.lookup_alpha(lookup_order) if source == Proposer.PROMPT_LOOKUP else self.alpha(source)) or 0.0
            if fixed_gamma is not None:
                gamma = min(fixed_gamma, cap)
                speedup = expected_tokens(alpha, gamma) / self.costs.relative_cost(source, gamma, load)
            else:
                costs = self.costs.relative_costs(source, min(cap, self.config.max_gamma), load)
                gamma, speedup = argmax_speedup(alpha, costs)
            best = Choice(source, gamma, "best", speedup) if gamma > 0 else None
            if source == Proposer.DRAFT and max_tree_nodes > 0:  # a tree where it beats the chain
                tree = self._best_tree(alpha, min(cap, self.config.max_gamma), min(max_tree_nodes, cap), load)
                if tree is not None and tree.speedup > (best.speedup if best else 1.0) * (
                        1.0 + self.config.tree_min_gain):
                    best = tree
            if best is not None and source == Proposer.DRAFT:  # the catch-up, spread over the tokens left
                best = replace(best, speedup=spread_speedup(
                    best.speedup, self.costs.relative_catch_up(horizon.draft_lag, load), horizon.tokens_left))
            if best is not None:
                options.append(best)
        if not options:
            return Choice(Proposer.NONE, 0, "best")
        top = max(options, key=lambda option: option.speedup)  # ties: the first (draft)
        if fixed_gamma is None and not held and top.speedup <= 1.0 + self.config.min_gain:
            return Choice(Proposer.NONE, 0, "best")
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
        return [Choice(Proposer.NONE, 0, HEADS_NEXT, spread_speedup(found[2], 1.0 - 1.0 / found[2], horizon.tokens_left))]

    def _best_tree(self, alpha: float, max_depth: int, max_nodes: int, load: int) -> Choice | None:
        """The draft tree (depth, nodes) with the largest estimated speedup (None: no budget fits)."""
        b = self.branch_alpha(alpha)
        best: Choice | None = None
        for depth in range(1, max_depth + 1):
            for nodes in tree_budgets(depth, max_nodes):
                speedup = (tree_expected_tokens(alpha, b, depth, nodes)
                           / self.costs.relative_tree_cost(depth, nodes, load))
                if best is None or speedup > best.speedup:
                    best = Choice(Proposer.DRAFT, depth, "best", speedup, tree_nodes=nodes)
        return best

    def _chose(self, caps: dict[Proposer, int], choice: Choice) -> Choice:
        """Book-keeping: the chosen source is fresh, the other eligible ones idle one more round
        — the heads too on a round whose Verify before did not read them (`wants_heads`), so
        their probe comes due."""
        idle = set(caps)
        if self.heads is not None and Proposer.HEADS not in caps:
            idle.add(Proposer.HEADS)
        for source in idle:
            clock = self.sources[source].clock
            clock.idle = 0 if source == choice.source else clock.idle + 1
        self._last = choice
        return choice
