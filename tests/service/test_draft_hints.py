"""Prompt-lookup hints checked by the draft model (proposer auto).

Here the service tests; the other tiers' are in tests/e2e/test_draft_hints.py. The tier split shares one description: see tests/e2e/test_draft_hints.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from specdec.config import DraftConfig
from specdec.runtime.engines import engine_from_config
from specdec.types import SamplingParams
from specdec.runtime.drafting import HostDrafting
from tests.unit.test_sampling import chi2_pvalue


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5)],
                         ids=["t1.0", "t0.7-topk5"])
def test_sampled_hint_positions_are_draws_from_the_reported_q(small_vocab_models, params):
    """With a hint at the first position, the first proposed token is still distributed as q:
    kept with probability q(hint), else drawn from q without it."""
    engine = engine_from_config(DraftConfig(model=small_vocab_models["draft"], dtype="float64"))
    proposer_ = HostDrafting(engine, 32)
    prompt = [3, 7, 5, 3]
    plain = proposer_.propose_batch([proposer_.call("q", 0, 0, prompt, 1, params, 0)])[0]
    q = dict(zip(plain.draft_probs[0].token_ids, plain.draft_probs[0].probs))
    hint = max(q, key=q.get)  # the likeliest token: kept often, rejected often enough too
    vocab = engine.vocab_size
    counts, kept = np.zeros(vocab), 0
    samples = 1500
    results = []
    for start in range(0, samples, 32):  # 32 seeds' calls in one batched forward, each its own generator
        seeds = range(start, min(start + 32, samples))
        results += proposer_.propose_batch([proposer_.call(f"s{seed}", 0, 0, prompt, 1, params, seed, hints=[hint])
                                            for seed in seeds])
        for seed in seeds:
            engine.release(f"s{seed}")
    for result in results:
        assert dict(zip(result.draft_probs[0].token_ids, result.draft_probs[0].probs)) == pytest.approx(q)
        counts[result.draft_tokens[0]] += 1
        kept += result.hints_kept
        assert result.hints_kept == (result.draft_tokens[0] == hint)
        assert len(result.draft_tokens) == 1 + result.hints_kept
    expected = np.array([q.get(t, 0.0) for t in range(vocab)]) * samples
    assert counts[expected == 0].sum() == 0
    assert chi2_pvalue(counts[expected > 0], expected[expected > 0]) > 1e-3
    assert 0 < kept < samples
