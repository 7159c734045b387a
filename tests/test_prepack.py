"""bfloat16 linear layers prepacked for oneDNN (--prepack): the same logits as F.linear."""

from __future__ import annotations

import pytest
import torch

from specdec.config import TargetConfig
from specdec.runtime.engines import engine_from_config
from specdec.runtime.kv_tier import weights_digest
from specdec.runtime.prepack import PackedLinear, packing_available, prepack_linears
from specdec.runtime.session_kv import Row

pytestmark = pytest.mark.unit

needs_packing = pytest.mark.skipif(not packing_available(torch.device("cpu"), torch.bfloat16),
                                   reason="oneDNN here takes no packed bfloat16 linear (no AVX-512 BF16)")


def bfloat16_engine(model: str, prepack: bool):
    return engine_from_config(TargetConfig(model=model, dtype="bfloat16", prepack=prepack))


def decode(engine, prompt: list[int], steps: list[list[int]]) -> list[torch.Tensor]:
    """Logits of a prefill, then of each step's tokens in turn (1 token: a decode step; more: a
    verification) -> per call [tokens, vocab]."""
    entry = engine.new_entry()
    out = [engine.forward("s", entry, prompt, 1)]
    for tokens in steps:
        out.append(engine.forward("s", entry, tokens, len(tokens)))
    return out


@needs_packing
def test_packed_linear_is_f_linear_bit_for_bit():
    torch.manual_seed(0)
    for bias in (False, True):
        linear = torch.nn.Linear(64, 48, bias=bias, dtype=torch.bfloat16)
        packed = PackedLinear(linear)
        for rows in (1, 5, 16):
            x = torch.randn(2, rows, 64, dtype=torch.bfloat16)  # [batch, rows, in]
            assert torch.equal(packed(x), linear(x)), (bias, rows)


@needs_packing
def test_a_prepacked_model_gives_the_plain_models_logits(models):
    path = models["llama"]["target"]
    packed, plain = bfloat16_engine(path, prepack=True), bfloat16_engine(path, prepack=False)
    linears = [m for m in packed.model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]
    assert linears and all(isinstance(m, PackedLinear) for m in linears)
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())
    assert packed.kv_spec is not None  # the batched-forward start-up check passed
    steps = [[7], [9, 10, 11, 12, 13], [14]]  # a decode step, a γ+1 = 5 verification, a step
    for a, b in zip(decode(packed, [5, 6, 7, 8], steps), decode(plain, [5, 6, 7, 8], steps)):
        assert torch.equal(a, b)
    # a batched forward of two sessions, too
    rows = lambda engine: [Row(f"s{i}", engine.new_entry(), tokens, 2)  # noqa: E731
                           for i, tokens in enumerate(([1, 2, 3], [4, 5, 6, 7, 8]))]
    for a, b in zip(packed.forward_batch(rows(packed)), plain.forward_batch(rows(plain))):
        assert torch.equal(a, b)


@needs_packing
def test_a_prepacked_models_weights_digest_like_its_values():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 16, dtype=torch.bfloat16))
    before = weights_digest(model)
    prepack_linears(model)
    assert isinstance(model[0], PackedLinear)
    assert weights_digest(model) == weights_digest(model)  # the packed weight digests (as its values)
    assert weights_digest(model) != before  # another layout's module: not taken for the plain one


def test_only_bfloat16_cpu_models_are_packed(models):
    assert not packing_available(torch.device("cpu"), torch.float32)
    assert not packing_available(torch.device("meta"), torch.bfloat16)
    engine = engine_from_config(TargetConfig(model=models["llama"]["target"], dtype="float32", prepack=True))
    assert not any(isinstance(m, PackedLinear) for m in engine.model.modules())
    model = torch.nn.Sequential(torch.nn.Linear(32, 16))  # float32: left as it is
    assert isinstance(prepack_linears(model)[0], torch.nn.Linear)
