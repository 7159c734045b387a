"""Weight quantization of a loaded model (the draft's option `--quantize`).

`int8`: PyTorch's dynamic quantization — every nn.Linear's weights stored as int8 (per-tensor
scale), activations quantized on the fly per call — run by the CPU's int8 kernels (fbgemm;
VNNI / AMX where the CPU has them). A decode step reads a quarter of the float32 weight bytes,
half of bfloat16's, and on CPUs decode steps are bound by reading the weights: on the 2-core
dev machine the 0.5B draft's step went from ≈100 ms (bfloat16) to ≈44 ms.

For a draft this is free of risk to the output: the target verifies every token and the
acceptance step uses the q the draft actually sampled from. Its proposals are those of a
slightly different model (acceptance may move a little), and because activations are quantized
per call, a row's logits can depend slightly on the other rows of a batched forward (the
runner's start-up check then decides whether it batches). Never quantize a target: its output
IS the product.
"""

from __future__ import annotations

import warnings

import torch

QUANTIZATIONS = ("none", "int8")


def check_quantization(quantize: str, device: str) -> None:
    """ValueError unless `quantize` is known and runs on `device`."""
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantize!r}; choose from {', '.join(QUANTIZATIONS)}")
    if quantize == "int8" and torch.device(device).type != "cpu":
        raise ValueError(f"--quantize int8 runs on CPU only (its kernels are fbgemm's); got device {device!r}")


def quantize_int8(model: torch.nn.Module) -> torch.nn.Module:
    """nn.Linear layers -> dynamically quantized int8 ones (CPU, float32 model, in place)."""
    with warnings.catch_warnings():  # torch.ao.quantization announces its move to torchao
        warnings.simplefilter("ignore")
        from torch.ao.quantization import quantize_dynamic

        return quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
