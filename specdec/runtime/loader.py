"""Load any HF causal LM and its tokenizer: a directory, a hub id or a .gguf file."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

# the tokenizer half lives in specdec.tokenizer (no torch)
from specdec.tokenizer import ModelLoadError, load_tokenizer, model_source
from specdec.types import Quantization

log = logging.getLogger(__name__)

TORCH_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel in eval mode on `device`
    tokenizer: Any  # a transformers tokenizer
    model_id: str
    dtype: torch.dtype
    device: torch.device
    # --heads: target_heads.LoadedHeads, loaded with the model (target_heads.load_for); None: none
    heads: Any = None


def load_model(spec: str, dtype: str = "float32", device: str = "cpu",
               trust_remote_code: bool = False, quantize: str = Quantization.NONE,
               prepack: bool = False, heads: str = "") -> LoadedModel:
    """Load model + tokenizer through transformers' Auto classes.

    heads: a heads directory (`serve target --heads`) loaded for this model on its device in its
    dtype, before its linears are packed or quantized (their identity check reads the plain
    output layer); HeadsMismatch when they belong to another model.

    prepack: a bfloat16 model's linear weights reordered once for oneDNN where this CPU takes it
    (specdec/runtime/prepack.py): the same products, faster; a quantized model is not touched.

    quantize "int8" / "int4": weight-only int8 or int4 linear layers (specdec/runtime/quantize.py),
    CPU only; activations and K/V stay in `dtype` (float32 for a float64 request: the kernels
    take 16- and 32-bit floats). "auto": int8 on a CPU in a 16/32-bit dtype, else none."""
    from transformers import AutoModelForCausalLM

    from specdec.runtime.prepack import packing_available, prepack_linears
    from specdec.runtime.quantize import CPU_ONLY, quantize_linears, resolve_quantization

    if not spec:
        raise ModelLoadError("no model given: pass --model DIR|HUB_ID|FILE.gguf")
    if dtype not in TORCH_DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose from {', '.join(TORCH_DTYPES)}")
    try:
        quantize = resolve_quantization(quantize, device, dtype)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    if quantize in CPU_ONLY and dtype == "float64":
        log.info("--quantize %s: %s runs in float32 (the kernel takes no float64)", quantize, spec)
        dtype = "float32"
    source, extra = model_source(spec)
    torch_dtype = TORCH_DTYPES[dtype]
    tokenizer = load_tokenizer(spec, trust_remote_code)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch_dtype, trust_remote_code=trust_remote_code, **extra
        )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model {spec!r}: {exc}") from exc
    target_device = torch.device(device)
    model = model.to(device=target_device, dtype=torch_dtype).eval()
    loaded_heads = None
    if heads:
        from specdec.runtime.target_heads import load_for

        loaded_heads = load_for(heads, model, target_device, torch_dtype)
    if quantize in CPU_ONLY:
        model = quantize_linears(model, quantize)
    packed = prepack and quantize == Quantization.NONE and packing_available(target_device, torch_dtype)
    if packed:
        model = prepack_linears(model)
        if loaded_heads is not None and loaded_heads.vocab is not None:
            prepack_linears(loaded_heads.vocab)  # the heads' rows of the output layer, like the layer
    elif prepack and quantize == Quantization.NONE and torch_dtype == torch.bfloat16 and target_device.type == "cpu":
        log.info("--prepack: oneDNN here takes no packed bfloat16 linear; %s runs unpacked", spec)
    linears = f", {quantize} linears" if quantize in CPU_ONLY else ", oneDNN-packed linears" if packed else ""
    log.info("loaded %s (%s%s on %s)", spec, dtype, linears, target_device)
    return LoadedModel(model, tokenizer, spec, torch_dtype, target_device, loaded_heads)


def eos_token_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """Every id that ends generation: the generation config's and the tokenizer's."""
    ids: set[int] = set()
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (config_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))


def max_context_length(model: Any, tokenizer: Any) -> int:
    config = model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return int(min(tokenizer.model_max_length, 1 << 20))
