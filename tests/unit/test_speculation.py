"""The per-round planner on hand-built histories: proposer overrides, prompt-lookup plans with
one-hot proposals, coordinator-wide priors, the fixed cost ratio and the policy LRU."""

from __future__ import annotations

import pytest

from coordinator.policy.speculation import FixedCosts, Speculation
from coordinator.sources.base import one_hot_dists
from coordinator.sources.prompt_lookup import PromptLookup
from specdec.types import SparseDist
from tests.planning import plan_round

HISTORY = [5, 6, 7, 8, 1, 2, 5, 6, 7]  # the suffix 5 6 7 occurred before, followed by 8 1 2


def speculation(**kwargs) -> Speculation:
    return Speculation(max_gamma=8, default_gamma=4, **kwargs)


def test_one_hot_dists():
    assert one_hot_dists([4, 9]) == [SparseDist((4,), (1.0,)), SparseDist((9,), (1.0,))]


def test_ngram_plan_carries_the_looked_up_tokens():
    spec = speculation().start("s", "ngram", None)
    plan = plan_round(spec, HISTORY, cap=3, draft_available=True)
    assert (plan.source, plan.gamma, plan.tokens, plan.reason) == ("ngram", 3, [8, 1, 2], "warmup")
    # no match: nothing to propose, plain decoding
    assert plan_round(spec, [1, 2, 3], cap=3, draft_available=True).source == "none"


def test_overrides():
    spec = speculation()
    assert plan_round(spec.start("a", "none", None), HISTORY, 8, True).source == "none"
    assert plan_round(spec.start("b", "auto", 0), HISTORY, 8, True).gamma == 0
    fixed = plan_round(spec.start("c", "draft", 5), HISTORY, 8, True)
    assert (fixed.source, fixed.gamma, fixed.tokens) == ("draft", 5, [])
    assert plan_round(spec.start("d", "draft", 5), HISTORY, 2, True).gamma == 2  # the round's cap wins
    assert plan_round(spec.start("e", "draft", None), HISTORY, 8, False).source == "none"  # draft down
    assert plan_round(spec.start("f", "ngram", 2), HISTORY, 8, True).tokens == [8, 1]
    assert not spec.start("g", "ngram", None).uses_draft and spec.start("h", "auto", None).uses_draft
    with pytest.raises(ValueError):
        spec.start("i", "eagle", None)


def test_new_sessions_start_from_the_coordinator_wide_alpha():
    spec = speculation(cost_ratio=0.1)
    first = spec.start("first", "draft", None)
    for _ in range(6):  # a draft that is always wrong
        plan = plan_round(first, HISTORY, 8, True)
        first.observe(plan.source, plan.gamma, 0, propose_seconds=None, verify_seconds=None,
                      verified_tokens=plan.gamma + 1)
    assert spec.priors["draft"].alpha == 0.0
    later = plan_round(spec.start("later", "draft", None), HISTORY, 8, True)
    assert (later.source, later.reason) == ("none", "best")  # no warm-up rounds spent on it
    # a continued session keeps its own policy
    assert spec.policy("first") is first.policy


def test_fixed_costs_are_leviathans():
    costs = FixedCosts(0.25)
    assert costs.relative_costs("draft", 3) == [1.0, 1.25, 1.5, 1.75]
    assert costs.relative_costs("ngram", 2) == [1.0, 1.0, 1.0]
    costs.observe_verify(4, 10.0)  # timings change nothing
    assert costs.relative_cost("draft", 2) == 1.5


def test_policies_are_bounded_and_forgettable():
    spec = speculation(max_sessions=2)
    a = spec.policy("a")
    spec.policy("b")
    spec.policy("c")
    assert spec.policy("a") is not a  # evicted, least recently used
    b = spec.policy("b")
    spec.forget("b")
    assert spec.policy("b") is not b


def test_bad_settings():
    with pytest.raises(ValueError):
        speculation(cost_ratio=-1.0)
    with pytest.raises(ValueError):
        PromptLookup(max_ngram=0, max_tokens=8)


def test_auto_draft_plans_carry_lookup_hints_and_draft_plans_do_not():
    spec = speculation(cost_ratio=0.1)
    auto = spec.start("a", "auto", None)
    plan = plan_round(auto, HISTORY, cap=6, draft_available=True)  # warm-up at γ = 4: the draft first
    assert (plan.source, plan.gamma, plan.tokens) == ("draft", 4, [8, 1])  # cap - γ hints
    assert plan_round(spec.start("b", "draft", None), HISTORY, 6, True).tokens == []
    assert plan_round(spec.start("c", "auto", 3), HISTORY, 6, True).tokens == []  # a fixed γ proposes γ
    assert plan_round(Speculation(8, 4, cost_ratio=0.1, draft_hints=False).start("d", "auto", None),
                      HISTORY, 6, True).tokens == []


def test_kept_hints_are_left_out_of_the_drafts_alpha():
    spec = speculation(cost_ratio=0.1)
    request = spec.start("s", "auto", None)
    # 2 hints kept + 3 own tokens, the target accepted both hints and 1 own: 1 of 3 own, then a miss
    request.observe("draft", 5, 3, propose_seconds=None, verify_seconds=None, verified_tokens=6, hints_kept=2)
    estimate = request.policy.sources["draft"].acceptance
    assert (estimate.successes, estimate.trials) == (1, 2)
    # the target rejected a kept hint: the draft's own tokens were never tried
    request.observe("draft", 5, 1, propose_seconds=None, verify_seconds=None, verified_tokens=6, hints_kept=2)
    assert (estimate.successes, estimate.trials) == (1, 2) and spec.priors["draft"].rounds == 1
    assert estimate.rounds == 2  # still a round: the draft's warm-up ends all the same


def test_lookup_alpha_per_match_length_reaches_new_sessions():
    spec = speculation()
    first = spec.start("first", "ngram", None)
    for _ in range(4):  # the 3-token suffix of HISTORY: always right
        plan = plan_round(first, HISTORY, 3, True)
        assert first._order == 3  # the match length of the planned lookup
        first.observe(plan.source, plan.gamma, plan.gamma, propose_seconds=0.0, verify_seconds=None,
                      verified_tokens=plan.gamma + 1)
    assert spec.order_priors[3].alpha == 1.0
    assert spec.start("later", "ngram", None).policy.lookup_alpha(3) == 1.0


def test_sessions_share_the_probes_of_a_draft_that_does_not_pay():
    """Sessions that start from the coordinator-wide draft α probe the draft on one clock: 20
    sessions of 30 plain rounds probe a useless draft at doubling intervals over all their
    rounds (16, 32, 64, ...), not once each at their own 16th round. A session's own rounds
    still warm up a source without a prior."""
    spec = speculation(cost_ratio=0.5)
    first = spec.start("first", "draft", None)
    for _ in range(2):  # the warm-up of a draft that is always wrong
        plan = plan_round(first, [1, 2, 3], 8, True)
        assert plan.reason == "warmup"
        first.observe(plan.source, plan.gamma, 0, propose_seconds=None, verify_seconds=None,
                      verified_tokens=plan.gamma + 1)
    probes = []
    for n in range(20):
        spec_n = spec.start(f"s{n}", "draft", None)
        for i in range(30):
            plan = plan_round(spec_n, [1, 2, 3], 8, True)
            spec_n.observe(plan.source, plan.gamma, 0, propose_seconds=None, verify_seconds=None,
                           verified_tokens=plan.gamma + 1)
            if plan.source == "draft":
                assert plan.reason == "probe"
                probes.append(30 * n + i)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) == 5 and probes[0] == 16  # 16, then +33, +65, +129, +257 (idle counts from 0)
    assert gaps == sorted(gaps) and gaps[-1] > 250


def test_a_new_text_session_is_believed_at_every_match_length():
    """The coordinator learnt prompt lookup on copying sessions (right at every match length).
    A session of new text, where lookup is always wrong and the draft always right, stops
    proposing lookups after its first failures at any length: it does not pay failed rounds at
    each match length in turn."""
    spec = speculation(cost_ratio=0.3)
    copying = spec.start("copying", "auto", None)
    for round_ in range(30):
        order = 1 + round_ % 3
        choice = copying.policy.choose(max_gamma=8, lookup_available=8, lookup_order=order)
        copying._order = order if choice.source == "ngram" else 0
        copying.observe(choice.source, choice.gamma, choice.gamma, propose_seconds=None,
                        verify_seconds=None, verified_tokens=choice.gamma + 1)
    assert all(spec.order_priors[order].alpha == 1.0 for order in (1, 2, 3))
    new_text = spec.start("new text", "auto", None)
    chosen_lookups = 0  # rounds the policy gave prompt lookup as the best source (not probes)
    for round_ in range(30):
        order = 1 + round_ % 3
        choice = new_text.policy.choose(max_gamma=8, lookup_available=8, lookup_order=order)
        new_text._order = order if choice.source == "ngram" else 0
        accepted = 0 if choice.source == "ngram" else choice.gamma
        chosen_lookups += choice.source == "ngram" and choice.reason == "best"
        new_text.observe(choice.source, choice.gamma, accepted, propose_seconds=None,
                         verify_seconds=None, verified_tokens=choice.gamma + 1)
    assert chosen_lookups <= 2  # learning each match length in turn, it was 6 (twice at each)
    assert max(new_text.policy.lookup_alpha(order) for order in (1, 2, 3)) < 0.5
    # a copying session that starts now is still believed at once
    assert spec.start("copying again", "auto", None).policy.lookup_alpha(3) == 1.0


def test_a_new_session_counts_the_coordinator_wide_draft_alpha_once():
    """A new session's draft α is the coordinator-wide one worth draft_prior_weight trials: its
    first round of the draft moves it as far as one round moves any session with no trials of
    its own (seeding it with trials as well would count the shared α twice)."""
    spec = speculation(cost_ratio=0.1)
    first = spec.start("first", "draft", None)
    for accepted in (4, 4, 2, 4, 0, 4):
        plan = plan_round(first, HISTORY, 4, True)
        first.observe(plan.source, plan.gamma, accepted, propose_seconds=None, verify_seconds=None,
                      verified_tokens=plan.gamma + 1)
    shared = spec.priors["draft"].alpha
    later = spec.start("later", "draft", None)
    assert later.policy.alpha("draft") == shared
    later.observe("draft", 4, 0, propose_seconds=None, verify_seconds=None, verified_tokens=5)
    weight = later.policy.config.draft_prior_weight
    prior_now = spec.priors["draft"].alpha  # the shared α took this round too
    assert later.policy.alpha("draft") == pytest.approx(weight * prior_now / (1 + weight))


def test_a_tree_round_carries_prompt_lookups_branch_where_lookup_would_pay():
    """An adaptive `auto` request's draft tree round carries prompt lookup's tokens, as many as
    a lookup round of its own would propose, to graft onto the draft's tree; a fixed γ (the tree
    the request asked for), the draft proposer alone, or a lookup that does not pay carry none."""
    spec = speculation(cost_ratio=0.1)

    def planned(name, mode, fixed_gamma, lookup_alpha):
        request = spec.start(name, mode, fixed_gamma, tree_nodes=4, pair_grows_trees=True)
        request.policy.seed("draft", 0.95, 100)
        request.policy.seed("ngram", lookup_alpha, 100)
        return plan_round(request, HISTORY, 8, True)

    plan = planned("auto", "auto", None, 0.5)
    # verification is flat under a pinned cost ratio: lookup's 8 tokens all pay (the copy of
    # 8 1 2 runs on into the suffix it matched)
    assert (plan.source, plan.tree_nodes, plan.branches) == ("draft", 4, [[8, 1, 2, 5, 6, 7, 8, 1]])
    assert planned("fixed", "auto", 3, 0.5).branches == []
    assert planned("draft only", "draft", None, 0.5).branches == []
    assert planned("useless lookup", "auto", None, 0.0).branches == []
    # a suffix seen three times before: what followed each, the latest first
    request = spec.start("several", "auto", None, tree_nodes=4, pair_grows_trees=True)
    request.policy.seed("draft", 0.95, 100)
    request.policy.seed("ngram", 0.5, 100)
    several = plan_round(request, [4, 9, 1, 4, 9, 2, 4, 9, 3, 4, 9], 3, True)
    assert several.branches == [[3, 4, 9], [2, 4, 9], [1, 4, 9]]
