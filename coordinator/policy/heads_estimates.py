"""What the planner knows of the target's Medusa-style heads, and the heads round it prices.

A target serving heads returns, with a Verify that asks, each head's top candidates for the
tokens past the one it chose; the next round may verify them as a token tree
(coordinator/sources/heads_source.py builds it: depth d from head d, nodes by path score). That round
makes no model call but the Verify: it costs t_verify(n + 1) for n nodes and no proposal time.

What it commits is priced with the token-tree model the draft's trees use
(`estimates.tree_expected_tokens_by_depth`): the tree's spine (each head's likeliest token)
accepted per depth, plus alternatives beside the spine node the target rejected, each taken
with probability b. **Why an α per depth**: head d guesses the token d positions past the
target's own from the same hidden state, so its guesses get worse with d (Medusa reports each
further head's top-1 accuracy well below the one before); one α over all depths would price a deep
node as likely as a shallow one and grow trees too deep where each verified token costs. α_d is
measured on the spines of heads rounds (a success where the accepted path went on along the
spine to depth d, a failure where it stopped or left it there), b on the alternatives tried, so
every tree size is priced from the same numbers and none needs warm-up rounds of its own.

The heads belong to the target, not to a session: α per depth and b are kept over all sessions
per set of heads (`DepthAcceptance`, keyed by ModelInfo.heads_id, so new heads start afresh),
and a session's own α_d keeps `prior_weight` trials of the coordinator's (as the draft's α
does, `PolicyConfig.draft_prior_weight`). b is the coordinator's only, as the draft's is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from specdec.maths.tree import TreeOutcome

from coordinator.policy.estimates import AcceptanceEstimate, tree_budgets, tree_expected_tokens_by_depth


@dataclass(frozen=True)
class HeadsAtHand:
    """What a round could propose from the heads the round before read."""

    depth: int      # heads with candidates: the deepest tree they make (head d proposes depth d)
    max_nodes: int  # the most nodes a round may verify (the services' limit)
    width: int      # candidates per head: the most children a node gets
    trees: bool = True  # the target verifies trees (else a heads round is the chain of their top tokens)

    def nodes_most(self, depth: int) -> int:
        """The most nodes a heads round `depth` deep may propose (0: it may not be that deep)."""
        most = min(self.max_nodes, depth * self.width) if self.trees else depth
        return most if depth <= most else 0


class DepthAcceptance:
    """α per depth of the heads trees' spines, and b of their alternatives, from heads rounds."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.depths: list[AcceptanceEstimate] = []  # [d - 1]: the spine's node at depth d, its parent accepted
        self.branch = AcceptanceEstimate(decay)     # an alternative beside the spine node rejected
        self.rounds = 0                             # heads rounds observed

    def at(self, depth: int) -> AcceptanceEstimate | None:
        return self.depths[depth - 1] if 0 < depth <= len(self.depths) else None

    def observe(self, outcome: TreeOutcome) -> None:
        """A heads round: its spine accepted to `spine_accepted` (one trial per depth reached, a
        failure at the next one it proposed), its alternatives tried beside the rejected node."""
        if outcome.spine_proposed <= 0:
            return
        self.rounds += 1
        tried = min(outcome.spine_accepted + 1, outcome.spine_proposed)
        while len(self.depths) < tried:
            self.depths.append(AcceptanceEstimate(self.decay))
        for depth in range(1, tried + 1):
            self.depths[depth - 1].observe_trials(1, int(depth <= outcome.spine_accepted))
        self.branch.observe_trials(outcome.alternatives_tried, outcome.alternatives_accepted)


@dataclass
class SessionHeads:
    """A session's view of one set of heads: its own α per depth, mixed with the coordinator's."""

    heads_id: str                  # ModelInfo.heads_id of the heads it learnt on
    shared: DepthAcceptance        # the coordinator's estimates of those heads (shared)
    prior_weight: float = 20.0     # trials' worth of the coordinator's α_d a session's α_d keeps
    warmup_rounds: int = 2         # the coordinator's α_d counts once it has this many rounds
    branch_prior_ratio: float = 0.5  # before b is measured: α_1 times this, ...
    branch_prior_weight: float = 2.0  # ... worth this many trials
    decay: float = 0.9             # weight the session's own trials keep per observed round
    own: DepthAcceptance = field(init=False)  # this session's own trials

    def __post_init__(self) -> None:
        self.own = DepthAcceptance(self.decay)

    @property
    def warmed_up(self) -> bool:
        """The coordinator has measured these heads (a new session need not warm them up)."""
        return self.shared.rounds >= self.warmup_rounds

    def alpha(self, depth: int) -> float | None:
        """α at `depth`: the session's own trials plus `prior_weight` of the coordinator's α
        there once that has `warmup_rounds` rounds (None: neither measured it)."""
        own, shared = self.own.at(depth), self.shared.at(depth)
        prior = shared.alpha if shared is not None and shared.rounds >= self.warmup_rounds else None
        if prior is None:
            return None if own is None else own.alpha
        successes, trials = (own.successes, own.trials) if own is not None else (0.0, 0.0)
        return (successes + self.prior_weight * prior) / (trials + self.prior_weight)

    def alphas(self, depth: int) -> list[float]:
        """α_1..α_depth; a depth not measured yet takes the one above it's (0 at depth 1)."""
        out: list[float] = []
        for d in range(1, depth + 1):
            alpha = self.alpha(d)
            out.append(alpha if alpha is not None else (out[-1] if out else 0.0))
        return out

    def branch_alpha(self, alpha1: float) -> float:
        """b over all sessions, holding `branch_prior_weight` trials of α_1·`branch_prior_ratio`."""
        branch, weight = self.shared.branch, self.branch_prior_weight
        return (branch.successes + weight * alpha1 * self.branch_prior_ratio) / (branch.trials + weight)

    def observe(self, outcome: TreeOutcome) -> None:
        self.own.observe(outcome)
        self.shared.observe(outcome)

    def best_round(self, at_hand: HeadsAtHand, max_depth: int, cost: Callable[[int], float],
                   fixed_nodes: int | None = None) -> tuple[int, int, float] | None:
        """(depth, nodes, estimated speedup) of the heads round with the largest expected tokens
        per plain-decode step (`cost(nodes)`: its Verify's relative cost), at most `max_depth`
        deep; `fixed_nodes`: that many nodes (a fixed γ). None: no depth fits."""
        depth_cap = min(max_depth, at_hand.depth)
        if depth_cap < 1:
            return None
        alphas = self.alphas(depth_cap)
        b = self.branch_alpha(alphas[0])
        best: tuple[int, int, float] | None = None
        for depth in range(1, depth_cap + 1):
            for nodes in heads_budgets(depth, at_hand, fixed_nodes):
                speedup = tree_expected_tokens_by_depth(alphas[:depth], b, nodes, at_hand.width) / cost(nodes)
                if best is None or speedup > best[2]:
                    best = (depth, nodes, speedup)
        return best


def heads_budgets(depth: int, at_hand: HeadsAtHand, fixed_nodes: int | None = None) -> list[int]:
    """The node budgets weighed for a heads tree `depth` deep: its spine alone, twice and four
    times its depth, and the most it may hold (at most `width` nodes a depth, the round's
    limit; the depth where the target verifies chains only); with `fixed_nodes`, that many (or
    the depth, when fewer)."""
    most = at_hand.nodes_most(depth)
    if not most:
        return []
    if fixed_nodes is not None:
        return [max(depth, min(fixed_nodes, most))]
    return sorted({depth, most, *tree_budgets(depth, most)})


def warmup_nodes(depth: int, at_hand: HeadsAtHand) -> int:
    """The nodes of a warm-up or probe heads round `depth` deep: twice its depth, where it may."""
    return max(depth, min(2 * depth, at_hand.nodes_most(depth)))
