"""bfloat16 linear layers with their weights prepacked for oneDNN (--prepack, on by default).

F.linear of a bfloat16 weight on a CPU hands torch's plain [out, in] layout to oneDNN on every
call. `PackedLinear` reorders the weight once, at load, into the blocked layout oneDNN's
matmul reads (`mkldnn._reorder_linear_weight`, what inductor's weight freezing does for a CPU)
and runs `mkldnn._linear_pointwise` on it: the same products on another layout, which on a
CPU with AVX-512 BF16 reads the weights faster at the 1–16 rows of a decode step or a
verification (bench/matvec.py; figures in docs/benchmarks.md). Where the CPU or the build
takes no packed bfloat16 linear (AVX2 only), the model is left as it is and the log says so.

A head tied to the input embeddings gets its own packed copy; the embeddings stay as they are.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

PACKED_DTYPE = torch.bfloat16


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] bfloat16 -> the same values in oneDNN's blocked layout (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] · packedᵀ + bias -> [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN here runs a packed linear of this dtype on this device: a bfloat16 model on a
    CPU whose oneDNN takes bfloat16, checked by packing and running a small one."""
    if device.type != "cpu" or dtype != PACKED_DTYPE or not torch.backends.mkldnn.is_available():
        return False
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        weight = torch.ones(32, 32, dtype=PACKED_DTYPE)  # [out, in]
        packed_linear(torch.ones(1, 32, dtype=PACKED_DTYPE), pack_weight(weight), None)
    except (RuntimeError, AttributeError):
        return False
    return True


class PackedLinear(nn.Module):
    """y = x·Wᵀ + b with W [out, in] held in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_packed", pack_weight(linear.weight))  # [out, in], blocked
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())  # [out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.weight_packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=oneDNN packed"


def prepack_linears(model: nn.Module) -> nn.Module:
    """Replace every bfloat16 nn.Linear of `model` (in place) with a PackedLinear; returns the model."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear) and child.weight.dtype == PACKED_DTYPE:
            setattr(model, name, PackedLinear(child))
        else:
            prepack_linears(child)
    return model
