"""Token trees in the adaptive policy: the expected tokens of a tree, and the choice between
chains and trees under pinned costs and acceptance (no timing)."""

from __future__ import annotations

import pytest

from coordinator.policy.estimates import CostModel, expected_tokens, tree_budgets, tree_expected_tokens
from coordinator.policy.session_policy import PolicyConfig, SessionPolicy
from coordinator.policy.speculation import FixedCosts, Speculation, auto_tree_budget
from specdec.maths.tree import TokenTree
from specdec.types import Source, Trees
from tests.planning import plan_round

pytestmark = pytest.mark.unit

VERIFY_S = 0.1   # one target forward of one token
STEP_S = 0.01    # one draft forward: c = 0.1
UNSURE, SURE = 0.4, 0.95


def test_a_tree_of_its_depth_is_the_chain_and_alternatives_add_what_they_are_worth():
    assert tree_expected_tokens(0.5, 0.5, 3, 3) == pytest.approx(expected_tokens(0.5, 3))
    # depth 2, one alternative: the best is beside the first spine node, (1 − α)·b = 0.25
    assert tree_expected_tokens(0.5, 0.5, 2, 3) == pytest.approx(1.75 + 0.25)
    # then a third-ranked beside the first (0.125) and a second-ranked beside the second (0.125)
    assert tree_expected_tokens(0.5, 0.5, 2, 5) == pytest.approx(1.75 + 0.25 + 0.125 + 0.125)
    # at most width − 1 alternatives a depth: depth 1 holds 4 nodes, more add nothing
    assert tree_expected_tokens(0.5, 0.5, 1, 4) == tree_expected_tokens(0.5, 0.5, 1, 9)
    assert tree_expected_tokens(1.0, 0.9, 3, 12) == pytest.approx(4.0)  # a sure draft gains nothing
    assert tree_budgets(2, 8) == [4, 8] and tree_budgets(3, 8) == [6] and tree_budgets(5, 8) == []
    with pytest.raises(ValueError):
        tree_expected_tokens(0.5, 0.5, 4, 3)


def pinned_policy(alpha: float, verify_slope: float, max_gamma: int = 8) -> SessionPolicy:
    """A policy whose draft α and round costs are pinned: verify(n) = VERIFY_S + slope·(n − 1)
    observed at every n, the draft STEP_S per step, α seeded with many trials."""
    costs = CostModel(decay=1.0)
    for n in range(1, max_gamma + 2):
        costs.observe_verify(n, VERIFY_S + verify_slope * (n - 1))
        costs.observe_propose(Source.DRAFT, n, STEP_S * n)
    policy = SessionPolicy(PolicyConfig(max_gamma=max_gamma), costs)
    policy.seed(Source.DRAFT, alpha, 10_000)
    return policy


def choose(policy: SessionPolicy, max_tree_nodes: int = 8, **kw):
    return policy.choose(max_gamma=8, max_tree_nodes=max_tree_nodes, **kw)


def test_a_flat_verify_curve_and_an_unsure_draft_choose_a_tree():
    choice = choose(pinned_policy(UNSURE, 0.0))
    assert choice.source == Source.DRAFT and choice.tree_nodes > choice.gamma
    chain = choose(pinned_policy(UNSURE, 0.0), max_tree_nodes=0)
    assert chain.tree_nodes == 0 and choice.speedup > chain.speedup


@pytest.mark.parametrize("alpha, slope", [(UNSURE, 0.02), (SURE, 0.0), (SURE, 0.02)],
                         ids=["steep-unsure", "flat-sure", "steep-sure"])
def test_a_steep_verify_curve_or_a_sure_draft_choose_a_chain(alpha, slope):
    choice = choose(pinned_policy(alpha, slope))
    assert choice.source == Source.DRAFT and choice.gamma > 0 and choice.tree_nodes == 0


def test_trees_cannot_exceed_the_rounds_cap():
    choice = pinned_policy(UNSURE, 0.0).choose(max_gamma=3, max_tree_nodes=8)
    assert 0 < choice.tree_nodes <= 3


def test_a_fixed_gamma_is_a_chain():
    choice = choose(pinned_policy(UNSURE, 0.0), fixed_gamma=3)
    assert tuple(choice) == (Source.DRAFT, 3) and choice.tree_nodes == 0


def test_the_measured_branch_acceptance_moves_the_choice():
    policy = pinned_policy(UNSURE, 0.0)
    assert policy.branch_alpha(UNSURE) == pytest.approx(UNSURE * 0.5)  # the prior
    for _ in range(200):  # alternatives that are never right
        policy.observe_branches(3, 0)
    assert policy.branch_alpha(UNSURE) < 0.02
    assert choose(policy).tree_nodes == 0


def test_auto_tree_budget_only_where_the_pair_and_the_request_allow():
    assert auto_tree_budget(Trees.AUTO, 0, None, True, 8) == 8
    assert auto_tree_budget(Trees.OFF, 0, None, True, 8) == 0       # the coordinator's --trees off
    assert auto_tree_budget(Trees.AUTO, 1, None, True, 8) == 0       # the request asks for chains
    assert auto_tree_budget(Trees.AUTO, 6, None, True, 8) == 0       # ... or for its own tree size
    assert auto_tree_budget(Trees.AUTO, 0, 4, True, 8) == 0          # a fixed γ stays a chain
    assert auto_tree_budget(Trees.AUTO, 0, None, False, 8) == 0      # a chain-only target or draft


def flat_speculation(trees: Trees = Trees.AUTO) -> Speculation:
    """Leviathan's flat verification (pinned c) and an unsure draft over all sessions."""
    spec = Speculation(8, 4, cost_ratio=0.1, trees=trees)
    prior = spec.priors[Source.DRAFT]
    prior.successes, prior.trials, prior.rounds = UNSURE * 1000, 1000.0, 100
    return spec


def plans(spec: Speculation, rounds: int = 20, **start):
    request = spec.start("s", start.pop("mode", Source.AUTO), start.pop("fixed_gamma", None), **start)
    history = list(range(50))  # no repeats: prompt lookup finds nothing
    return [plan_round(request, history, 8, True) for _ in range(rounds)]


def test_auto_requests_get_trees_and_a_chain_only_pair_or_off_never():
    assert any(p.tree_nodes for p in plans(flat_speculation(), pair_grows_trees=True))
    assert not any(p.tree_nodes for p in plans(flat_speculation(), pair_grows_trees=False))
    assert not any(p.tree_nodes for p in plans(flat_speculation(Trees.OFF), pair_grows_trees=True))
    assert not any(p.tree_nodes for p in plans(flat_speculation(), pair_grows_trees=True, tree_nodes=1))
    assert all(p.tree_nodes == 6 for p in plans(flat_speculation(Trees.OFF), pair_grows_trees=True,
                                                tree_nodes=6, mode=Source.DRAFT, fixed_gamma=3))


@pytest.mark.parametrize("cap", [1, 2, 3])
def test_a_tree_reaches_no_deeper_than_the_room_left(cap):
    """Near the end of the context (or of max_new_tokens) the round's cap bounds a tree by its
    depth: the draft's γ and every grafted lookup branch, whatever the node count asked for
    (the target checks the depth against the context, not the nodes)."""
    spec = flat_speculation()
    believing = spec.policy("s")  # a sure draft, and lookup believed enough to graft its tokens on
    believing.draft_prior = None
    believing.seed(Source.DRAFT, 0.9, 10_000)
    believing.seed(Source.PROMPT_LOOKUP, 0.5, 10_000)
    request = spec.start("s", Source.AUTO, None, tree_nodes=8, pair_grows_trees=True)
    history = [1, 2, 3, 4, 5] * 6  # prompt lookup's continuations are long
    for plan in [plan_round(request, history, cap, True) for _ in range(10)]:
        assert plan.source == Source.DRAFT and plan.tree_nodes == 8 and 0 < plan.gamma <= cap
        assert plan.branches and all(len(branch) <= cap for branch in plan.branches)


def test_prompt_lookup_rounds_are_never_trees():
    spec = flat_speculation()
    request = spec.start("s", Source.PROMPT_LOOKUP, None, pair_grows_trees=True)
    history = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
    planned = [plan_round(request, history, 8, True) for _ in range(10)]
    assert {p.source for p in planned} == {Source.PROMPT_LOOKUP} and not any(p.tree_nodes for p in planned)


def test_a_tree_round_feeds_the_spine_to_alpha_and_its_alternatives_to_b():
    #      root
    #     /  |  \
    #   n0  n1  n2      n0 the spine, n1 n2 alternatives
    #   |
    #   n3              the spine
    tree = TokenTree((5, 6, 7, 8), (0, 0, 0, 1))
    spec = Speculation(8, 4, cost_ratio=0.1, trees=Trees.AUTO)
    request = spec.start("s", Source.AUTO, None, pair_grows_trees=True)
    request.observe(Source.DRAFT, 4, 1, propose_seconds=None, verify_seconds=None, verified_tokens=5,
                    tree=tree, accepted_nodes=(2,))  # the spine's n0 rejected, n1 tried, n2 accepted
    own = request.policy.sources[Source.DRAFT].acceptance
    assert (own.successes, own.trials) == (0, 1)  # the spine: 0 of 2 accepted, one failure
    assert (spec.branch.successes, spec.branch.trials) == (1, 2)
    request.observe(Source.DRAFT, 4, 2, propose_seconds=None, verify_seconds=None, verified_tokens=5,
                    tree=tree, accepted_nodes=(0, 3))  # the whole spine
    assert (own.successes, own.trials) == (pytest.approx(2), pytest.approx(2.9)) and spec.branch.trials == 2


def test_pinned_costs_price_a_tree_by_its_depth():
    costs = FixedCosts(0.1)
    assert costs.relative_tree_cost(3, 12) == pytest.approx(1.3)
    measured = CostModel(decay=1.0)
    for n in (1, 5):
        measured.observe_verify(n, 0.1 + 0.02 * (n - 1))
    measured.observe_propose(Source.DRAFT, 2, 0.02)
    measured.observe_propose(Source.DRAFT, 4, 0.04)
    # (t_propose(2) + t_verify(9)) / t_verify(1) = (0.02 + 0.26) / 0.1
    assert measured.relative_tree_cost(2, 8) == pytest.approx(2.8)


def test_tree_rounds_are_timed_apart_from_the_chains_steps():
    """A tree's draft forwards carry several nodes: tree rounds' times go to a fit of their own,
    which prices trees once it has data, and leave the chains' step cost alone."""
    costs = CostModel(decay=1.0)
    for n in (1, 5):
        costs.observe_verify(n, 0.1 + 0.02 * (n - 1))
    policy = SessionPolicy(PolicyConfig(max_gamma=8), costs)
    policy.observe(Source.DRAFT, 2, 2, propose_seconds=0.02)  # chains: 0.01 s a step
    policy.observe(Source.DRAFT, 4, 4, propose_seconds=0.04)
    chain_before = costs.relative_cost(Source.DRAFT, 4)
    assert costs.relative_tree_cost(2, 8) == pytest.approx((0.02 + 0.26) / 0.1)  # priced as chain steps
    policy.observe(Source.DRAFT, 2, 1, propose_seconds=0.06, tree=True)  # trees: 0.03 s a depth
    policy.observe(Source.DRAFT, 4, 4, propose_seconds=0.12, tree=True)
    assert costs.relative_cost(Source.DRAFT, 4) == chain_before
    assert costs.relative_tree_cost(2, 8) == pytest.approx((0.06 + 0.26) / 0.1)
    # through the planner: a tree round's time is its spine's depth in the tree fit
    spec = Speculation(8, 4, trees=Trees.AUTO)
    request = spec.start("s", Source.AUTO, None, pair_grows_trees=True)
    tree = TokenTree((5, 6, 7, 8), (0, 0, 0, 1))
    request.observe(Source.DRAFT, 4, 2, propose_seconds=0.05, verify_seconds=None, verified_tokens=5,
                    tree=tree, accepted_nodes=(0, 3))
    assert spec.costs.tree_propose.w == 1.0 and spec.costs.propose[Source.DRAFT].w == 0.0
