"""Per-session choice of proposal source and γ: maximise the expected tokens per second.

A round that proposes γ tokens from a source whose tokens the target accepts with per-position
probability α commits on average E(α, γ) = (1 − α^(γ+1)) / (1 − α) tokens (the accepted
prefix plus the target's own token) and costs t_propose(γ) + t_verify(γ + 1). Plain decoding
commits 1 token per t_verify(1). Measured in units of t_verify(1) the speedup of a round is

    speedup(γ) = E(α, γ) / ((t_propose(γ) + t_verify(γ + 1)) / t_verify(1)),

which is Leviathan et al.'s (1 − α^(γ+1)) / ((1 − α)(γc + 1)) when t_propose(γ) = γ·t_step and
t_verify is flat (c = t_step / t_verify). With t_verify(n) = a + b·n it is the same form with
c = (t_step + b) / t_verify(1). The policy keeps, per session and source ("draft", "ngram"), an
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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from specdec.tree import TREE_WIDTH
from specdec.types import Proposer

SOURCES = (Proposer.DRAFT, Proposer.PROMPT_LOOKUP)  # the sources that propose tokens


def expected_tokens(alpha: float, gamma: int) -> float:
    """E[tokens committed by a round of γ proposals] = 1 + α + … + α^γ, summed term by term (as
    `best_gamma` builds it): the closed form (1 − α^(γ+1)) / (1 − α) cancels badly as α → 1."""
    tokens, power = 1.0, 1.0
    for _ in range(gamma):
        power *= alpha
        tokens += power
    return tokens


def tree_expected_tokens(alpha: float, branch_alpha: float, depth: int, nodes: int,
                         width: int = TREE_WIDTH) -> float:
    """E[tokens committed by a round proposing a tree of `nodes` nodes, `depth` deep]: the chain
    of `depth` (the spine, each node accepted with α once its parent is) plus `nodes − depth`
    alternatives, each a leaf sibling of a spine node (at most width − 1 per depth, as the
    draft's beam keeps `width` nodes a depth). The target takes the r-th alternative at depth i
    when it accepted the spine to depth i − 1 (α^(i−1)), rejected its node there (1 − α) and the
    r − 1 alternatives before it ((1 − b)^(r−1)), then accepted it (b): that is what the
    alternative adds, and the draft keeps the alternatives that add most (its path score), so
    the best `nodes − depth` are summed. Children of alternatives are not counted: a lower
    bound of what the draft's tree holds."""
    _check_alpha(alpha)
    _check_alpha(branch_alpha)
    if not 0 <= depth <= nodes:
        raise ValueError(f"need 0 <= depth <= nodes, got {depth}, {nodes}")
    adds = sorted((alpha ** (i - 1) * (1.0 - alpha) * branch_alpha * (1.0 - branch_alpha) ** (r - 2)
                   for i in range(1, depth + 1) for r in range(2, width + 1)), reverse=True)
    return expected_tokens(alpha, depth) + sum(adds[:nodes - depth])


def tree_budgets(depth: int, max_nodes: int) -> list[int]:
    """The node budgets the policy weighs for a tree `depth` deep: twice and four times its
    depth (a chain is the budget `depth` itself), at most `max_nodes`."""
    return [n for n in (2 * depth, 4 * depth) if depth < n <= max_nodes]


def leviathan_speedup(alpha: float, gamma: int, c: float) -> float:
    """Expected speedup over plain decoding: (1 − α^(γ+1)) / ((1 − α)(γc + 1))."""
    return expected_tokens(alpha, gamma) / (gamma * c + 1.0)


def best_gamma(alpha: float, c: float, max_gamma: int) -> int:
    """The γ in [0, max_gamma] with the largest `leviathan_speedup` (the smallest among ties).

    The speedup is unimodal in γ (a concave increasing numerator over an affine denominator),
    so the scan stops at its first decrease.
    """
    _check_alpha(alpha)
    if c < 0 or max_gamma < 0:
        raise ValueError(f"need c >= 0 and max_gamma >= 0, got {c}, {max_gamma}")
    best, best_value = 0, 1.0
    tokens, power = 1.0, 1.0  # E(α, γ) and α^γ, built up as γ grows
    for gamma in range(1, max_gamma + 1):
        power *= alpha
        tokens += power
        value = tokens / (gamma * c + 1.0)
        if value > best_value:
            best, best_value = gamma, value
        elif value < best_value:
            break
    return best


def _check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")


def _argmax_speedup(alpha: float, relative_costs: list[float]) -> tuple[int, float]:
    """(γ, speedup) maximising E(α, γ) / relative_costs[γ]; γ = 0 scores 1."""
    best, best_value = 0, 1.0
    for gamma in range(1, len(relative_costs)):
        value = expected_tokens(alpha, gamma) / relative_costs[gamma]
        if value > best_value:
            best, best_value = gamma, value
    return best, best_value


class AcceptanceEstimate:
    """α from per-position trials: a round with k proposals and m accepted is m successes and,
    when m < k, one failure (the positions after the first rejection were never tried).
    Old rounds fade by `decay` per observed round."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.successes = 0.0
        self.trials = 0.0
        self.rounds = 0

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.successes = self.successes * self.decay + accepted
        self.trials = self.trials * self.decay + accepted + (1 if accepted < proposed else 0)
        self.rounds += 1

    def observe_trials(self, tried: int, accepted: int) -> None:
        """A round of `tried` independent trials, `accepted` of them successes (every one was
        tried: a tree's alternatives, unlike a chain's positions after a rejection)."""
        if tried <= 0:
            return
        self.successes = self.successes * self.decay + accepted
        self.trials = self.trials * self.decay + tried
        self.rounds += 1

    @property
    def alpha(self) -> float | None:
        return self.successes / self.trials if self.trials > 0 else None


class LinearFit:
    """y ≈ a + b·x by exponentially weighted least squares (a, b >= 0).

    While x has (almost) not varied the slope is unknown: `degenerate` says what to assume —
    "flat" (b = 0, y = mean) or "proportional" (a = 0, y = mean·x / mean_x). A fit with a
    negative intercept is noise, not a cost (no call takes negative time with no tokens): it gets
    the same assumption. (A verify fit falling back to "proportional" there would price every
    speculative round at γ + 1 plain steps, and one noisy slow round would switch speculation off
    until the slow probes brought it back.)
    """

    MIN_VARIANCE = 0.01  # x is a token count: below this it has not really varied

    def __init__(self, decay: float, degenerate: str) -> None:
        if degenerate not in ("flat", "proportional"):
            raise ValueError(f"degenerate must be flat or proportional, got {degenerate!r}")
        self.decay, self.degenerate = decay, degenerate
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def observe(self, x: float, y: float) -> None:
        d = self.decay
        self.w, self.sx, self.sy = self.w * d + 1.0, self.sx * d + x, self.sy * d + y
        self.sxx, self.sxy = self.sxx * d + x * x, self.sxy * d + x * y

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b), or None before the first observation."""
        if self.w <= 0:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if var >= self.MIN_VARIANCE:
            b = max(0.0, (self.sxy / self.w - mx * my) / var)
            a = my - b * mx
            if a >= 0:
                return a, b
        if self.degenerate == "proportional" and mx > 0:
            return 0.0, my / mx
        return my, 0.0

    def predict(self, x: float) -> float | None:
        coefficients = self.coefficients()
        return None if coefficients is None else coefficients[0] + coefficients[1] * x


class CostModel:
    """Round timings: t_verify(n tokens) and, per source, t_propose(γ). One per coordinator can
    be shared by all sessions (the costs belong to the deployment more than to a session)."""

    def __init__(self, decay: float = 0.9, default_cost_ratio: float = 0.1) -> None:
        self.default_cost_ratio = default_cost_ratio
        self.verify = LinearFit(decay, "flat")
        self.propose = {source: LinearFit(decay, "proportional") for source in SOURCES}
        # the draft growing a tree, against its depth: a depth's forward carries several nodes,
        # so it is fitted apart from the chains' steps (and leaves their fit to chains)
        self.tree_propose = LinearFit(decay, "proportional")

    def observe_verify(self, tokens: int, seconds: float) -> None:
        self.verify.observe(tokens, seconds)

    def observe_propose(self, source: Proposer, gamma: int, seconds: float) -> None:
        self.propose[source].observe(gamma, seconds)

    def observe_tree_propose(self, depth: int, seconds: float) -> None:
        """The draft grew a tree `depth` deep (one forward per depth) in `seconds`."""
        self.tree_propose.observe(depth, seconds)

    def relative_cost(self, source: Proposer, gamma: int, load: int = 1) -> float:
        """(t_propose(γ) + t_verify(load·(γ + 1))) / t_verify(load): a round's cost in plain-decode
        steps when `load` alike sessions share the target's batches.

        Unmeasured: the draft costs `default_cost_ratio` per token, the n-gram nothing, and
        verification is flat."""
        return self.relative_costs(source, max(gamma, 0), load)[-1]

    def verify_seconds(self, tokens: int, load: int = 1) -> float | None:
        """t_verify of a round of `tokens` when `load` alike sessions share the batches (None:
        not measured yet)."""
        return self.verify.predict(max(1, load) * tokens)

    def steps_within(self, source: Proposer, seconds: float) -> int | None:
        """The most proposal steps of `source` that take at most `seconds` (None: not measured)."""
        propose = self.propose[source].coefficients()
        if propose is None or propose[1] <= 0:
            return None
        return max(0, int((seconds - propose[0]) / propose[1]))

    def relative_tree_cost(self, depth: int, nodes: int, load: int = 1) -> float:
        """(t_propose(depth) + t_verify(load·(nodes + 1))) / t_verify(load): a draft round growing a
        tree of `nodes` nodes (one draft forward per depth) in plain-decode steps, t_propose from
        the tree rounds' own fit once it has one, else from the chains' steps. Unmeasured: as
        `relative_cost` for the draft's `depth` steps (verification flat)."""
        tree = self.tree_propose.coefficients()
        return self._relative(Proposer.DRAFT, [(depth, nodes + 1)], load, tree)[0]

    def relative_costs(self, source: Proposer, max_gamma: int, load: int = 1) -> list[float]:
        """`relative_cost(source, γ, load)` for γ = 0 .. max_gamma (the fits solved once)."""
        return [1.0] + self._relative(source, [(gamma, gamma + 1) for gamma in range(1, max_gamma + 1)], load)

    def _relative(self, source: Proposer, rounds: list[tuple[int, int]], load: int,
                  propose: tuple[float, float] | None = None) -> list[float]:
        """Per (proposal steps, verified tokens) of a round, (t_propose(steps) +
        t_verify(load·verified)) / t_verify(load), the fits solved once (`propose`: t_propose's
        coefficients instead of the source's chain fit)."""
        verify, propose = self.verify.coefficients(), propose or self.propose[source].coefficients()
        load = max(1, load)
        t1 = None if verify is None else verify[0] + verify[1] * load
        default = self.default_cost_ratio if source == Proposer.DRAFT else 0.0
        if t1 is None or t1 <= 0:
            return [1.0 + default * steps for steps, _ in rounds]
        return [((default * steps * t1 if propose is None else propose[0] + propose[1] * steps)
                 + verify[0] + verify[1] * load * verified) / t1 for steps, verified in rounds]


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


@dataclass(frozen=True)
class Choice:
    """A round's plan. Unpacks as ``source, gamma = choice``."""

    source: Proposer   # DRAFT | PROMPT_LOOKUP | NONE
    gamma: int         # tokens to propose (0 exactly when source is "none")
    reason: str        # "best" | "warmup" | "probe" | "override" | "unavailable"
    speedup: float = 1.0  # estimated speedup over plain decoding (1.0 for none)
    tree_nodes: int = 0   # a draft round: propose a tree of this many nodes, γ deep (0: a chain)

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

    def __post_init__(self) -> None:
        c = self.config
        if self.costs is None:
            self.costs = CostModel(c.timing_decay, c.default_cost_ratio)
        self.sources = {s: _SourceState(AcceptanceEstimate(c.alpha_decay), ProbeClock(c.probe_interval))
                        for s in SOURCES}
        self.lookup_orders: dict[int, AcceptanceEstimate] = {}  # prompt lookup's α per match length
        if self.branch is None:
            self.branch = AcceptanceEstimate(c.alpha_decay)

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
        gamma, speedup = _argmax_speedup(alpha, costs)
        return gamma if speedup > 1.0 + self.config.min_gain else 0

    def seed(self, source: Proposer, alpha: float, weight: float) -> None:
        """Start a source from a prior α (what other sessions measured) instead of warm-up rounds.
        Prompt lookup's starts with `weight` trials of it, which the session's own rounds soon
        outweigh. The draft's estimate mixes the coordinator-wide α in already (`alpha`) once that
        has warmed up: then only the warm-up ends and the shared probe clock is joined (seeding
        trials too would count that α twice)."""
        _check_alpha(alpha)
        estimate = self.sources[source].acceptance
        estimate.rounds = max(estimate.rounds, self.config.warmup_rounds)
        if source == Proposer.DRAFT and self.probe_clock is not None:  # judged with the others now
            self.sources[source].clock = self.probe_clock
        if source != Proposer.DRAFT or self._shared_draft_alpha() is None:
            estimate.successes, estimate.trials = alpha * weight, float(weight)

    def choose(self, max_gamma: int | None = None, lookup_available: int = 0,
               draft_available: bool = True, mode: Proposer = Proposer.AUTO,
               fixed_gamma: int | None = None, lookup_order: int = 0, load: int = 1,
               max_tree_nodes: int = 0) -> Choice:
        """The source and γ of the next round.

        max_gamma: this round's cap (tokens left, context room, the services' limits);
        lookup_available: how many tokens the n-gram proposer has for this round;
        lookup_order: the length of the suffix it matched (0: unknown);
        load: generations sharing the target now (this one included);
        draft_available: False while the draft tier is failing;
        mode / fixed_gamma: the request's override (fixed source and / or fixed γ);
        max_tree_nodes: an adaptive draft round may propose a tree of up to this many nodes
        instead of a chain when that pays (0: chains only — the target or the draft cannot, the
        request or the coordinator turned trees off, γ is fixed).
        """
        if not isinstance(mode, Proposer):
            mode = Proposer(mode)  # ValueError for anything else
        if fixed_gamma is not None and fixed_gamma < 0:
            raise ValueError(f"fixed_gamma must be >= 0, got {fixed_gamma}")
        cap = self.config.max_gamma if max_gamma is None else max_gamma
        caps = self._caps(mode, cap, lookup_available, draft_available)
        if fixed_gamma == 0 or mode == Proposer.NONE:
            return self._chose(caps, Choice(Proposer.NONE, 0, "override"))
        if not caps:
            return self._chose(caps, Choice(Proposer.NONE, 0, "unavailable"))
        if fixed_gamma is not None and mode != Proposer.AUTO:
            return self._chose(caps, Choice(mode, min(fixed_gamma, caps[mode]), "override"))
        return self._chose(caps, self._explore(caps, fixed_gamma)
                           or self._best(caps, fixed_gamma, lookup_order, load,
                                         0 if fixed_gamma is not None else max_tree_nodes))

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
            raise ValueError(f"source must be draft, ngram or none, got {source!r}")
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
              draft_available: bool) -> dict[Proposer, int]:
        """Per eligible source, the most tokens it may propose this round."""
        caps = {}
        if mode in (Proposer.AUTO, Proposer.DRAFT) and draft_available and cap > 0:
            caps[Proposer.DRAFT] = cap
        if mode in (Proposer.AUTO, Proposer.PROMPT_LOOKUP) and min(cap, lookup_available) > 0:
            caps[Proposer.PROMPT_LOOKUP] = min(cap, lookup_available)
        return caps

    def _explore(self, caps: dict[Proposer, int], fixed_gamma: int | None) -> Choice | None:
        """Warm-up of a source without enough data, or a probe of one left unused too long."""
        c = self.config
        for source, cap in caps.items():
            if self.sources[source].acceptance.rounds < c.warmup_rounds:
                return Choice(source, min(fixed_gamma or c.default_gamma, cap), "warmup")
        for source, cap in caps.items():
            clock = self.sources[source].clock
            if clock.idle >= clock.interval:
                clock.interval = min(2 * clock.interval, c.max_probe_interval)
                return Choice(source, min(fixed_gamma or c.probe_gamma, cap), "probe")
        return None

    def _best(self, caps: dict[Proposer, int], fixed_gamma: int | None, lookup_order: int = 0,
              load: int = 1, max_tree_nodes: int = 0) -> Choice:
        """The eligible source and γ (a draft round: or tree) with the largest estimated speedup;
        none when no source beats plain decoding (with a fixed γ a source is always used)."""
        options = []
        for source, cap in caps.items():
            alpha = (self.lookup_alpha(lookup_order) if source == Proposer.PROMPT_LOOKUP else self.alpha(source)) or 0.0
            if fixed_gamma is not None:
                gamma = min(fixed_gamma, cap)
                speedup = expected_tokens(alpha, gamma) / self.costs.relative_cost(source, gamma, load)
            else:
                costs = self.costs.relative_costs(source, min(cap, self.config.max_gamma), load)
                gamma, speedup = _argmax_speedup(alpha, costs)
            best = Choice(source, gamma, "best", speedup) if gamma > 0 else None
            if source == Proposer.DRAFT and max_tree_nodes > 0:  # a tree where it beats the chain
                tree = self._best_tree(alpha, min(cap, self.config.max_gamma), min(max_tree_nodes, cap), load)
                if tree is not None and tree.speedup > (best.speedup if best else 1.0) * (
                        1.0 + self.config.tree_min_gain):
                    best = tree
            if best is not None:
                options.append(best)
        if not options:
            return Choice(Proposer.NONE, 0, "best")
        top = max(options, key=lambda option: option.speedup)  # ties: the first (draft)
        if fixed_gamma is None and top.speedup <= 1.0 + self.config.min_gain:
            return Choice(Proposer.NONE, 0, "best")
        if top.speedup > 1.0 + self.config.min_gain:  # it wins (not merely forced by a fixed γ):
            # once it stops, it is probed soon (its α may have dipped on a few rounds)
            self.sources[top.source].clock.interval = self.config.lapsed_probe_interval
        return top

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
        """Book-keeping: the chosen source is fresh, the other eligible ones idle one more round."""
        for source in caps:
            clock = self.sources[source].clock
            clock.idle = 0 if source == choice.source else clock.idle + 1
        return choice
