"""Random-weight models of Qwen2.5's real shapes for bench/gpu.py: a machine without network
gets no checkpoint, but a step's time does not depend on the weights' values, so these give
real step times, and their acceptance is set by construction:

- target: the shape asked for (Qwen2.5-1.5B or -7B: hidden size, layers, heads, vocabulary);
- selfdraft: the target's embeddings, first --draft-layers layers, final norm and lm_head; the
  target's later layers have o_proj and down_proj zeroed, so they add nothing to the residual
  stream and the two models agree in exact arithmetic: acceptance ≈ 1 (rounding aside), the best
  case speculation can meet;
- indep: an unrelated smaller model (Qwen2.5-0.5B's shape): acceptance ≈ 0, the case the
  adaptive policy must recognise.

The tokenizer is Qwen2.5's (the files `specdec models fetch` leaves in its cache, given as a
directory) or, where none is at hand, specdec_cli.tiny's byte-level one with a tiny shape.
Output rows of ids past the tokenizer's ordinary vocabulary (special and padding ids) are
zeroed, so random weights rarely pick one.
"""

from __future__ import annotations

import functools
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TINY_TOKENIZER = "tiny"  # the tokenizer's name when specdec_cli.tiny built it
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")


@dataclass(frozen=True)
class Shape:
    """A decoder's dimensions (Qwen2 architecture)."""

    hidden: int  # model width
    intermediate: int  # MLP width
    layers: int  # decoder layers
    heads: int  # query heads
    kv_heads: int  # key/value heads
    tie: bool  # input embeddings and lm_head are one tensor
    indep: str  # the shape of the unrelated draft paired with this one as a target


SHAPES = {
    "7b": Shape(3584, 18944, 28, 28, 4, False, "0.5b"),
    "1.5b": Shape(1536, 8960, 28, 12, 2, False, "0.5b"),
    "0.5b": Shape(896, 4864, 24, 14, 2, True, "0.5b"),
    "small": Shape(256, 768, 8, 4, 2, False, "tiny"),  # a CPU-sized model with the real vocabulary
    "tiny": Shape(64, 128, 6, 4, 2, False, "tiny-indep"),  # the no-tokenizer fallback
    "tiny-indep": Shape(32, 64, 2, 4, 2, False, "tiny-indep"),
}
QWEN_VOCAB = 151936  # Qwen2.5's embedding rows (the tokenizer's ids, padded)
CONTEXT = 2048  # the runs need under 1k tokens; the graph engine captures buckets up to the context


@dataclass
class BuiltModel:
    """One model saved under the run's temporary directory."""

    role: str  # target, selfdraft or indep
    shape: str  # a SHAPES key
    path: str  # the saved directory (safetensors, config, tokenizer)
    layers: int  # decoder layers it has
    weight_bytes: int  # bytes of every weight (tied tensors once): the roofline's numerator
    params: int  # parameters (tied tensors once)


@functools.lru_cache(maxsize=4)
def load_tokenizer(directory: str) -> Any:
    """The tokenizer of `directory` (Qwen2.5's files), or specdec_cli.tiny's when it is TINY_TOKENIZER."""
    if directory == TINY_TOKENIZER:
        from specdec_cli.tiny import byte_level_tokenizer

        return byte_level_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def config(shape: Shape, vocab: int, eos: int | None, layers: int | None = None, tie: bool | None = None) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                       num_hidden_layers=layers or shape.layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.kv_heads, max_position_embeddings=CONTEXT, rope_theta=1e6,
                       rms_norm_eps=1e-6, tie_word_embeddings=shape.tie if tie is None else tie,
                       bos_token_id=None, eos_token_id=eos, pad_token_id=eos)


def random_model(cfg: Any, dtype: torch.dtype, device: str, seed: int, ordinary: int) -> Any:
    """A random model built on `device` (seconds on a GPU), output rows >= `ordinary` zeroed."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():
        model.lm_head.weight[ordinary:] = 0
    return model.eval()


def weight_stats(model: Any) -> tuple[int, int]:
    """(bytes, parameters) of every weight, a tied tensor once."""
    params = list(model.parameters())  # parameters() yields a tied tensor once
    return sum(p.numel() * p.element_size() for p in params), sum(p.numel() for p in params)


def save(model: Any, out: Path, tokenizer: Any, tokenizer_dir: str) -> None:
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer_dir == TINY_TOKENIZER:
        tokenizer.save_pretrained(out)
        return
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, out / name)


def build_set(root: Path, shape_name: str, tokenizer_dir: str, dtype: torch.dtype, device: str,
              draft_layers: int) -> dict[str, BuiltModel]:
    """target, selfdraft and indep of one target shape, saved under root -> role: BuiltModel."""
    shape = SHAPES[shape_name]
    if draft_layers >= shape.layers:
        raise SystemExit(f"bench/gpu.py: --draft-layers {draft_layers} must be below the {shape_name} "
                         f"shape's {shape.layers} layers")
    tokenizer = load_tokenizer(tokenizer_dir)
    ordinary = tokenizer.vocab_size  # ids past it are special or padding
    vocab = QWEN_VOCAB if tokenizer_dir != TINY_TOKENIZER else len(tokenizer)
    eos = tokenizer.eos_token_id
    built = {}
    target = random_model(config(shape, vocab, eos), dtype, device, 0, ordinary)
    with torch.no_grad():  # later layers add nothing to the residual stream: the self-draft agrees
        for layer in target.model.layers[draft_layers:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    size, params = weight_stats(target)
    save(target, root / "target", tokenizer, tokenizer_dir)
    built["target"] = BuiltModel("target", shape_name, str(root / "target"), shape.layers, size, params)
    target.model.layers = target.model.layers[:draft_layers]  # the same tensors: embeddings, layers, head
    target.config.num_hidden_layers = draft_layers
    if getattr(target.config, "layer_types", None):
        target.config.layer_types = target.config.layer_types[:draft_layers]
    size, params = weight_stats(target)
    save(target, root / "selfdraft", tokenizer, tokenizer_dir)
    built["selfdraft"] = BuiltModel("selfdraft", shape_name, str(root / "selfdraft"), draft_layers, size, params)
    del target
    indep_shape = SHAPES[shape.indep]
    indep = random_model(config(indep_shape, vocab, eos), dtype, device, 2, ordinary)
    size, params = weight_stats(indep)
    save(indep, root / "indep", tokenizer, tokenizer_dir)
    built["indep"] = BuiltModel("indep", shape.indep, str(root / "indep"), indep_shape.layers, size, params)
    del indep
    free_device_memory(device)
    return built


def free_device_memory(device: str) -> None:
    import gc

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
