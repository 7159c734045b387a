"""End to end with the target's Medusa-style heads (`serve target --heads`): rounds that verify
the heads' tree of the round before. Greedy output with proposer heads and auto is the target's
own token for token (float64) with heads tokens accepted, sampled output follows the target's
distribution, the metrics count heads rounds as the stats do, a target restarted with other heads
has them learnt afresh, and proposer heads against a target without heads is
FAILED_PRECONDITION.

A 12-token vocabulary: heads with random blocks (a fixed seed) then guess the target's tokens
often enough among their 4 candidates that every path of the walk is taken."""

from __future__ import annotations

import dataclasses

import grpc
import numpy as np
import pytest
import torch

from specdec.runtime.heads import HeadsMeta, save_heads, target_identity
from specdec.runtime.loader import load_model
from specdec.types import SamplingParams
from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster, _free_port
from tests.test_draft_swap import _wait_for
from tests.test_e2e_sampling import PROMPT_IDS, assert_follows, exact_first_two
from tests.test_metrics import scrape, value
from tests.test_sources import IDS_PROMPTS, target_only
from tests.test_target_heads import random_heads as random_heads_of

pytestmark = pytest.mark.e2e

NUM_HEADS = 3
PROMPTS = IDS_PROMPTS + [[4, 4, 8, 1, 6], [11, 2, 5]]
NEW_TOKENS = 24


def random_heads(target: str, directory, seed: int, proposal_vocab: list[int] | None = None) -> str:
    """Heads for `target` saved in `directory`: residual blocks of random weights (`seed`),
    proposing from `proposal_vocab` (None: the whole vocabulary)."""
    model = load_model(target, "float32").model
    hidden = model.config.hidden_size
    heads = random_heads_of(hidden, seed, num_heads=NUM_HEADS, scale=0.3)
    meta = HeadsMeta(NUM_HEADS, hidden, target_identity(model), target)
    vocab = None if proposal_vocab is None else torch.tensor(proposal_vocab)
    return str(save_heads(directory, heads, meta, vocab))


@pytest.fixture(scope="module")
def heads_dir(small_vocab_models, tmp_path_factory) -> str:
    return random_heads(small_vocab_models["target"], tmp_path_factory.mktemp("heads"), seed=5)


@pytest.fixture(scope="module")
def heads_cluster(small_vocab_models, heads_dir):
    """A target serving the heads; a pinned draft cost (verification flat: a heads round costs one
    plain step), so auto's choices follow acceptance only."""
    port = _free_port()
    with Cluster(small_vocab_models["draft"], small_vocab_models["target"], target={"heads": heads_dir},
                 coordinator={"draft_cost_ratio": 0.1, "metrics_port": port}) as cluster:
        cluster.metrics_port = port
        yield cluster


@pytest.mark.parametrize("name", ["heads", "auto"])
def test_greedy_with_heads_equals_target_only(small_vocab_models, heads_cluster, name):
    before = scrape(heads_cluster.metrics_port)
    rounds = proposed = accepted = 0
    for ids in PROMPTS:
        response = heads_cluster.complete(token_ids=ids, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                          proposer=coordinator_pb2.Proposer.Value(f"PROPOSER_{name.upper()}"))
        assert list(response.token_ids) == target_only(small_vocab_models["target"], ids, NEW_TOKENS), (name, ids)
        stats = response.stats
        assert stats.rounds == (stats.draft_rounds + stats.ngram_rounds + stats.heads_rounds
                                + stats.rounds_by_gamma[0])
        if name == "heads":
            assert stats.draft_rounds == stats.ngram_rounds == stats.draft_prefill_tokens == 0  # no draft call
            assert stats.draft_tokens == stats.heads_draft_tokens and stats.heads_rounds > 0
        rounds += stats.heads_rounds
        proposed += stats.heads_draft_tokens
        accepted += stats.heads_accepted_tokens
    assert rounds > 0 and 0 < accepted < proposed  # heads rounds ran, and their tokens were taken and refused
    after = scrape(heads_cluster.metrics_port)

    def moved(metric: str) -> float:
        return value(after, metric, proposer="heads") - value(before, metric, proposer="heads")

    assert moved("specdec_num_drafts_total") == rounds
    assert moved("specdec_num_draft_tokens_total") == proposed
    assert moved("specdec_num_accepted_tokens_total") == accepted


SAMPLES = 600


def test_sampled_heads_rounds_follow_the_target_distribution(small_vocab_models, heads_cluster):
    """The second token comes from a heads round (the first has no proposals at hand): one-hot
    q over the heads' tree, tested against the target's exact distribution of both tokens."""
    params = SamplingParams(temperature=0.7, top_k=6)
    p1, p2 = exact_first_two(small_vocab_models["target"], params)
    counts1, counts2 = np.zeros(len(p1)), np.zeros(len(p1))
    proposed = accepted = 0
    for response in heads_cluster.complete_each(range(SAMPLES), token_ids=PROMPT_IDS, max_new_tokens=3,
                                                temperature=params.temperature, top_k=params.top_k,
                                                ignore_eos=True, proposer=coordinator_pb2.PROPOSER_HEADS):
        first, second = response.token_ids[:2]
        counts1[first] += 1
        counts2[second] += 1
        proposed += response.stats.heads_draft_tokens
        accepted += response.stats.heads_accepted_tokens
    assert proposed >= SAMPLES and 0 < accepted < proposed
    assert_follows((counts1, p1), (counts2, p2))


def test_a_target_restarted_with_other_heads_has_them_learnt_afresh(small_vocab_models, heads_dir, tmp_path,
                                                                    monkeypatch):
    """Other heads behind the same address (a restart seen from static discovery): the model info
    refresh notices their id, the session's next rounds plan with fresh estimates of them, the
    old heads' estimates stay as they were, and the output is the target's."""
    monkeypatch.setattr("coordinator.sessions.routing.INFO_REFRESH_S", 0.2)
    target = small_vocab_models["target"]
    request = dict(max_new_tokens=12, ignore_eos=True, proposer=coordinator_pb2.PROPOSER_HEADS)
    with Cluster(small_vocab_models["draft"], target, target={"heads": heads_dir}) as cluster:
        loop, address = cluster.coordinator.round_loop, f"127.0.0.1:{cluster.target_port}"
        old = loop.routes.targets.info_of(address).heads_id
        first = cluster.complete(token_ids=PROMPTS[0], **request)
        old_rounds = loop.speculation.heads_estimates(old).rounds
        assert old_rounds == first.stats.heads_rounds > 0
        other = random_heads(target, tmp_path / "other", seed=6)
        cluster.target_config = dataclasses.replace(cluster.target_config, heads=other)
        cluster.restart_target()
        _wait_for(lambda: loop.routes.targets.info_of(address).heads_id not in ("", old))
        new = loop.routes.targets.info_of(address).heads_id
        again = cluster.complete(session_id=first.session_id, token_ids=[5], **request)
        history = PROMPTS[0] + list(first.token_ids) + [5]
        assert list(again.token_ids) == target_only(target, history, 12)
        assert loop.speculation.policy(first.session_id).heads.heads_id == new
        assert loop.speculation.heads_estimates(new).rounds == again.stats.heads_rounds > 0
        assert loop.speculation.heads_estimates(old).rounds == old_rounds  # untouched


def test_heads_with_a_proposal_vocabulary_keep_the_output(small_vocab_models, tmp_path):
    """Heads that may propose 7 of the 12 ids only: where the target's token is another, their
    proposals are rejected and the output is still the target's, token for token."""
    target = small_vocab_models["target"]
    heads = random_heads(target, tmp_path / "vocab", seed=5, proposal_vocab=[1, 2, 4, 5, 6, 8, 11])
    with Cluster(small_vocab_models["draft"], target, target={"heads": heads}) as cluster:
        accepted = proposed = 0
        for ids in PROMPTS:
            response = cluster.complete(token_ids=ids, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                        proposer=coordinator_pb2.PROPOSER_HEADS)
            assert list(response.token_ids) == target_only(target, ids, NEW_TOKENS), ids
            accepted += response.stats.heads_accepted_tokens
            proposed += response.stats.heads_draft_tokens
        assert 0 < accepted < proposed


def test_proposer_heads_without_heads_is_failed_precondition(small_vocab_models):
    with Cluster(small_vocab_models["draft"], small_vocab_models["target"]) as cluster:
        with pytest.raises(grpc.RpcError) as info:
            cluster.complete(token_ids=[3, 7], max_new_tokens=2, proposer=coordinator_pb2.PROPOSER_HEADS)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "start it with --heads DIR, or use proposer auto" in info.value.details()
        auto = cluster.complete(token_ids=[3, 7], max_new_tokens=4, ignore_eos=True,
                                proposer=coordinator_pb2.PROPOSER_AUTO)
        assert auto.stats.heads_rounds == 0 and len(auto.token_ids) == 4
