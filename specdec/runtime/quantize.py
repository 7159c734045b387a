"""Weight-only int8 and int4 quantization of a loaded model (`--quantize int8|int4`).

Every nn.Linear becomes an `Int8Linear`: its weight stored as int8 with one scale per output
row (symmetric, round to nearest), activations left in the model's dtype, the product run by
PyTorch's int8-weight matmul kernel (`aten._weight_int8pack_mm`, the one gpt-fast's int8 mode
uses). On a CPU a decode step is bound by reading the weights, so halving their bytes against
bfloat16 shortens the step, while the draft's greedy tokens agree with the target's as often as
before. Dynamic int8 (activations quantized too) is faster still but agrees less often: a worse
draft. The measured step times and agreement are in docs/benchmarks.md. `Int4Linear` stores 4
bits a weight with a scale and a zero per group of 32 inputs (asymmetric, round to nearest, as
gpt-fast's int4 mode) and runs `aten._weight_int4pack_mm_for_cpu`.

Rows are computed independently (no activation scale shared by a batch), so batched and lone
forwards still agree and the engine's start-up check applies as for any model. For a draft
this changes only the proposals: the target verifies every token against the q the draft drew
it from, so the output is the target's. A target is quantized only when asked (`serve target
--quantize int8|int4`, never by auto): the model served is then the quantized one, and the
speculative output equals that model's own greedy output, not the checkpoint's.
"""

from __future__ import annotations

import torch
from torch import nn

from specdec.types import Quantization

QUANTIZATIONS = tuple(Quantization)
INT8_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # activations the kernel takes
INT8_DTYPE_NAMES = ("bfloat16", "float16", "float32")
INT4_GROUP_SIZE = 32  # inputs sharing one scale and zero (gpt-fast's default)
CPU_ONLY = (Quantization.INT8, Quantization.INT4)  # their kernels are CPU ones


def resolve_quantization(quantize: str, device: str, dtype: str) -> str:
    """"none" or "int8" for a model on `device` in `dtype`; ValueError for a bad choice.

    auto: int8 on a CPU in a 16- or 32-bit float dtype (where it pays), else none — a float64
    model (the exactness tests) or a GPU runs unquantized."""
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantize!r}; choose from {', '.join(QUANTIZATIONS)}")
    on_cpu = torch.device(device).type == "cpu"
    if quantize == Quantization.AUTO:
        return Quantization.INT8 if on_cpu and dtype in INT8_DTYPE_NAMES else Quantization.NONE
    if quantize in CPU_ONLY and not on_cpu:
        raise ValueError(f"--quantize {quantize} runs on CPU only (its kernel is a CPU one); got device {device!r}")
    return Quantization(quantize)


def int8_pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest int8 of weight [out, in], one scale per output row ->
    (int8 [out, in], scale [out] in the weight's dtype, float32 if the kernel takes not that)."""
    dtype = weight.dtype if weight.dtype in INT8_DTYPES else torch.float32
    weight = weight.detach().float()  # [out, in]
    scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [out]
    quantized = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()  # [out, in]
    return quantized, scale.to(dtype)


def int4_pack(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest 4-bit of weight [out, in] in groups of `group_size` inputs,
    packed for `aten._weight_int4pack_mm_for_cpu` -> (packed uint8 [out, in / 2],
    scales and zeros [in / group_size, out, 2] in the weight's dtype). The kernel computes each
    weight as (q - 8)·scale + zero, so zero = min + 8·scale. Needs out % 16 == 0 and
    in % group_size == 0."""
    out_features, in_features = weight.shape
    groups = weight.detach().float().reshape(out_features, in_features // group_size, group_size)  # [out, g, size]
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [out, g]
    scale = (high - low).clamp(min=1e-6) / 15.0  # [out, g]
    quantized = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)  # [out, g, size]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        quantized.reshape(out_features, in_features).to(torch.int32), 1)  # [out, in / 2]
    scales_and_zeros = torch.stack([scale, low + 8 * scale], dim=-1).transpose(0, 1)  # [g, out, 2]
    return packed, scales_and_zeros.to(weight.dtype).contiguous()


class Int8Linear(nn.Module):
    """y = x·(W_q·s)ᵀ + b with W_q int8 [out, in] and s one scale per output row."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight_int8, scale = int8_pack(linear.weight)  # [out, in], [out]
        dtype = scale.dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_int8", weight_int8)  # [out, in]
        self.register_buffer("scale", scale)  # [out]
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


class Int4Linear(nn.Module):
    """y = x·Wᵀ + b with W in 4 bits [out, in], a scale and a zero per group of inputs."""

    def __init__(self, linear: nn.Linear, group_size: int = INT4_GROUP_SIZE) -> None:
        super().__init__()
        dtype = linear.weight.dtype if linear.weight.dtype in INT8_DTYPES else torch.float32
        self.in_features, self.out_features, self.group_size = linear.in_features, linear.out_features, group_size
        weight_int4, scales_and_zeros = int4_pack(linear.weight.to(dtype), group_size)
        self.register_buffer("weight_int4", weight_int4)  # [out, in / 2] packed
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [in / group, out, 2]
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.scales_and_zeros.dtype
        flat = x.reshape(-1, self.in_features).to(dtype).contiguous()  # [tokens, in]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.weight_int4, self.group_size,
                                                       self.scales_and_zeros)  # [tokens, out]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weight=int4 in groups of {self.group_size}")


def int4_fits(linear: nn.Linear, group_size: int = INT4_GROUP_SIZE) -> bool:
    """Whether the int4 kernel takes this layer's shape (out a multiple of 16, in of the group)."""
    return linear.out_features % 16 == 0 and linear.in_features % group_size == 0


def quantized_linear(linear: nn.Linear, quantize: Quantization) -> nn.Module:
    """The layer in `quantize` (INT8 or INT4); a layer the int4 kernel cannot take stays as it is."""
    if quantize == Quantization.INT8:
        return Int8Linear(linear)
    return Int4Linear(linear) if int4_fits(linear) else linear


def quantize_linears(model: nn.Module, quantize: Quantization) -> nn.Module:
    """Replace every nn.Linear of `model` (in place) with its INT8 or INT4 form; returns the model.
    A head tied to the input embeddings gets its own quantized copy (the embeddings stay as they are)."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, quantized_linear(child, quantize))
        else:
            quantize_linears(child, quantize)
    return model
