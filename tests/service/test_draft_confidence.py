"""The draft stops early where it is unsure (`min_confidence`).

Here the service tests; the other tiers' are in tests/unit/test_draft_confidence.py and
tests/e2e/test_draft_confidence.py. The tier split shares one description: see tests/unit/test_draft_confidence.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from specdec.types import SamplingParams
from tests.unit.test_sampling import chi2_pvalue
from tests.unit.test_draft_confidence import draft_proposer
BATCH = 16  # seeds whose calls (one with the threshold, one without) share a batched forward


def test_sampled_stops_after_a_draw_below_the_threshold_and_keeps_q(draft_proposer):
    params, threshold, samples = SamplingParams(temperature=1.0), 0.2, 1200
    prompt = [3, 7, 5, 3]
    q1 = draft_proposer.propose_batch([draft_proposer.call("q1", 0, 0, prompt, 1, params, 0)])[0].draft_probs[0]
    first = q1.token_ids[int(np.argmax(q1.probs))]
    assert max(q1.probs) >= threshold  # a draw of `first` continues: the second token is drawn
    counts = np.zeros(draft_proposer.engine.vocab_size)
    q2: dict[int, float] | None = None
    lengths = set()
    pairs = []  # (the call with the threshold's result, the full call's): BATCH seeds per batched forward
    for start in range(0, samples, BATCH):
        seeds = range(start, min(start + BATCH, samples))
        calls = [call for seed in seeds for call in (
            draft_proposer.call(f"s{seed}", 0, 0, prompt, 4, params, seed, min_confidence=threshold),
            draft_proposer.call(f"f{seed}", 0, 0, prompt, 4, params, seed))]
        results = draft_proposer.propose_batch(calls)
        pairs += zip(results[::2], results[1::2])
        for seed in seeds:
            draft_proposer.release(f"s{seed}")
            draft_proposer.release(f"f{seed}")
    for result, reference in pairs:
        sure = [dict(zip(d.token_ids, d.probs))[t] for t, d in zip(result.draft_tokens, result.draft_probs)]
        assert all(p >= threshold for p in sure[:-1])
        assert sure[-1] < threshold or len(result.draft_tokens) == 4
        # the same seed draws the same tokens: the early stop only truncates
        assert result.draft_tokens == reference.draft_tokens[:len(result.draft_tokens)]
        assert result.cached_len == len(prompt) + len(result.draft_tokens) - 1
        lengths.add(len(result.draft_tokens))
        if result.draft_tokens[0] == first:  # given the first token, the second's q is fixed
            dist = dict(zip(result.draft_probs[1].token_ids, result.draft_probs[1].probs))
            q2 = q2 or dist
            assert dist == pytest.approx(q2)
            counts[result.draft_tokens[1]] += 1
    assert len(lengths) > 1
    assert q2 is not None and counts.sum() > 100
    expected = np.array([q2.get(t, 0.0) for t in range(len(counts))]) * counts.sum()
    assert counts[expected == 0].sum() == 0
    assert chi2_pvalue(counts[expected > 0], expected[expected > 0]) > 1e-3
