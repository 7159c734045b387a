"""End to end, sampling: the first two generated tokens follow the target's distribution.

A 12-token vocabulary; the exact target distributions of token 1 and token 2 are
computed from the target model itself, then compared (chi-square) with what the
three services produce over many seeds. Every request is seeded, so the test is
deterministic. Temperatures below and above 1, with and without top-k / top-p: a
draft that reports q at another warp than it sampled from fails here (the draft
model is sharp enough that the temperature changes q).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.runtime.loader import load_model
from specdec.maths.sampling import target_probs
from specdec.types import SamplingParams
from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster
from tests.unit.test_sampling import chi2_pvalue

PROMPT_IDS = [3, 7, 5]
SAMPLES = 1000


def exact_first_two(target_dir: str, params: SamplingParams,
                    prompt: list[int] = PROMPT_IDS) -> tuple[np.ndarray, np.ndarray]:
    """P(token 1) and P(token 2) = Σ_t P(t) P(token 2 | t) under the warp."""
    model = load_model(target_dir, "float64").model
    with torch.inference_mode():
        first_logits = model(torch.tensor([prompt])).logits[0, -1:]  # [1, vocab]
        p1 = target_probs(first_logits, params)[0].double()
        vocab = p1.shape[0]
        contexts = torch.tensor([prompt + [t] for t in range(vocab)])  # [vocab, len+1]
        second_logits = model(contexts).logits[:, -1]  # [vocab, vocab]
        p2_given = target_probs(second_logits, params).double()
    return p1.numpy(), (p1[:, None] * p2_given).sum(0).numpy()


@pytest.fixture(scope="module")
def small_cluster(small_vocab_models):
    with Cluster(small_vocab_models["draft"], small_vocab_models["target"]) as cluster:
        yield cluster


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.7),
    SamplingParams(temperature=0.5, top_k=4),
    SamplingParams(temperature=1.7, top_p=0.8),
    SamplingParams(temperature=0.6, top_k=6, top_p=0.9),
], ids=["t0.5", "t1.7", "t0.5-topk4", "t1.7-topp0.8", "t0.6-topk6-topp0.9"])
def test_first_two_tokens_follow_target_distribution(small_vocab_models, small_cluster, params):
    p1, p2 = exact_first_two(small_vocab_models["target"], params)
    counts1, counts2, accepted = sampled_first_two(small_cluster, params, SAMPLES)
    # the draft is a different model: some drafts are rejected, some accepted
    assert 0 < accepted < 2 * SAMPLES
    assert_follows((counts1, p1), (counts2, p2))


def sampled_first_two(cluster, params: SamplingParams, samples: int,
                      **fields) -> tuple[np.ndarray, np.ndarray, int]:
    """Counts of the first and the second generated token over `samples` seeds (requests made
    concurrently, so the services batch them), and the drafts the target accepted in all;
    `fields` go into every request."""
    vocab = cluster.coordinator.round_loop.target_info.vocab_size
    counts1, counts2 = np.zeros(vocab), np.zeros(vocab)
    accepted = 0
    for response in cluster.complete_each(
            range(samples), token_ids=PROMPT_IDS, max_new_tokens=2, num_speculative_tokens=2,
            temperature=params.temperature, top_k=params.top_k or None,
            top_p=params.top_p if params.top_p < 1 else None, ignore_eos=True, **fields):
        first, second = response.token_ids
        counts1[first] += 1
        counts2[second] += 1
        accepted += response.stats.accepted_tokens
    return counts1, counts2, accepted


def assert_follows(*observed: tuple[np.ndarray, np.ndarray]) -> None:
    """Each (counts, exact probabilities) fits by chi-square, with nothing outside the support."""
    for counts, probs in observed:
        support = probs > 1e-9
        assert counts[~support].sum() == 0, "a token outside the warped support was produced"
        assert chi2_pvalue(counts[support], probs[support]) > 1e-3, (counts, probs * counts.sum())


REPEATING_IDS = [3, 7, 5, 3, 7]  # prompt lookup proposes 5, 3 (what followed the earlier 3, 7)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0.7, top_k=4),
], ids=["t0.7", "t0.7-topk4"])
def test_prompt_lookup_samples_follow_target_distribution(small_vocab_models, params):
    """Prompt lookup's proposals are deterministic (one-hot q): still exactly the target's
    distribution. No draft model call is made."""
    p1, p2 = exact_first_two(small_vocab_models["target"], params, REPEATING_IDS)
    vocab = len(p1)
    counts1, counts2 = np.zeros(vocab), np.zeros(vocab)
    proposed = accepted = 0
    with Cluster(small_vocab_models["draft"], small_vocab_models["target"]) as cluster:
        for response in cluster.complete_each(range(SAMPLES), token_ids=REPEATING_IDS, max_new_tokens=3,
                                              num_speculative_tokens=2, proposer=coordinator_pb2.PROPOSER_NGRAM,
                                              temperature=params.temperature, top_k=params.top_k or None,
                                              ignore_eos=True):
            first, second = response.token_ids[:2]
            counts1[first] += 1
            counts2[second] += 1
            stats = response.stats
            assert stats.draft_rounds == 0 and stats.draft_prefill_tokens == 0
            proposed += stats.ngram_draft_tokens
            accepted += stats.ngram_accepted_tokens
    assert proposed >= SAMPLES  # every request's first round was a lookup
    if p1[5] > 0:
        assert 0 < accepted < proposed  # lookups were accepted and rejected
    else:  # the looked-up token is outside the top-k: always rejected, recovered from p
        assert accepted == 0
    for counts, probs in ((counts1, p1), (counts2, p2)):
        support = probs > 1e-9
        assert counts[~support].sum() == 0, "a token outside the warped support was produced"
        assert chi2_pvalue(counts[support], probs[support]) > 1e-3, (counts, probs * SAMPLES)
