"""Sampled output follows the target's distribution for every proposal source, pooled over ALL
requests: draft model chains, drafting ahead, token trees, prompt lookup, and the hybrids
(the draft keeping lookup's tokens as hints; lookup's branches grafted onto the draft's tree).

Each request is seeded and generates a few tokens from the same prompt (12-word vocabulary,
float64). For a later position k, every request adds its token k to the counts and the target's
exact P(· | prompt, its own tokens 1..k−1) to the expected counts; a chi-square then compares
the two. Nothing is selected by which path a round took: a bias of any path shows, and the
requests where the path under test did not run dilute it only in proportion. Drafting ahead
gets enough seeds to see the bias of reusing a seed, at the temperature where that bias shows
most: on the code that reused the next round's draft seed for the call made ahead, token 3 is
off at p = 9e-12, 9e-10, 9e-6 and 4e-8 over four disjoint sets of 3,000 seeds at temperature
0.3 (at 0.8, 1.4e-10 took 6,000 seeds; at 0.2, 0.4 and 0.5 it shows less than at 0.3, and 2,000
or 2,400 seeds at 0.3 miss it in one set of five or six).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.runtime.loader import load_model
from specdec.maths.sampling import target_probs
from specdec.types import SamplingParams
from tests.cluster import Cluster
from tests.test_draft_ahead import AHEAD
from tests.test_e2e_sampling import PROMPT_IDS, REPEATING_IDS
from tests.test_e2e_trees import believe_draft_and_lookup
from tests.test_sources import proposer

pytestmark = pytest.mark.e2e

TEMPERATURE = 0.8
SAMPLES = 600
MIN_EXPECTED = 5.0  # cells expected fewer times than this are pooled into one (chi-square's rule)


@dataclass(frozen=True)
class Source:
    """How one proposal source is driven, and how to tell that it ran."""

    fields: dict[str, Any]                 # request fields besides the seed and the sampling
    ran: Callable[[Any], int]              # from a response's stats: how often the source ran
    prompt: tuple[int, ...] = tuple(PROMPT_IDS)
    coordinator: dict | None = None        # coordinator overrides
    believe: float = 0.0                   # > 0: the policy believes the draft's α is this, lookup's 0.5
    draft: str = "draft"                   # "draft" (an unrelated model) or "near" (a near copy)
    samples: int = SAMPLES
    new_tokens: int = 4
    temperature: float = TEMPERATURE       # the requests' (and so the expected distribution's)


# the hybrids' rounds follow pinned beliefs and costs, not the concurrent load (the governor would
# switch adaptive requests to plain decoding while it measures)
PINNED = {"draft_cost_ratio": 0.1, "load_governor": False}

SOURCES = {
    "draft": Source({"proposer": proposer("draft"), "num_speculative_tokens": 2},
                    lambda s: s.draft_rounds),
    "draft-ahead": Source({"proposer": proposer("draft"), "num_speculative_tokens": 1},
                          lambda s: s.draft_ahead_rounds, coordinator=AHEAD, draft="near", samples=3000,
                          temperature=0.3),
    "tree": Source({"proposer": proposer("draft"), "num_speculative_tokens": 2, "tree_nodes": 4},
                   lambda s: s.tree_rounds),
    "prompt-lookup": Source({"proposer": proposer("ngram"), "num_speculative_tokens": 2},
                            lambda s: s.ngram_draft_tokens, prompt=tuple(REPEATING_IDS)),
    # a draft believed less (α 0.7) gets γ below the round's cap, leaving room for lookup's tokens
    # as hints; lookup's 9 after the 9s is likely enough that the near draft keeps it often
    "draft-with-lookup-hints": Source({"proposer": proposer("auto")}, lambda s: s.draft_hint_tokens,
                                      prompt=(3, 7, 5, 9, 9, 9, 9), coordinator=PINNED, believe=0.7, draft="near", new_tokens=6),
    "tree-with-lookup-branches": Source({"proposer": proposer("auto"), "tree_nodes": 4},
                                        lambda s: s.tree_lookup_tokens, prompt=tuple(REPEATING_IDS),
                                        coordinator=PINNED, believe=0.9),
}


def exact_next(target_dir: str, params: SamplingParams, prefixes: set[tuple[int, ...]]) -> dict[tuple, np.ndarray]:
    """P(next token | prefix) under the warp for each prefix (float64)."""
    model = load_model(target_dir, "float64").model
    out: dict[tuple, np.ndarray] = {}
    by_length: dict[int, list[tuple[int, ...]]] = {}
    for prefix in prefixes:
        by_length.setdefault(len(prefix), []).append(prefix)
    with torch.inference_mode():
        for group in by_length.values():
            logits = model(torch.tensor(group)).logits[:, -1]  # [prefixes, vocab]
            for prefix, row in zip(group, target_probs(logits, params).double().numpy()):
                out[prefix] = row
    return out


def fit_pvalue(counts: np.ndarray, expected: np.ndarray) -> float:
    """Chi-square p-value of counts against expected counts, the cells expected fewer than
    MIN_EXPECTED times pooled into one (so a rare token seen once does not decide the test)."""
    small = expected < MIN_EXPECTED
    cells_counts = list(counts[~small]) + ([counts[small].sum()] if small.any() else [])
    cells_expected = list(expected[~small]) + ([expected[small].sum()] if small.any() else [])
    cells_expected = np.array(cells_expected) * (sum(cells_counts) / sum(cells_expected))
    return float(chisquare(cells_counts, cells_expected).pvalue)


def assert_pooled_fit(target_dir: str, params: SamplingParams, prompt: tuple[int, ...], generated: list[list[int]],
                      positions: range) -> None:
    """Token k of every request against Σ P(· | prompt, that request's tokens before k)."""
    prefixes = {prompt + tuple(tokens[:k]) for tokens in generated for k in positions}
    exact = exact_next(target_dir, params, prefixes)
    vocab = len(next(iter(exact.values())))
    for k in positions:
        counts, expected = np.zeros(vocab), np.zeros(vocab)
        for tokens in generated:
            counts[tokens[k]] += 1
            expected += exact[prompt + tuple(tokens[:k])]
        assert counts[expected < 1e-9].sum() == 0, f"token {k + 1}: a token outside the warped support"
        assert fit_pvalue(counts, expected) > 1e-3, (k + 1, counts, expected.round(1))


@pytest.mark.parametrize("name", list(SOURCES))
def test_sampled_tokens_follow_the_target_over_all_requests(small_vocab_models, near_draft, name):
    source = SOURCES[name]
    target = small_vocab_models["target"]
    draft = near_draft if source.draft == "near" else small_vocab_models["draft"]
    with Cluster(draft, target, coordinator=source.coordinator) as cluster:
        if source.believe:
            believe_draft_and_lookup(cluster, draft_alpha=source.believe)

        responses = cluster.complete_each(range(source.samples), token_ids=list(source.prompt),
                                          max_new_tokens=source.new_tokens, temperature=source.temperature,
                                          ignore_eos=True, **source.fields)
    generated = [list(response.token_ids) for response in responses]
    assert all(len(tokens) == source.new_tokens for tokens in generated)
    ran = sum(1 for response in responses if source.ran(response.stats))
    assert ran >= source.samples // 10, f"{name} ran in {ran} of {source.samples} requests"
    assert_pooled_fit(target, SamplingParams(temperature=source.temperature), source.prompt, generated,
                      range(1, source.new_tokens))
