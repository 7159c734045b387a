"""Weight-only int8 / int4 linear layers (--quantize): a quantized draft keeps the output, a
quantized target serves exactly its own (quantized) greedy output.

Here the e2e tests; the other tiers' are in tests/unit/test_quantize.py.
"""

from __future__ import annotations

import pytest

from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster
from tests.e2e.test_e2e_greedy import reference

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):", "hello world, hello"]


def test_int8_draft_keeps_greedy_output_exact(models):
    paths = models["llama"]
    expected = reference(paths["target"], PROMPTS, 24)
    with Cluster(paths["target"], paths["target"], draft={"quantize": "int8"}) as cluster:
        for prompt in PROMPTS:
            response = cluster.complete(prompt=prompt, max_new_tokens=24, ignore_eos=True,
                                        proposer=coordinator_pb2.PROPOSER_DRAFT, num_speculative_tokens=4)
            assert list(response.token_ids) == expected[prompt]
            # the target drafting for itself, quantized: most proposals still agree
            assert response.stats.draft_rounds > 0 and response.stats.acceptance_rate > 0.5


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_a_quantized_target_serves_its_own_greedy_output(models, quantize):
    """Speculation over a quantized target gives what that target alone gives (float32: the
    kernels take no float64)."""
    paths = models["llama"]
    with Cluster(paths["draft"], paths["target"], target={"quantize": quantize}) as cluster:
        for prompt in PROMPTS:
            alone, speculative = (cluster.complete(prompt=prompt, max_new_tokens=24, ignore_eos=True,
                                                   proposer=proposer, num_speculative_tokens=4)
                                  for proposer in (coordinator_pb2.PROPOSER_NONE, coordinator_pb2.PROPOSER_DRAFT))
            assert list(speculative.token_ids) == list(alone.token_ids), (quantize, prompt)
            assert speculative.stats.draft_rounds > 0 and alone.stats.draft_rounds == 0
