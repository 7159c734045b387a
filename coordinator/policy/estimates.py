"""The estimates a session's policy chooses by (session_policy.py has the model they serve):
E(α, γ) and its tree form, the speedup of a round, α from accept/reject trials
(`AcceptanceEstimate`), and the round costs (`CostModel`: t_verify(n) and, per source,
t_propose(γ), as exponentially weighted linear fits)."""

from __future__ import annotations

import copy
from typing import Sequence

from specdec.maths.tree import TREE_WIDTH
from specdec.types import Source

SOURCES = (Source.DRAFT, Source.PROMPT_LOOKUP, Source.HEADS)  # the sources that propose tokens


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
    check_alpha(alpha)
    if not 0 <= depth <= nodes:
        raise ValueError(f"need 0 <= depth <= nodes, got {depth}, {nodes}")
    return tree_expected_tokens_by_depth([alpha] * depth, branch_alpha, nodes, width)


def tree_expected_tokens_by_depth(alphas: Sequence[float], branch_alpha: float, nodes: int,
                                  width: int = TREE_WIDTH) -> float:
    """`tree_expected_tokens` with an α of its own per depth (alphas[i − 1]: the spine's node at
    depth i accepted once its parent was), for proposals whose accuracy falls with the depth
    (the target's heads: head i guesses i tokens past the target's own). The spine is
    len(alphas) deep; the alternative r at depth i adds α_1…α_(i−1)·(1 − α_i)·b·(1 − b)^(r−2)."""
    for alpha in alphas:
        check_alpha(alpha)
    check_alpha(branch_alpha)
    depth = len(alphas)
    if not 0 <= depth <= nodes:
        raise ValueError(f"need 0 <= depth <= nodes, got {depth}, {nodes}")
    tokens, reach, adds = 1.0, 1.0, []  # reach: α_1…α_(i−1), the spine accepted to depth i − 1
    for alpha in alphas:
        adds += [reach * (1.0 - alpha) * branch_alpha * (1.0 - branch_alpha) ** (r - 2) for r in range(2, width + 1)]
        reach *= alpha
        tokens += reach
    return tokens + sum(sorted(adds, reverse=True)[:nodes - depth])


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
    check_alpha(alpha)
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


def check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")


def spread_speedup(speedup: float, switch_steps: float, tokens_left: int) -> float:
    """The speedup over the rest of a request (`tokens_left` tokens) of a source whose rounds run
    at `speedup` once it is in use but which first costs `switch_steps` plain-decode steps more:
    tokens_left / (switch_steps + tokens_left / speedup). What a switch costs is spread over the
    tokens it serves: the draft catching up on history it lacks is worth it for a long answer,
    not for the last few tokens. No switching cost or no horizon (0): `speedup`."""
    if switch_steps <= 0 or tokens_left <= 0 or speedup <= 0:
        return speedup
    return tokens_left / (switch_steps + tokens_left / speedup)


def argmax_speedup(alpha: float, relative_costs: list[float]) -> tuple[int, float]:
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
        # the draft prefilling history it lacks (a new session's prompt, the tokens committed by
        # rounds it did not propose) before its proposal, against those tokens: what a draft
        # round costs more when the draft lags (`relative_catch_up`)
        self.catch_up = LinearFit(decay, "proportional")

    def for_another_draft(self) -> "CostModel":
        """The costs of another draft model: this one's verify fit and prompt lookup's (the
        target's and the coordinator's own, shared with it), fits of its own for the draft's
        steps and trees (a pinned cost ratio stays pinned)."""
        other = copy.copy(self)
        other.propose = {**self.propose, Source.DRAFT: LinearFit(self.verify.decay, "proportional")}
        other.tree_propose = LinearFit(self.verify.decay, "proportional")
        other.catch_up = LinearFit(self.verify.decay, "proportional")
        return other

    def observe_verify(self, tokens: int, seconds: float) -> None:
        self.verify.observe(tokens, seconds)

    def observe_propose(self, source: Source, gamma: int, seconds: float) -> None:
        self.propose[source].observe(gamma, seconds)

    def observe_tree_propose(self, depth: int, seconds: float) -> None:
        """The draft grew a tree `depth` deep (one forward per depth) in `seconds`."""
        self.tree_propose.observe(depth, seconds)

    def observe_catch_up(self, tokens: int, gamma: int, seconds: float) -> None:
        """A draft call that first prefilled `tokens` history tokens it lacked, then proposed γ,
        took `seconds`: the part beyond the fitted t_propose(γ) is the catch-up's (left out while
        the draft's steps are unmeasured: the catch-up could not be told apart)."""
        propose = self.propose[Source.DRAFT].predict(gamma)
        if propose is not None and tokens > 0:
            self.catch_up.observe(tokens, max(0.0, seconds - propose))

    def relative_catch_up(self, tokens: int, load: int = 1) -> float:
        """The draft catching up on `tokens` history tokens, in plain-decode steps (t_verify(load)).
        Unmeasured: 0 (free, as the round's own fit prices nothing of it)."""
        seconds, t1 = self.catch_up.predict(tokens) if tokens > 0 else None, self.verify_seconds(1, load)
        return seconds / t1 if seconds is not None and t1 else 0.0

    def relative_cost(self, source: Source, gamma: int, load: int = 1) -> float:
        """(t_propose(γ) + t_verify(load·(γ + 1))) / t_verify(load): a round's cost in plain-decode
        steps when `load` alike sessions share the target's batches.

        Unmeasured: the draft costs `default_cost_ratio` per token, prompt lookup nothing, and
        verification is flat."""
        return self.relative_costs(source, max(gamma, 0), load)[-1]

    def verify_seconds(self, tokens: int, load: int = 1) -> float | None:
        """t_verify of a round of `tokens` when `load` alike sessions share the batches (None:
        not measured yet)."""
        return self.verify.predict(max(1, load) * tokens)

    def steps_within(self, source: Source, seconds: float) -> int | None:
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
        return self._relative(Source.DRAFT, [(depth, nodes + 1)], load, tree)[0]

    def relative_heads_cost(self, nodes: int, load: int = 1) -> float:
        """t_verify(load·(nodes + 1)) / t_verify(load): a round proposing the target's heads'
        tree of `nodes` nodes in plain-decode steps; it makes no model call but the Verify
        (the heads were read in the round before). Unmeasured: 1 (verification flat)."""
        return self._relative(Source.HEADS, [(0, nodes + 1)], load)[0]

    def relative_costs(self, source: Source, max_gamma: int, load: int = 1) -> list[float]:
        """`relative_cost(source, γ, load)` for γ = 0 .. max_gamma (the fits solved once)."""
        return [1.0] + self._relative(source, [(gamma, gamma + 1) for gamma in range(1, max_gamma + 1)], load)

    def _relative(self, source: Source, rounds: list[tuple[int, int]], load: int,
                  propose: tuple[float, float] | None = None) -> list[float]:
        """Per (proposal steps, verified tokens) of a round, (t_propose(steps) +
        t_verify(load·verified)) / t_verify(load), the fits solved once (`propose`: t_propose's
        coefficients instead of the source's chain fit)."""
        verify, propose = self.verify.coefficients(), propose or self.propose[source].coefficients()
        load = max(1, load)
        t1 = None if verify is None else verify[0] + verify[1] * load
        default = self.default_cost_ratio if source == Source.DRAFT else 0.0
        if t1 is None or t1 <= 0:
            return [1.0 + default * steps for steps, _ in rounds]
        return [((default * steps * t1 if propose is None else propose[0] + propose[1] * steps)
                 + verify[0] + verify[1] * load * verified) / t1 for steps, verified in rounds]
