"""The target's heads as a proposal source, without services: the tree built from their
proposals (best first by path score, parents first, one-hot q), which rounds have proposals at
hand, the per-depth acceptance they feed, and the planner's choices under pinned costs."""

from __future__ import annotations

import asyncio
import itertools
import random
from types import SimpleNamespace

import pytest

from coordinator.policy.estimates import CostModel, tree_expected_tokens, tree_expected_tokens_by_depth
from coordinator.policy.heads_estimates import DepthAcceptance, HeadsAtHand, SessionHeads, heads_budgets
from coordinator.policy.session_policy import PolicyConfig, SessionPolicy
from coordinator.policy.speculation import Offers, Speculation
from coordinator.rounds import RoundResult
from coordinator.sources.heads_source import HeadsSource, heads_tree
from specdec.maths.tree import TokenTree, TreeOutcome
from specdec.types import Source, SparseDist, Verdict

pytestmark = pytest.mark.unit

VERIFY_S = 0.1  # one target forward of one token
STEP_S = 0.01   # one draft forward: c = 0.1


def dist(*pairs: tuple[int, float]) -> SparseDist:
    return SparseDist(tuple(t for t, _ in pairs), tuple(p for _, p in pairs))


# ---- the tree -----------------------------------------------------------------------------------

def test_the_tree_is_the_heads_top_tokens_and_the_best_paths_beside_them_parents_first():
    heads = [dist((5, 0.6), (6, 0.3), (7, 0.1)), dist((8, 0.5), (9, 0.4), (10, 0.1))]
    tree = heads_tree(heads, max_nodes=4, max_depth=2)
    # the spine 5 → 8, then 6 (.3) and 5 → 9 (.24) before 6 → 8 (.15) and 7 (.1)
    assert tree == TokenTree((5, 6, 8, 9), (0, 0, 1, 1))
    assert [tree.tokens[n] for n in tree.spine()] == [5, 8]
    tree.check()
    assert heads_tree(heads, 8, 1) == TokenTree((5, 6, 7), (0, 0, 0))  # no deeper than asked
    assert heads_tree(heads, 2, 2) == TokenTree((5, 8), (0, 1))  # the spine first: a chain
    assert heads_tree(heads, 1, 2) == TokenTree((5,), (0,))
    # 6 → 8 (.15) and 6 → 9 (.12) before 7 (.1)
    assert heads_tree(heads, 6, 2) == TokenTree((5, 6, 8, 9, 8, 9), (0, 0, 1, 1, 2, 2))
    assert heads_tree([dist((1, 1.0)), dist((2, 1.0)), dist((3, 1.0))], 8, 3).is_chain
    assert len(heads_tree([], 8, 3)) == 0 and len(heads_tree(heads, 0, 2)) == 0
    assert heads_tree([dist((1, 0.0), (2, 1.0))], 4, 1) == TokenTree((2,), (0,))  # no zero-probability node


@pytest.mark.parametrize("seed", range(20))
def test_the_tree_holds_the_top_path_scores_of_every_path_it_could_hold(seed):
    rng = random.Random(seed)
    depth, width = rng.randint(1, 4), rng.randint(1, 4)
    heads = []
    for _ in range(depth):
        probs = sorted((rng.random() for _ in range(width)), reverse=True)
        heads.append(SparseDist(tuple(rng.sample(range(100), width)), tuple(p / sum(probs) for p in probs)))
    max_nodes, max_depth = rng.randint(1, 12), rng.randint(1, depth)
    tree = heads_tree(heads, max_nodes, max_depth)
    tree.check()
    spine = tree.spine()
    assert [tree.tokens[n] for n in spine] == [h.token_ids[0] for h in heads[:min(max_nodes, max_depth)]]
    assert len(tree) == min(max_nodes, sum(width ** d for d in range(1, max_depth + 1)))
    scores = []  # of the nodes beside the spine
    for node in range(len(tree)):
        path = tree.path(node)
        assert all(tree.parents[n] <= n for n in path)  # parents first
        if node not in spine:
            scores.append(_product(dict(zip(heads[d].token_ids, heads[d].probs))[tree.tokens[n]]
                                   for d, n in enumerate(path)))
    others = [_product(heads[i].probs[r] for i, r in enumerate(ranks)) for d in range(1, max_depth + 1)
              for ranks in itertools.product(range(width), repeat=d) if len(ranks) > len(spine) or any(ranks)]
    assert sorted(scores, reverse=True) == pytest.approx(sorted(others, reverse=True)[:len(scores)])


def _product(values) -> float:
    out = 1.0
    for value in values:
        out *= value
    return out


# ---- proposals at hand --------------------------------------------------------------------------

def result(base: int, drafts: list[int], accepted: int, next_token: int, heads=()) -> RoundResult:
    verdict = Verdict(accepted, next_token, False, head_proposals=tuple(heads))
    return RoundResult(plan=None, verdict=verdict, drafts=drafts, source=Source.NONE, propose_seconds=None,
                       call_seconds=None, verify_seconds=0.0, verified_tokens=0, started=0.0, base=base)


def heads_round(base: int, depth: int, nodes: int, cap: int = 8):
    plan = SimpleNamespace(gamma=depth, tree_nodes=nodes)
    return SimpleNamespace(run=SimpleNamespace(record=SimpleNamespace(session_id="s")), base=base, plan=plan,
                           cap=cap)


def test_proposals_are_for_the_round_right_after_their_verdict_only():
    source = HeadsSource(4)
    heads = [dist((4, 0.7), (5, 0.2)), dist((6, 0.9))]
    source.committed("s", result(10, [1, 2], 2, 3, heads))  # commits 1, 2, 3: the next round starts at 13
    assert source.depth_at("s", 13) == 2 and source.at_hand("s", 13) == tuple(heads)
    assert source.depth_at("s", 12) == 0 and source.depth_at("other", 13) == 0
    drafts = asyncio.run(source.propose(heads_round(13, 2, 3)))
    assert drafts.source == Source.HEADS and drafts.propose_seconds is None
    assert drafts.proposal.draft_tokens == [4, 5, 6] and drafts.proposal.parents == (0, 0, 1)
    assert drafts.proposal.draft_probs == [SparseDist.one_hot(t) for t in (4, 5, 6)]  # one-hot q
    chain = asyncio.run(source.propose(heads_round(13, 2, 2)))
    assert chain.proposal.draft_tokens == [4, 6] and chain.proposal.parents == ()  # a chain goes as one
    assert asyncio.run(source.propose(heads_round(13, 2, 8, cap=1))).proposal.draft_tokens == [4, 5]
    assert not asyncio.run(source.propose(heads_round(14, 2, 3))).proposal.draft_tokens  # stale
    source.committed("s", result(13, [], 0, 7))  # a verdict without proposals: none for the next round
    assert source.depth_at("s", 14) == 0
    source.committed("s", result(14, [], 0, 7, heads))
    source.forget("s")  # the request ended: a new one starts without
    assert source.depth_at("s", 15) == 0
    assert HeadsSource(4).depth_at("s", 0) == 0
    source.committed("s", result(0, [], 0, 1, [dist((4, 1.0)), SparseDist((), ()), dist((5, 1.0))]))
    assert source.depth_at("s", 1) == 1  # a head without candidates ends the tree
    with pytest.raises(ValueError):
        HeadsSource(33)


# ---- what heads rounds teach ---------------------------------------------------------------------

def test_the_per_depth_model_is_the_tree_model_with_one_alpha_and_falls_with_the_depth():
    assert tree_expected_tokens_by_depth([0.5] * 3, 0.3, 7) == pytest.approx(tree_expected_tokens(0.5, 0.3, 3, 7))
    assert tree_expected_tokens_by_depth([0.8, 0.5], 0.0, 2) == pytest.approx(1 + 0.8 + 0.4)
    # one alternative: beside depth 1 it adds (1 − 0.8)·b, beside depth 2 0.8·(1 − 0.5)·b: the larger
    assert tree_expected_tokens_by_depth([0.8, 0.5], 0.5, 3) == pytest.approx(2.2 + 0.8 * 0.5 * 0.5)
    assert heads_budgets(2, HeadsAtHand(3, 16, 4)) == [2, 4, 8]
    assert heads_budgets(3, HeadsAtHand(3, 10, 2)) == [3, 6]
    assert heads_budgets(2, HeadsAtHand(2, 8, 4, trees=False)) == [2]   # a target that verifies chains only
    assert heads_budgets(2, HeadsAtHand(2, 16, 4), fixed_nodes=5) == [5]


def test_a_heads_round_is_one_trial_per_depth_its_spine_reached():
    estimates = DepthAcceptance(1.0)
    estimates.observe(TreeOutcome(3, 1, 2, 1))  # depth 1 taken, depth 2 not (an alternative was)
    estimates.observe(TreeOutcome(3, 3, 0, 0))
    estimates.observe(TreeOutcome(2, 0, 3, 0))
    assert [d.alpha for d in estimates.depths] == [pytest.approx(2 / 3), 0.5, 1.0]
    assert estimates.branch.alpha == pytest.approx(1 / 5) and estimates.rounds == 3
    session = SessionHeads("h", estimates, prior_weight=2.0, warmup_rounds=2)
    assert session.alphas(4)[3] == session.alphas(3)[2]  # a depth never tried takes the one above's
    session.observe(TreeOutcome(1, 0, 0, 0))
    assert session.alpha(1) == pytest.approx((0 + 2 * 0.5) / (1 + 2))  # its own failure and 2 trials of the shared


# ---- the planner ---------------------------------------------------------------------------------

def pinned_policy(heads_alphas: list[float] | None, verify_slope: float = 0.0, draft_alpha: float | None = 0.5,
                  heads_b: float = 0.2) -> SessionPolicy:
    """Pinned costs: verify(n) = VERIFY_S + slope·(n − 1), the draft STEP_S a step; the draft's α
    and the heads' α per depth (None: the target has no heads) pinned by many trials."""
    costs = CostModel(decay=1.0)
    for n in range(1, 18):
        costs.observe_verify(n, VERIFY_S + verify_slope * (n - 1))
        costs.observe_propose(Source.DRAFT, n, STEP_S * n)
    policy = SessionPolicy(PolicyConfig(max_gamma=8), costs)
    if draft_alpha is not None:
        policy.seed(Source.DRAFT, draft_alpha, 10_000)
    if heads_alphas is not None:
        shared = DepthAcceptance(1.0)
        for alpha in heads_alphas:
            estimate = DepthAcceptance(1.0).branch  # an AcceptanceEstimate
            estimate.successes, estimate.trials, estimate.rounds = alpha * 10_000, 10_000.0, 100
            shared.depths.append(estimate)
        shared.branch.successes, shared.branch.trials = heads_b * 10_000, 10_000.0
        shared.rounds = 100
        policy.use_heads(SessionHeads("h", shared))
    return policy


AT_HAND = HeadsAtHand(depth=3, max_nodes=8, width=4)


@pytest.mark.parametrize("heads_alphas, draft_alpha, slope, expected", [
    ([0.8, 0.6, 0.5], 0.5, 0.0, Source.HEADS),   # heads that are right more often than the draft
    ([0.1, 0.05, 0.05], 0.5, 0.0, Source.DRAFT),  # a draft that is right more often than the heads
    ([0.8, 0.6, 0.5], None, 0.0, Source.HEADS),   # a draft never measured is warmed up first: off here
    ([0.02, 0.01, 0.01], 0.02, 0.05, Source.NONE),  # each verified token costs and nothing is right
], ids=["heads-win", "draft-wins", "heads-alone", "none"])
def test_heads_are_chosen_where_their_tokens_per_round_beat_the_others(heads_alphas, draft_alpha, slope, expected):
    policy = pinned_policy(heads_alphas, slope, draft_alpha=draft_alpha, heads_b=0.02)
    choice = policy.choose(max_gamma=8, draft_available=draft_alpha is not None, heads=AT_HAND)
    assert choice.source == expected
    if expected == Source.HEADS:
        assert 1 <= choice.gamma <= AT_HAND.depth and choice.gamma <= choice.tree_nodes <= AT_HAND.max_nodes
        assert choice.speedup > 2.0  # verification flat: the whole tree comes for one target pass


def test_auto_reads_the_heads_only_while_the_next_round_may_take_them():
    """Reading the heads costs the target an output-layer pass: under auto, heads that lose are
    read again only when their probe comes due; heads that win, every round."""
    losing = pinned_policy([0.1, 0.05, 0.05], draft_alpha=0.5, heads_b=0.02)
    assert losing.choose(max_gamma=8, heads=AT_HAND).source == Source.DRAFT
    assert not losing.wants_heads(Source.AUTO)
    assert losing.wants_heads(Source.HEADS)  # a request held to heads reads them every round
    unread = 0
    while not losing.wants_heads(Source.AUTO):  # rounds whose Verify did not read them still count
        assert losing.choose(max_gamma=8, heads=None).source == Source.DRAFT
        unread += 1
        assert unread <= losing.config.probe_interval
    probe = losing.choose(max_gamma=8, heads=AT_HAND)
    assert (probe.source, probe.reason) == (Source.HEADS, "probe")
    winning = pinned_policy([0.8, 0.6, 0.5], heads_b=0.02)
    assert winning.choose(max_gamma=8, heads=AT_HAND).source == Source.HEADS
    assert winning.wants_heads(Source.AUTO)
    assert not pinned_policy(None).wants_heads(Source.AUTO)  # a target without heads: never
    unseen = pinned_policy([0.8, 0.6, 0.5], heads_b=0.02)  # good heads, none read before this round
    assert unseen.choose(max_gamma=8, heads=None).source == Source.DRAFT
    assert not unseen.wants_heads(Source.AUTO)
    assert unseen.wants_heads(Source.AUTO, AT_HAND, cap=8)  # they would beat the draft: read them
    still_losing = pinned_policy([0.1, 0.05, 0.05], draft_alpha=0.5, heads_b=0.02)
    assert still_losing.choose(max_gamma=8, heads=AT_HAND).source == Source.DRAFT
    assert not still_losing.wants_heads(Source.AUTO, AT_HAND, cap=8)  # they would not beat the draft


def test_never_heads_without_heads_or_without_proposals_at_hand():
    no_heads = pinned_policy(None)
    assert no_heads.choose(max_gamma=8, heads=AT_HAND).source == Source.DRAFT  # the target has none
    good = pinned_policy([0.9, 0.9, 0.9])
    assert good.choose(max_gamma=8, heads=None).source == Source.DRAFT  # none read in the round before
    assert good.choose(max_gamma=8, heads=AT_HAND, mode=Source.DRAFT).source == Source.DRAFT
    assert good.choose(max_gamma=0, heads=AT_HAND).source == Source.NONE  # no room left


def test_a_steep_verify_curve_shrinks_the_heads_tree_and_the_depth_falls_with_the_heads():
    flat = pinned_policy([0.6, 0.4, 0.2], draft_alpha=None).choose(max_gamma=8, draft_available=False, heads=AT_HAND)
    steep = pinned_policy([0.6, 0.4, 0.2], 0.05, draft_alpha=None).choose(max_gamma=8, draft_available=False,
                                                                           heads=AT_HAND)
    assert flat.source == steep.source == Source.HEADS
    assert flat.tree_nodes == AT_HAND.max_nodes and steep.tree_nodes < flat.tree_nodes
    shallow = pinned_policy([0.6, 0.01, 0.01], 0.05, draft_alpha=None).choose(
        max_gamma=8, draft_available=False, heads=AT_HAND)
    assert shallow.gamma == 1  # deep heads that are never right are not worth their verified tokens
    chains = pinned_policy([0.6, 0.4, 0.2], draft_alpha=None).choose(
        max_gamma=8, draft_available=False, heads=HeadsAtHand(3, 8, 4, trees=False))  # a target of chains only
    assert chains.tree_nodes == chains.gamma


def heads_speculation() -> Speculation:
    return Speculation(8, 4, cost_ratio=0.1)  # pinned: verification flat


def test_proposer_heads_fixes_the_source_and_rounds_without_proposals_decode_one_token():
    spec = heads_speculation()
    request = spec.start("s", Source.HEADS, None)
    spec.use_heads(request, "h1")
    assert request.uses_heads and not request.uses_draft
    plain = request.plan(Offers(), 8)
    assert (plain.source, plain.gamma) == (Source.NONE, 0)
    first = request.plan(Offers(heads=AT_HAND), 8)  # warm-up: a tree twice its depth
    assert (first.source, first.reason, first.gamma, first.tree_nodes) == (Source.HEADS, "warmup", 3, 6)
    fixed = spec.start("f", Source.HEADS, 5)
    spec.use_heads(fixed, "h1")
    plan = fixed.plan(Offers(heads=AT_HAND), 8)
    assert (plan.source, plan.gamma, plan.tree_nodes) == (Source.HEADS, 3, 5)  # a fixed γ: its nodes
    assert not spec.start("n", Source.HEADS, 0).uses_heads


def test_heads_rounds_feed_their_estimates_and_new_heads_start_afresh():
    spec = heads_speculation()
    request = spec.start("s", Source.AUTO, None)
    spec.use_heads(request, "h1")
    tree = heads_tree([dist((4, 0.6), (5, 0.3)), dist((6, 0.9), (7, 0.1))], 4, 2)  # 4 → 6, 5, 5 → 6
    for _ in range(30):  # the spine taken to depth 2, every round
        request.observe(Source.HEADS, len(tree), 2, propose_seconds=None, verify_seconds=None,
                        verified_tokens=len(tree) + 1, tree=tree, accepted_nodes=(0, 2))
    shared = spec.heads_estimates("h1")
    assert shared.rounds == 30 and [d.alpha for d in shared.depths] == [1.0, 1.0]
    assert request.policy.heads.alphas(2) == [1.0, 1.0]
    assert spec.policy("s").sources[Source.DRAFT].acceptance.rounds == 0  # the draft learnt nothing
    other = spec.start("t", Source.AUTO, None)  # a new session: no warm-up of heads measured already
    spec.use_heads(other, "h1")
    assert other.plan(Offers(draft_available=False, heads=AT_HAND), 8).source == Source.HEADS
    spec.use_heads(request, "h2")  # its target serves other heads now: learnt afresh
    assert request.policy.heads.heads_id == "h2" and request.policy.heads.alpha(1) is None
    assert request.plan(Offers(draft_available=False, heads=AT_HAND), 8).reason == "warmup"
    spec.use_heads(request, "h1")  # back: the coordinator kept what it learnt of h1
    assert request.policy.heads.alphas(2) == [1.0, 1.0]
