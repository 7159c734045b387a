"""Weight-only int8 / int4 linear layers (--quantize): a quantized draft keeps the output, a
quantized target serves exactly its own (quantized) greedy output.

Here the unit tests; the other tiers' are in tests/e2e/test_quantize.py.
"""

from __future__ import annotations

import pytest
import torch

from specdec.config import DraftConfig, TargetConfig
from specdec.runtime.loader import load_model
from specdec.tokenizer import ModelLoadError
from specdec.runtime.quantize import Int4Linear, Int8Linear
from specdec.runtime.engines import engine_from_config


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


def test_int8_is_cpu_only_and_unknown_quantizations_are_refused(models):
    with pytest.raises(ModelLoadError, match="CPU only"):
        engine_from_config(DraftConfig(model=models["llama"]["draft"], device="cuda", quantize="int8"))
    with pytest.raises(ModelLoadError, match="unknown quantization"):
        load_model(models["llama"]["draft"], "float32", quantize="int3")
    with pytest.raises(ModelLoadError, match="CPU only"):
        engine_from_config(TargetConfig(model=models["llama"]["target"], device="cuda", quantize="int4"))


def test_auto_quantizes_a_cpu_draft_unless_float64():
    from specdec.runtime.quantize import resolve_quantization

    assert resolve_quantization("auto", "cpu", "bfloat16") == "int8"
    assert resolve_quantization("auto", "cpu", "float32") == "int8"
    assert resolve_quantization("auto", "cpu", "float64") == "none"  # exactness tests run unquantized
    assert resolve_quantization("auto", "cuda:0", "bfloat16") == "none"
    assert resolve_quantization("none", "cpu", "bfloat16") == "none"
    with pytest.raises(ValueError, match="CPU only"):
        resolve_quantization("int8", "cuda", "bfloat16")


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


def test_a_target_is_quantized_only_when_asked(models):
    assert TargetConfig().quantize == "none"
    plain = engine_from_config(TargetConfig(model=models["llama"]["target"], dtype="bfloat16"))
    assert not any(isinstance(m, (Int8Linear, Int4Linear)) for m in plain.model.modules())
    engine = engine_from_config(TargetConfig(model=models["llama"]["target"], dtype="bfloat16", quantize="int4"))
    linears = [m for m in engine.model.modules() if isinstance(m, (torch.nn.Linear, Int4Linear))]
    assert linears and all(isinstance(m, Int4Linear) for m in linears)
    assert engine.kv_spec is not None  # the batched-forward start-up check passed
