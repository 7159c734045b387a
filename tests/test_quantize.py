"""A draft with weight-only int8 linear layers (--quantize int8): the same output, close logits."""

from __future__ import annotations

import pytest
import torch

from specdec.config import DraftConfig
from specdec.runtime.loader import ModelLoadError, load_model
from specdec.runtime.quantize import Int8Linear
from specdec.runtime.engines import runner_from_config
from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster
from tests.test_e2e_greedy import reference

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):", "hello world, hello"]


@pytest.mark.e2e
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


@pytest.mark.unit
def test_int8_linear_is_the_rounded_weights_product():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    quantized = Int8Linear(linear)
    assert quantized.weight_int8.dtype == torch.int8 and quantized.scale.shape == (48,)
    x = torch.randn(3, 5, 64)  # [batch, tokens, in]
    dequantized = quantized.weight_int8.float() * quantized.scale[:, None]  # [out, in]
    assert torch.allclose(quantized(x), x @ dequantized.T + linear.bias, atol=1e-4)
    # round to nearest with a per-row scale: each weight within half a step of the original
    assert bool(((dequantized - linear.weight).abs() <= quantized.scale[:, None] / 2 + 1e-7).all())
    # rows do not interact: a batched call equals the rows alone
    assert torch.equal(quantized(x)[1], quantized(x[1:2])[0])


@pytest.mark.unit
def test_int8_runner_quantizes_every_linear_and_still_batches(models):
    runner = runner_from_config(DraftConfig(model=models["llama"]["draft"], dtype="bfloat16", quantize="int8"))
    linears = [m for m in runner.model.modules() if isinstance(m, (torch.nn.Linear, Int8Linear))]
    assert linears and all(isinstance(m, Int8Linear) for m in linears)
    assert runner.loaded.dtype == torch.bfloat16  # activations and K/V keep the dtype asked for
    assert runner.kv_spec is not None  # the batched-forward start-up check passed
    assert runner.vocab_size == 384
    plain = runner_from_config(DraftConfig(model=models["llama"]["draft"], dtype="float32"))
    a = runner.forward("s", runner.new_entry(), [5, 6, 7, 8], 1).float()
    b = plain.forward("s", plain.new_entry(), [5, 6, 7, 8], 1)
    assert a.shape == (1, 384) and torch.allclose(a, b, atol=0.05 * float(b.abs().max()))


@pytest.mark.unit
def test_int8_is_cpu_only_and_unknown_quantizations_are_refused(models):
    with pytest.raises(ModelLoadError, match="CPU only"):
        runner_from_config(DraftConfig(model=models["llama"]["draft"], device="cuda", quantize="int8"))
    with pytest.raises(ModelLoadError, match="unknown quantization"):
        load_model(models["llama"]["draft"], "float32", quantize="int4")


@pytest.mark.unit
def test_auto_quantizes_a_cpu_draft_unless_float64():
    from specdec.runtime.quantize import resolve_quantization

    assert resolve_quantization("auto", "cpu", "bfloat16") == "int8"
    assert resolve_quantization("auto", "cpu", "float32") == "int8"
    assert resolve_quantization("auto", "cpu", "float64") == "none"  # exactness tests run unquantized
    assert resolve_quantization("auto", "cuda:0", "bfloat16") == "none"
    assert resolve_quantization("none", "cpu", "bfloat16") == "none"
    with pytest.raises(ValueError, match="CPU only"):
        resolve_quantization("int8", "cuda", "bfloat16")
