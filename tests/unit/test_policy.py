"""Adaptive γ and proposal source: simulated sessions with known acceptance and round costs."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from coordinator.policy.estimates import (
    AcceptanceEstimate, CostModel, LinearFit, best_gamma, expected_tokens, leviathan_speedup,
)
from coordinator.policy.session_policy import PolicyConfig, SessionPolicy

VERIFY_S = 0.1  # seconds of one target forward (flat unless a test says otherwise)


def accepted_count(rng: random.Random, alpha: float, gamma: int) -> int:
    """Leading successes among γ independent trials with probability α."""
    count = 0
    while count < gamma and rng.random() < alpha:
        count += 1
    return count


def simulate(policy: SessionPolicy, rounds: int, alpha: dict, step_cost: dict, *, seed: int = 0,
             lookup_available: int = 0, max_gamma: int | None = None, **overrides) -> list:
    """Run `rounds` rounds; the draft costs step_cost[source]·VERIFY_S per proposed token."""
    rng = random.Random(seed)
    choices = []
    for _ in range(rounds):
        choice = policy.choose(max_gamma=max_gamma, lookup_available=lookup_available, **overrides)
        source, gamma = choice
        accepted = accepted_count(rng, alpha.get(source, 0.0), gamma)
        policy.observe(source, gamma, accepted,
                       propose_seconds=step_cost.get(source, 0.0) * VERIFY_S * gamma if gamma else None,
                       verify_seconds=VERIFY_S * (1 + 0.01 * (gamma + 1)), verified_tokens=gamma + 1)
        choices.append(choice)
    return choices


def test_leviathan_speedup_values():
    assert leviathan_speedup(0.8, 4, 0.0) == pytest.approx((1 - 0.8 ** 5) / 0.2)
    assert leviathan_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8 ** 5) / 0.2 / 1.4)
    assert leviathan_speedup(1.0, 4, 0.25) == pytest.approx(5 / 2)
    assert leviathan_speedup(0.3, 0, 0.5) == 1.0
    assert expected_tokens(0.0, 7) == 1.0


@settings(max_examples=400, deadline=None)
@given(alpha=st.floats(0.0, 1.0), c=st.floats(0.0, 3.0), max_gamma=st.integers(0, 40))
@example(alpha=0.9999922623185702, c=0.9999922623185702, max_gamma=1)  # α near 1: the closed form cancelled
def test_best_gamma_is_the_brute_force_argmax(alpha, c, max_gamma):
    gamma = best_gamma(alpha, c, max_gamma)
    values = [leviathan_speedup(alpha, g, c) for g in range(max_gamma + 1)]
    assert 0 <= gamma <= max_gamma
    assert values[gamma] >= max(values) * (1 - 1e-12)


def test_best_gamma_known_points_and_bad_input():
    assert best_gamma(1.0, 0.05, 12) == 12
    assert best_gamma(0.0, 0.05, 12) == 0
    assert best_gamma(0.8, 0.4, 16) < best_gamma(0.8, 0.05, 16)
    with pytest.raises(ValueError):
        best_gamma(1.5, 0.1, 4)
    with pytest.raises(ValueError):
        best_gamma(0.5, -0.1, 4)


def test_draft_always_right_gamma_rises_to_the_max():
    policy = SessionPolicy(PolicyConfig(max_gamma=8))
    choices = simulate(policy, 60, {"draft": 1.0}, {"draft": 0.05})
    assert choices[0].reason == "warmup" and choices[0].gamma == 4
    assert [tuple(c) for c in choices[-20:]] == [("draft", 8)] * 20
    assert policy.alpha("draft") == 1.0
    # the round's own cap (tokens left, context room) still wins
    assert tuple(policy.choose(max_gamma=3)) == ("draft", 3)


def test_draft_always_wrong_gamma_falls_to_zero_and_probes_stay_bounded():
    config = PolicyConfig(max_gamma=8, probe_interval=16, max_probe_interval=256)
    policy = SessionPolicy(config)
    choices = simulate(policy, 2000, {"draft": 0.0}, {"draft": 0.05})
    drafted = [i for i, c in enumerate(choices) if c.source == "draft"]
    assert all(c.gamma == 0 for c in choices if c.source == "none")
    assert [c.reason for c in choices if c.source == "draft"][:2] == ["warmup", "warmup"]
    # after the warm-up only probes, at doubling intervals 16, 32, ... 256, then every 256
    probes = [i for i in drafted if choices[i].reason == "probe"]
    assert len(drafted) == 2 + len(probes)
    gaps = [b - a - 1 for a, b in zip(drafted[1:], drafted[2:])]
    assert gaps[:5] == [16, 32, 64, 128, 256] and set(gaps[5:]) == {256}
    assert len(probes) <= math.ceil(math.log2(256 / 16)) + 1 + 2000 // 256
    assert policy.alpha("draft") == 0.0


def test_a_draft_that_improves_is_picked_up_again_by_a_probe():
    policy = SessionPolicy(PolicyConfig(max_gamma=8))
    simulate(policy, 300, {"draft": 0.0}, {"draft": 0.05})
    choices = simulate(policy, 400, {"draft": 1.0}, {"draft": 0.05})
    first = next(i for i, c in enumerate(choices) if c.source == "draft")
    assert choices[first].reason == "probe"
    assert tuple(choices[-1]) == ("draft", 8)
    assert all(c.source == "draft" for c in choices[first:])


def test_high_cost_ratio_gives_a_smaller_gamma():
    def mean_gamma(step_cost: float) -> float:
        policy = SessionPolicy(PolicyConfig(max_gamma=16))
        choices = simulate(policy, 600, {"draft": 0.8}, {"draft": step_cost}, seed=1)
        tail = choices[-300:]
        return sum(c.gamma for c in tail) / len(tail)

    cheap, dear = mean_gamma(0.02), mean_gamma(0.4)
    assert dear < cheap
    assert dear < 4 < cheap


def test_ngram_preferred_when_its_alpha_is_high():
    policy = SessionPolicy(PolicyConfig(max_gamma=8))
    choices = simulate(policy, 400, {"draft": 0.5, "ngram": 0.95}, {"draft": 0.1}, lookup_available=6)
    tail = choices[-200:]
    assert sum(c.source == "ngram" for c in tail) >= 190
    assert all(c.gamma <= 6 for c in tail if c.source == "ngram")   # capped by the match
    assert all(c.reason == "probe" for c in tail if c.source == "draft")
    # no n-gram continuation this round: the draft, judged on its own
    source, gamma = policy.choose(lookup_available=0)
    assert source == "draft" and gamma > 0


def test_draft_preferred_when_the_ngram_rarely_matches_the_target():
    policy = SessionPolicy(PolicyConfig(max_gamma=8))
    choices = simulate(policy, 300, {"draft": 0.9, "ngram": 0.1}, {"draft": 0.05}, lookup_available=8)
    assert sum(c.source == "draft" for c in choices[-100:]) >= 90


def test_the_coordinator_wide_draft_alpha_keeps_a_few_rejections_from_pricing_the_draft_out():
    """A session's own draft α forgets fast: eight rejected rounds after six good ones pull it to
    ~0.6, where prompt lookup at α ~0.2 looked better. The pair's α over all sessions (0.95 here)
    stays in the estimate with draft_prior_weight trials' worth, and the draft keeps its rounds."""
    from coordinator.policy.speculation import FixedCosts

    prior = AcceptanceEstimate(0.98)
    for i in range(30):
        prior.observe(4, 4 if i % 5 else 2)

    def after_a_bad_stretch(draft_prior):
        policy = SessionPolicy(PolicyConfig(max_gamma=8), FixedCosts(0.3), draft_prior)
        for _ in range(6):
            policy.observe("draft", 4, 4)
        for _ in range(8):
            policy.observe("draft", 2, 0)
        for accepted in (0, 1, 0, 0):
            policy.observe("ngram", 3, accepted)
        return policy

    alone, shrunk = after_a_bad_stretch(None), after_a_bad_stretch(prior)
    assert alone.alpha("ngram") == shrunk.alpha("ngram") < 0.25  # prompt lookup's stays its own
    assert alone.alpha("draft") < 0.65 < shrunk.alpha("draft") < prior.alpha
    assert alone.choose(lookup_available=4).source == "ngram"
    assert shrunk.choose(lookup_available=4).source == "draft"
    # a prior still warming up is not used
    young = AcceptanceEstimate(0.98)
    young.observe(4, 4)
    assert after_a_bad_stretch(young).alpha("draft") == alone.alpha("draft")


def test_overrides_are_respected():
    policy = SessionPolicy(PolicyConfig(max_gamma=8))
    simulate(policy, 100, {"draft": 0.0}, {"draft": 0.05})          # the draft looks useless
    assert policy.choose(mode="none") == policy.choose(fixed_gamma=0)
    assert tuple(policy.choose(mode="none", fixed_gamma=5)) == ("none", 0)
    assert tuple(policy.choose(mode="draft", fixed_gamma=5)) == ("draft", 5)
    assert tuple(policy.choose(mode="draft", fixed_gamma=12, max_gamma=10)) == ("draft", 10)
    assert tuple(policy.choose(mode="ngram", fixed_gamma=5, lookup_available=2)) == ("ngram", 2)
    choice = policy.choose(mode="ngram", fixed_gamma=5, lookup_available=0)
    assert (choice.source, choice.gamma, choice.reason) == ("none", 0, "unavailable")
    assert tuple(policy.choose(mode="draft", fixed_gamma=3, draft_available=False)) == ("none", 0)
    # fixed γ, source left to the policy: never "none" while a source is there
    choices = simulate(policy, 50, {"draft": 0.0}, {"draft": 0.05}, fixed_gamma=3)
    assert {tuple(c) for c in choices} == {("draft", 3)}
    # fixed source, adaptive γ: the useless draft is not used (but still probed)
    choices = simulate(policy, 50, {"draft": 0.0}, {"draft": 0.05}, mode="draft")
    assert sum(c.source == "draft" for c in choices) <= 2
    # a fixed n-gram source never calls the draft
    choices = simulate(policy, 50, {"ngram": 1.0}, {}, mode="ngram", lookup_available=3)
    assert {c.source for c in choices} == {"ngram"}
    with pytest.raises(ValueError):
        policy.choose(mode="eagle")
    with pytest.raises(ValueError):
        policy.choose(fixed_gamma=-1)
    with pytest.raises(ValueError):
        policy.observe("draft", 2, 3)


def test_draft_unavailable_means_plain_decoding():
    policy = SessionPolicy()
    assert tuple(policy.choose(draft_available=False)) == ("none", 0)
    assert tuple(policy.choose(max_gamma=0)) == ("none", 0)


def test_acceptance_estimate_counts_trials_up_to_the_first_rejection():
    estimate = AcceptanceEstimate(decay=1.0)
    assert estimate.alpha is None
    estimate.observe(4, 3)      # 3 successes, 1 failure
    estimate.observe(4, 4)      # 4 successes
    estimate.observe(0, 0)      # nothing proposed: no trial
    assert estimate.alpha == pytest.approx(7 / 8) and estimate.rounds == 2


def test_linear_fit_recovers_a_line_and_falls_back_while_x_is_constant():
    fit = LinearFit(decay=0.9, degenerate="flat")
    assert fit.predict(3) is None
    for _ in range(5):
        fit.observe(5, 0.2)
    assert fit.coefficients() == pytest.approx((0.2, 0.0))
    for n in (1, 3, 9, 2, 5, 7):
        fit.observe(n, 0.1 + 0.02 * n)
    a, b = fit.coefficients()
    assert b > 0 and fit.predict(1) < fit.predict(9)
    proportional = LinearFit(decay=0.9, degenerate="proportional")
    proportional.observe(4, 0.4)
    assert proportional.predict(8) == pytest.approx(0.8)
    exact = LinearFit(decay=0.5, degenerate="flat")
    for n in (1, 4, 2, 8, 3):
        exact.observe(n, 0.05 + 0.01 * n)
    assert exact.coefficients() == pytest.approx((0.05, 0.01))


def test_cost_model_reduces_to_the_leviathan_form_when_verify_is_flat():
    costs = CostModel(decay=0.9)
    for gamma in (1, 4, 2, 8):
        costs.observe_propose("draft", gamma, 0.003 * gamma)
        costs.observe_verify(gamma + 1, 0.1)
    # c = 0.003 / 0.1
    assert costs.relative_cost("draft", 5) == pytest.approx(1 + 5 * 0.03)
    assert costs.relative_cost("ngram", 5) == pytest.approx(1.0)
    assert costs.relative_cost("draft", 0) == 1.0


def test_cost_model_says_how_many_draft_steps_fit_in_a_verification():
    """What sizes a draft call made ahead (--draft-ahead): t_verify(n) and the draft steps
    within a time, from the fits; None before anything was measured."""
    costs = CostModel(decay=0.9)
    assert costs.verify_seconds(5) is None and costs.steps_within("draft", 0.1) is None
    for tokens in (2, 5, 3, 9):
        costs.observe_verify(tokens, 0.05 + 0.01 * tokens)
    for gamma in (1, 4, 2):
        costs.observe_propose("draft", gamma, 0.002 + 0.02 * gamma)
    assert costs.verify_seconds(5) == pytest.approx(0.1)
    assert costs.verify_seconds(5, load=2) == pytest.approx(0.15)  # batched with an alike session
    assert costs.steps_within("draft", 0.1) == 4  # 0.002 + 0.02·4 = 0.082 ≤ 0.1 < 0.102
    assert costs.steps_within("draft", 0.001) == 0


def test_shared_cost_model_warms_new_sessions():
    costs = CostModel()
    first = SessionPolicy(PolicyConfig(max_gamma=16), costs=costs)
    simulate(first, 100, {"draft": 0.8}, {"draft": 0.4})
    second = SessionPolicy(PolicyConfig(max_gamma=16), costs=costs)
    assert second.costs is first.costs
    # t_propose(4) = 0.4·0.1·4, t_verify(n) = 0.1·(1 + 0.01·n)
    expected = (0.16 + VERIFY_S * (1 + 0.05)) / (VERIFY_S * 1.01)
    assert costs.relative_cost("draft", 4) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("alpha, c", [(0.9, 0.05), (0.7, 0.2), (0.5, 0.6), (0.2, 0.05)])
def test_policy_picks_the_leviathan_optimum_when_verify_is_flat(alpha, c):
    costs = CostModel()
    for gamma in (1, 3, 6, 2):
        costs.observe_propose("draft", gamma, c * VERIFY_S * gamma)
        costs.observe_verify(gamma + 1, VERIFY_S)
    policy = SessionPolicy(PolicyConfig(max_gamma=12, warmup_rounds=1), costs=costs)
    policy.sources["draft"].acceptance.observe(10, 0)          # one round to end the warm-up
    estimate = policy.sources["draft"].acceptance
    estimate.successes, estimate.trials = alpha * 100, 100.0   # an α known exactly
    source, gamma = policy.choose()
    expected = best_gamma(alpha, c, 12)
    assert gamma == expected and source == ("draft" if expected else "none")


def test_ngram_alpha_is_kept_per_match_length():
    """Long matches always right, unigram matches always wrong: prompt lookup runs on the long
    ones and not on the short ones, which the overall α (about half) would not tell apart."""
    policy = SessionPolicy(PolicyConfig(max_gamma=8))
    for i in range(200):
        order = 3 if i % 2 else 1
        choice = policy.choose(lookup_available=8, lookup_order=order, draft_available=False)
        if choice.source == "ngram":
            accepted = choice.gamma if order == 3 else 0
            policy.observe("ngram", choice.gamma, accepted, verify_seconds=VERIFY_S * (1 + 0.01 * choice.gamma),
                           verified_tokens=choice.gamma + 1, lookup_order=order)
    assert policy.lookup_alpha(3) == 1.0 and policy.lookup_alpha(1) == 0.0
    assert 0.0 < policy.alpha("ngram") < 1.0
    long = policy.choose(lookup_available=8, lookup_order=3, draft_available=False)
    assert (long.source, long.gamma) == ("ngram", 8)
    assert policy.choose(lookup_available=8, lookup_order=1, draft_available=False).source == "none"
    # a length without its own trials yet: the overall estimate
    assert policy.lookup_alpha(2) == policy.alpha("ngram")


def test_a_fit_with_a_negative_intercept_falls_back_to_its_assumption():
    """Noise (a slow moment during a long verification) can tilt a fit below zero at n = 0: a
    verify fit then stays flat instead of pricing a round at γ + 1 plain steps."""
    verify = LinearFit(decay=0.9, degenerate="flat")
    for n, seconds in ((2, 0.10), (2, 0.10), (3, 0.30), (2, 0.10)):  # a line through (0, -0.3)
        verify.observe(n, seconds)
    a, b = verify.coefficients()
    assert b == 0.0 and a == pytest.approx(verify.sy / verify.w)
    propose = LinearFit(decay=0.9, degenerate="proportional")
    for n, seconds in ((2, 0.02), (2, 0.02), (3, 0.20)):
        propose.observe(n, seconds)
    a, b = propose.coefficients()
    assert a == 0.0 and b == pytest.approx((propose.sy / propose.w) / (propose.sx / propose.w))


def test_gamma_falls_under_load_when_the_batch_stops_being_free():
    """The target's batched forward costs 0.1 s + 0.004 s per token in the batch. Alone, γ + 1
    tokens cost about as much as 1 and speculation pays. With 32 sessions the batch holds the
    others' tokens too (here drawn independently of this session's γ, so its own γ barely moves
    its verify time): fitted against the batch's tokens, the cost of every session speculating
    shows, and γ falls."""
    def run(load: int, rounds: int = 300) -> list:
        policy = SessionPolicy(PolicyConfig(max_gamma=8), CostModel(default_cost_ratio=0.05))
        rng = random.Random(load)
        choices = []
        for _ in range(rounds):
            choice = policy.choose(lookup_available=0, load=load)
            source, gamma = choice
            accepted = accepted_count(rng, 0.7, gamma)
            batch = gamma + 1 + sum(rng.randint(1, 7) for _ in range(load - 1))  # the others' tokens
            policy.observe(source, gamma, accepted, propose_seconds=0.005 * gamma if gamma else None,
                           verify_seconds=0.1 + 0.004 * batch, verified_tokens=gamma + 1, batch_tokens=batch)
            choices.append(choice)
        return choices[-100:]

    alone, crowded = run(1), run(32)
    assert sum(c.gamma for c in alone) / 100 >= 2.5
    assert sum(c.gamma for c in crowded) / 100 <= 0.5  # mostly plain rounds (and the odd probe)


def test_a_source_that_was_winning_is_probed_soon_after_it_stops():
    """A few rejections can pull a good draft's α under break-even; it is probed after
    `lapsed_probe_interval` rounds, not `probe_interval`."""
    from coordinator.policy.speculation import FixedCosts

    config = PolicyConfig(max_gamma=8, probe_interval=16, lapsed_probe_interval=4)
    policy = SessionPolicy(config, FixedCosts(0.3))
    for _ in range(6):  # winning: everything accepted
        source, gamma = policy.choose()
        policy.observe(source, gamma, gamma)
    assert policy.choose().reason == "best"
    for _ in range(30):  # a bad patch: every proposal rejected at once, until it stops
        source, gamma = policy.choose()
        if source == "none":
            break
        policy.observe(source, gamma, 0)
    assert source == "none"
    plain = 1
    while (choice := policy.choose()).source == "none":
        plain += 1
    assert plain <= 5 and choice.reason == "probe" and choice.source == "draft"
    # a source that never won keeps the long interval
    fresh = SessionPolicy(config, FixedCosts(0.3))
    for _ in range(2):  # warm-up, all rejected
        source, gamma = fresh.choose()
        fresh.observe(source, gamma, 0)
    plain = 0
    while (choice := fresh.choose()).source == "none":
        plain += 1
    assert plain >= 15 and choice.reason == "probe"
