"""A draft with int8 linear layers (--quantize int8): faster proposals, the same output."""

from __future__ import annotations

import pytest
import torch

from specdec.config import DraftConfig
from specdec.runtime.loader import ModelLoadError, load_model
from specdec.runtime.runner import runner_from_config
from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster
from tests.test_e2e_greedy import reference

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


def test_int8_runner_quantizes_the_linear_layers_after_the_batch_check(models):
    runner = runner_from_config(DraftConfig(model=models["llama"]["draft"], dtype="bfloat16", quantize="int8"))
    kinds = {type(m).__module__ for m in runner.model.modules() if "Linear" in type(m).__name__}
    assert any("quantized" in kind for kind in kinds)
    assert runner.loaded.dtype == torch.float32  # the rest of the model and the K/V in float32
    assert runner.kv_spec is not None  # batched forwards kept (the check ran before quantizing)
    assert runner.vocab_size == 384
    logits = runner.forward("s", runner.new_entry(), [5, 6, 7], 1)
    assert logits.shape == (1, 384) and bool(torch.isfinite(logits).all())


def test_int8_is_cpu_only_and_unknown_quantizations_are_refused(models):
    with pytest.raises(ModelLoadError, match="CPU only"):
        runner_from_config(DraftConfig(model=models["llama"]["draft"], device="cuda", quantize="int8"))
    with pytest.raises(ModelLoadError, match="unknown quantization"):
        load_model(models["llama"]["draft"], "float32", quantize="int4")
