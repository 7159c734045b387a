"""End to end with token trees: draft-model rounds propose trees (tree_nodes) that the target
verifies in one pass; greedy output is the target's own token for token (float64, concurrent
sessions of different tree shapes), sampled output follows the target's distribution, and a
target that verifies chains only gets chains."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from specdec.types import Source, SamplingParams
from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster
from tests.test_e2e_greedy import PROMPTS, reference
from tests.test_e2e_sampling import REPEATING_IDS, assert_follows, exact_first_two, sampled_first_two
from tests.test_sources import IDS_PROMPTS, target_only

pytestmark = pytest.mark.e2e

NEW_TOKENS = 24
SHAPES = [(2, 4), (3, 6), (4, 8), (2, 2)]  # (γ: the tree's depth, tree_nodes)


@pytest.mark.parametrize("draft_kind", ["unrelated", "identical"])
def test_greedy_trees_equal_target_only(models, draft_kind):
    target = models["llama"]["target"]
    draft = models["llama"]["draft"] if draft_kind == "unrelated" else target
    expected = reference(target, PROMPTS, NEW_TOKENS)
    with Cluster(draft, target) as cluster:
        results: dict[tuple[str, tuple[int, int]], coordinator_pb2.CompleteResponse] = {}
        errors: list[BaseException] = []

        def run(prompt: str, shape: tuple[int, int]) -> None:
            try:
                results[prompt, shape] = cluster.complete(
                    prompt=prompt, max_new_tokens=NEW_TOKENS, num_speculative_tokens=shape[0], tree_nodes=shape[1],
                    ignore_eos=True, proposer=coordinator_pb2.PROPOSER_DRAFT)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        # every prompt with every shape, all at once: the target batches trees of different shapes
        threads = [threading.Thread(target=run, args=(p, s)) for p in PROMPTS for s in SHAPES]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert not errors, errors
        for (prompt, shape), response in results.items():
            assert list(response.token_ids) == expected[prompt], (draft_kind, prompt, shape)
            stats = response.stats
            assert stats.draft_rounds > 0 and stats.draft_tokens > 0
            if draft_kind == "identical":  # the draft's best path is the target's: depth + 1 per round
                assert stats.accepted_tokens >= stats.draft_rounds * min(shape) - shape[0], (prompt, shape)
        assert len(results) == len(PROMPTS) * len(SHAPES)


SAMPLES = 800


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.4, top_k=5),
                                    SamplingParams(temperature=1.0, top_p=0.85)], ids=["t0.7", "t1.4-topk", "topp"])
def test_sampled_trees_follow_the_target_distribution(small_vocab_models, params):
    p1, p2 = exact_first_two(small_vocab_models["target"], params)
    with Cluster(small_vocab_models["draft"], small_vocab_models["target"]) as cluster:
        counts1, counts2, accepted = sampled_first_two(cluster, params, SAMPLES, tree_nodes=4,
                                                       proposer=coordinator_pb2.PROPOSER_DRAFT)
    assert 0 < accepted < 2 * SAMPLES
    assert_follows((counts1, p1), (counts2, p2))


def test_a_target_that_verifies_chains_only_gets_chains(models):
    target = models["llama"]["target"]
    expected = reference(target, PROMPTS[:2], NEW_TOKENS)
    with Cluster(models["llama"]["draft"], target) as cluster:
        engine = cluster.coordinator.round_loop
        engine.target_info = dataclasses.replace(engine.target_info, verifies_trees=False)  # as an older target
        seen: list[int] = []
        verify = cluster.target_servicer.verify

        async def watched(request, deadline):
            seen.append(len(request.draft_parents))
            return await verify(request, deadline)

        cluster.target_servicer.verify = watched
        for prompt in PROMPTS[:2]:
            response = cluster.complete(prompt=prompt, max_new_tokens=NEW_TOKENS, num_speculative_tokens=3,
                                        tree_nodes=6, ignore_eos=True, proposer=coordinator_pb2.PROPOSER_DRAFT)
            assert list(response.token_ids) == expected[prompt]
            assert response.stats.draft_rounds > 0
        assert seen and not any(seen)  # no call carried a tree


def test_auto_trees_where_costs_favour_them_equal_target_only(models):
    """--trees auto with a pinned draft cost (flat verification: a tree's extra nodes are free)
    and a pair whose draft α is unsure: adaptive requests get tree rounds, greedy output is the
    target's own token for token, and a request's tree_nodes = 1 keeps its rounds chains."""
    target = models["llama"]["target"]
    prompts = PROMPTS[:2]
    expected = reference(target, prompts, NEW_TOKENS)
    with Cluster(models["llama"]["draft"], target,
                 coordinator={"trees": "auto", "draft_cost_ratio": 0.01}) as cluster:
        speculation = cluster.coordinator.round_loop.speculation
        prior = speculation.priors[Source.DRAFT]
        prior.successes, prior.trials, prior.rounds = 500.0, 1000.0, 100  # an unsure draft: α = 0.5
        # whose next choices are often the target's (b = 0.25), pinned as the α: this tiny draft's
        # are not, and the measured b would soon (rightly) bring the chains back
        speculation.branch.successes, speculation.branch.trials = 250.0, 1000.0
        for prompt in prompts:
            auto = cluster.complete(prompt=prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                    proposer=coordinator_pb2.PROPOSER_AUTO)
            assert list(auto.token_ids) == expected[prompt]
            assert auto.stats.tree_rounds > 0 and auto.stats.tree_draft_tokens > auto.stats.tree_rounds
            assert sum(auto.stats.tree_accepted_per_depth[:1]) <= auto.stats.tree_rounds
            chains = cluster.complete(prompt=prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                      proposer=coordinator_pb2.PROPOSER_AUTO, tree_nodes=1)
            assert list(chains.token_ids) == expected[prompt]
            assert chains.stats.tree_rounds == 0 and chains.stats.draft_rounds > 0


def believe_draft_and_lookup(cluster: Cluster, draft_alpha: float = 0.9, lookup_alpha: float = 0.5) -> None:
    """Every new session of the cluster's coordinator believes the draft (α 0.9, so each
    adaptive round is a draft tree) and believes prompt lookup enough (α 0.5, verification flat
    under the pinned cost ratio) to graft its tokens on: its own α only, pinned by 10,000 trials."""
    speculation = cluster.coordinator.round_loop.speculation
    new_policy = speculation.policy

    def believing(session_id, *args):
        fresh = session_id not in speculation._policies
        policy = new_policy(session_id, *args)
        if fresh:
            policy.draft_prior = None
            policy.seed(Source.DRAFT, draft_alpha, 10_000)
            policy.seed(Source.PROMPT_LOOKUP, lookup_alpha, 10_000)
        return policy

    speculation.policy = believing


def test_greedy_trees_with_prompt_lookups_branch_equal_target_only(small_vocab_models):
    """Adaptive `auto` draft tree rounds carry prompt lookup's continuation grafted on as a
    branch of its own; where the target takes it the path goes on through lookup's nodes.
    Greedy output is the target's own token for token."""
    target, draft = small_vocab_models["target"], small_vocab_models["draft"]
    with Cluster(draft, target, coordinator={"draft_cost_ratio": 0.1}) as cluster:
        believe_draft_and_lookup(cluster)
        grafted = taken = 0
        for ids in IDS_PROMPTS + [[5, 5, 1, 8, 5, 5, 1, 8, 5]]:
            response = cluster.complete(token_ids=ids, max_new_tokens=30, ignore_eos=True, tree_nodes=4,
                                        proposer=coordinator_pb2.PROPOSER_AUTO)
            assert list(response.token_ids) == target_only(target, ids, 30), ids
            stats = response.stats
            assert stats.tree_rounds > 0
            grafted += stats.tree_lookup_tokens
            taken += stats.tree_lookup_accepted_tokens
        assert grafted > 0 and taken > 0  # lookup's nodes were verified, and some were taken


def test_sampled_trees_with_prompt_lookups_branch_follow_the_target_distribution(small_vocab_models):
    """A grafted lookup node is one more deterministic child (one-hot q): the first two tokens
    of trees with lookup's branch still follow the target's distribution (the walk's warps,
    top-k and top-p, are tested with the draft's trees above)."""
    params = SamplingParams(temperature=0.8)
    p1, p2 = exact_first_two(small_vocab_models["target"], params, REPEATING_IDS)
    counts1, counts2 = np.zeros(len(p1)), np.zeros(len(p1))
    grafted = taken = 0
    # the requests run concurrently: the load governor, which would switch adaptive requests to
    # plain decoding while it measures the load, is off, so every round follows the beliefs
    with Cluster(small_vocab_models["draft"], small_vocab_models["target"],
                 coordinator={"draft_cost_ratio": 0.1, "load_governor": False}) as cluster:
        believe_draft_and_lookup(cluster)
        for response in cluster.complete_each(range(SAMPLES), token_ids=REPEATING_IDS, max_new_tokens=3,
                                              tree_nodes=4, temperature=params.temperature,
                                              top_k=params.top_k or None, ignore_eos=True,
                                              proposer=coordinator_pb2.PROPOSER_AUTO):
            first, second = response.token_ids[:2]
            counts1[first] += 1
            counts2[second] += 1
            grafted += response.stats.tree_lookup_tokens
            taken += response.stats.tree_lookup_accepted_tokens
    assert grafted >= SAMPLES  # every first round grafted lookup's branch on
    if p1[5] > 0:  # lookup's first token (5, what followed the earlier 3 7) is in the warped support
        assert taken > 0
    assert_follows((counts1, p1), (counts2, p2))
