"""Weight-only int8 / int4 linear layers (--quantize): a quantized draft keeps the output, a
quantized target serves exactly its own (quantized) greedy output."""

from __future__ import annotations

import pytest
import torch

from specdec.config import DraftConfig, TargetConfig
from specdec.runtime.loader import load_model
from specdec.tokenizer import ModelLoadError
from specdec.runtime.quantize import Int4Linear, Int8Linear
from specdec.runtime.engines import engine_from_config
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
    engine = engine_from_config(DraftConfig(model=models["llama"]["draft"], dtype="bfloat16", quantize="int8"))
    linears = [m for m in engine.model.modules() if isinstance(m, (torch.nn.Linear, Int8Linear))]
    assert linears and all(isinstance(m, Int8Linear) for m in linears)
    assert engine.loaded.dtype == torch.bfloat16  # activations and K/V keep the dtype asked for
    assert engine.kv_spec is not None  # the batched-forward start-up check passed
    assert engine.vocab_size == 384
    plain = engine_from_config(DraftConfig(model=models["llama"]["draft"], dtype="float32"))
    a = engine.forward("s", engine.new_entry(), [5, 6, 7, 8], 1).float()
    b = plain.forward("s", plain.new_entry(), [5, 6, 7, 8], 1)
    assert a.shape == (1, 384) and torch.allclose(a, b, atol=0.05 * float(b.abs().max()))


@pytest.mark.unit
def test_int8_is_cpu_only_and_unknown_quantizations_are_refused(models):
    with pytest.raises(ModelLoadError, match="CPU only"):
        engine_from_config(DraftConfig(model=models["llama"]["draft"], device="cuda", quantize="int8"))
    with pytest.raises(ModelLoadError, match="unknown quantization"):
        load_model(models["llama"]["draft"], "float32", quantize="int3")
    with pytest.raises(ModelLoadError, match="CPU only"):
        engine_from_config(TargetConfig(model=models["llama"]["target"], device="cuda", quantize="int4"))


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


@pytest.mark.unit
def test_int4_linear_is_the_grouped_4_bit_weights_product():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    quantized = Int4Linear(linear, group_size=32)
    x = torch.randn(3, 5, 64)  # [batch, tokens, in]
    groups = linear.weight.detach().reshape(48, 2, 32)  # [out, groups, size]
    scale = quantized.scales_and_zeros[..., 0].T[..., None]  # [out, groups, 1]
    low = quantized.scales_and_zeros[..., 1].T[..., None] - 8 * scale  # [out, groups, 1]
    dequantized = (torch.round((groups - low) / scale).clamp(0, 15) * scale + low).reshape(48, 64)  # [out, in]
    assert torch.allclose(quantized(x), x @ dequantized.T + linear.bias, atol=1e-4)
    # 16 levels between each group's least and greatest weight: within half a step of the original
    assert bool(((dequantized - linear.weight).abs().reshape(48, 2, 32) <= scale / 2 + 1e-6).all())
    assert torch.equal(quantized(x)[1], quantized(x[1:2])[0])  # rows do not interact


@pytest.mark.unit
def test_a_target_is_quantized_only_when_asked(models):
    assert TargetConfig().quantize == "none"
    plain = engine_from_config(TargetConfig(model=models["llama"]["target"], dtype="bfloat16"))
    assert not any(isinstance(m, (Int8Linear, Int4Linear)) for m in plain.model.modules())
    engine = engine_from_config(TargetConfig(model=models["llama"]["target"], dtype="bfloat16", quantize="int4"))
    linears = [m for m in engine.model.modules() if isinstance(m, (torch.nn.Linear, Int4Linear))]
    assert linears and all(isinstance(m, Int4Linear) for m in linears)
    assert engine.kv_spec is not None  # the batched-forward start-up check passed


@pytest.mark.e2e
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
