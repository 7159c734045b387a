"""Weight-only int8 quantization of a loaded model (the draft's option `--quantize int8`).

Every nn.Linear becomes an `Int8Linear`: its weight stored as int8 with one scale per output
row (symmetric, round to nearest), activations left in the model's dtype, the product run by
PyTorch's int8-weight matmul kernel (`aten._weight_int8pack_mm`, the one gpt-fast's int8 mode
uses). On a CPU a decode step is bound by reading the weights, so halving their bytes against
bfloat16 shortens the step, while the draft's greedy tokens agree with the target's as often as
before. Dynamic int8 (activations quantized too) is faster still but agrees less often: a worse
draft. The measured step times and agreement are in docs/benchmarks.md.

Rows are computed independently (no activation scale shared by a batch), so batched and lone
forwards still agree and the runner's start-up check applies as for any model. For a draft
this changes only the proposals: the target verifies every token against the q the draft drew
it from, so the output is the target's. Never quantize a target: its output IS the product.
"""

from __future__ import annotations

import torch
from torch import nn

from specdec.types import Quantization

QUANTIZATIONS = tuple(Quantization)
INT8_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # activations the kernel takes
INT8_DTYPE_NAMES = ("bfloat16", "float16", "float32")


def resolve_quantization(quantize: str, device: str, dtype: str) -> str:
    """"none" or "int8" for a model on `device` in `dtype`; ValueError for a bad choice.

    auto: int8 on a CPU in a 16- or 32-bit float dtype (where it pays), else none — a float64
    model (the exactness tests) or a GPU runs unquantized."""
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantize!r}; choose from {', '.join(QUANTIZATIONS)}")
    on_cpu = torch.device(device).type == "cpu"
    if quantize == Quantization.AUTO:
        return Quantization.INT8 if on_cpu and dtype in INT8_DTYPE_NAMES else Quantization.NONE
    if quantize == Quantization.INT8 and not on_cpu:
        raise ValueError(f"--quantize int8 runs on CPU only (its kernel is a CPU one); got device {device!r}")
    return Quantization(quantize)


class Int8Linear(nn.Module):
    """y = x·(W_q·s)ᵀ + b with W_q int8 [out, in] and s one scale per output row."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # [out, in]
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [out]
        dtype = linear.weight.dtype if linear.weight.dtype in INT8_DTYPES else torch.float32
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_int8", torch.round(weight / scale[:, None]).clamp(-127, 127)
                             .to(torch.int8).contiguous())  # [out, in]
        self.register_buffer("scale", scale.to(dtype))  # [out]
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.scale.dtype
        flat = x.reshape(-1, self.in_features).to(dtype).contiguous()  # [tokens, in]
        y = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scale)  # [tokens, out]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=int8"


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear of `model` (in place) with an Int8Linear; returns the model.
    A head tied to the input embeddings gets its own int8 copy (the embeddings stay as they are)."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8Linear(child))
        else:
            quantize_int8(child)
    return model
