"""One rank's shards of a Llama / Qwen2 / Mistral checkpoint, read from its safetensors.

What this module decides:
- A rank reads only its own rows and columns of each projection (safetensors' `get_slice`), so no
  process ever holds the whole decoder (a 70B is never read whole into one process); the
  replicated tensors (embedding, norms, output head) are read whole by every rank.
- The slices are the ones parallel.py's maps name, fused as model.py fuses them (q/k/v rows, then
  gate/up rows), so a rank's GraphModel is `shard_layer` of the full one, tensor for tensor.
- The rotary frequencies come from the model type's own transformers rotary module built from
  the config (no weights), so they are the ones `GraphModel.from_hf` takes.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch

from specdec.runtime.graph.model import ROPE_TYPES, GraphModel, LayerWeights, arch_config
from specdec.runtime.graph.parallel import ShardPlan, TensorParallel, sharded_arch, shard_plan
from specdec.tokenizer import ModelLoadError

ROTARY_CLASSES = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}  # model_type -> class prefix


def rotary_of(config: Any) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] float32, attention scaling) of a config's rotary embedding."""
    prefix = ROTARY_CLASSES[config.model_type]
    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    rotary = getattr(module, f"{prefix}RotaryEmbedding")(config=config)
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"the graph engine takes rope types {', '.join(ROPE_TYPES)}, not {rope_type!r} "
                             "(its frequencies change with the length); use --backend torch")
    return rotary.inv_freq.detach().clone(), float(rotary.attention_scaling)


class Checkpoint:
    """The tensors of a directory's safetensors files, read by name and slice."""

    def __init__(self, directory: str | Path):
        from safetensors import safe_open

        directory = Path(directory)
        index = directory / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = [p.name for p in sorted(directory.glob("*.safetensors"))]
        if not files:
            raise ModelLoadError(f"--tensor-parallel-size reads safetensors; {directory} holds none")
        self.handles = [safe_open(str(directory / name), framework="pt") for name in files]
        self.where = {key: handle for handle in self.handles for key in handle.keys()}

    def has(self, name: str) -> bool:
        return name in self.where

    def rows(self, name: str, ranges: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """The tensor's rows in `ranges` concatenated (all of it when None)."""
        if name not in self.where:
            raise ModelLoadError(f"the checkpoint has no tensor {name!r}")
        part = self.where[name].get_slice(name)
        if ranges is None:
            return part[:]
        return torch.cat([part[a:b] for a, b in ranges])

    def columns(self, name: str, first: int, end: int) -> torch.Tensor:
        """The matrix's columns [first, end)."""
        return self.where[name].get_slice(name)[:, first:end]


def _rows_of(ckpt: Checkpoint, names: list[str], ranges: list[tuple[int, int]], bias: bool) -> torch.Tensor | None:
    """Each named matrix's (or bias's) range, concatenated: a fused column-parallel weight."""
    suffix = "bias" if bias else "weight"
    if bias and not any(ckpt.has(f"{n}.bias") for n in names):
        return None
    parts = []
    for name, (a, b) in zip(names, ranges):
        key = f"{name}.{suffix}"
        parts.append(ckpt.rows(key, [(a, b)]) if ckpt.has(key) else torch.zeros(b - a))
    return torch.cat([p.to(parts[0].dtype) for p in parts])


def load_layer(ckpt: Checkpoint, i: int, plan: ShardPlan, head_dim: int) -> LayerWeights:
    """Layer i's shards for one rank (in the checkpoint's dtype)."""
    p = f"model.layers.{i}"
    attn, mlp = f"{p}.self_attn", f"{p}.mlp"
    (q0, q1), (k0, k1), (m0, m1) = plan.heads, plan.kv_heads, plan.intermediate
    qkv_ranges = [(q0 * head_dim, q1 * head_dim), (k0 * head_dim, k1 * head_dim), (k0 * head_dim, k1 * head_dim)]
    qkv_names = [f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"]
    mlp_names = [f"{mlp}.gate_proj", f"{mlp}.up_proj"]
    first = plan.rank == 0  # row-parallel biases are added once, by rank 0
    return LayerWeights(
        ckpt.rows(f"{p}.input_layernorm.weight"),
        _rows_of(ckpt, qkv_names, qkv_ranges, False),  # [(H/N + 2 kv/N) × dim, hidden]
        _rows_of(ckpt, qkv_names, qkv_ranges, True),
        ckpt.columns(f"{attn}.o_proj.weight", q0 * head_dim, q1 * head_dim),  # [hidden, H/N × dim]
        ckpt.rows(f"{attn}.o_proj.bias") if first and ckpt.has(f"{attn}.o_proj.bias") else None,
        ckpt.rows(f"{p}.post_attention_layernorm.weight"),
        _rows_of(ckpt, mlp_names, [(m0, m1), (m0, m1)], False),  # [2 × intermediate/N, hidden]
        _rows_of(ckpt, mlp_names, [(m0, m1), (m0, m1)], True),
        ckpt.columns(f"{mlp}.down_proj.weight", m0, m1),  # [hidden, intermediate/N]
        ckpt.rows(f"{mlp}.down_proj.bias") if first and ckpt.has(f"{mlp}.down_proj.bias") else None)


def load_shard(directory: str | Path, dtype: torch.dtype, device: torch.device | str, rank: int, size: int,
               parallel: TensorParallel | None = None) -> GraphModel:
    """Rank `rank` of `size`'s GraphModel from a checkpoint directory (its shards only)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(directory))
    arch = arch_config(config)
    plan = shard_plan(arch.heads, arch.kv_heads, config.intermediate_size, rank, size)
    ckpt = Checkpoint(directory)
    device = torch.device(device)

    def place(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.to(device=device, dtype=dtype).contiguous()

    layers = []
    for i in range(arch.layers):
        layer = load_layer(ckpt, i, plan, arch.head_dim)
        layers.append(LayerWeights(*(place(getattr(layer, f)) for f in LayerWeights.__dataclass_fields__)))
    embed = place(ckpt.rows("model.embed_tokens.weight"))
    head = place(ckpt.rows("lm_head.weight")) if ckpt.has("lm_head.weight") else embed  # tied: the embedding
    inv_freq, scaling = rotary_of(config)
    return GraphModel(sharded_arch(arch, plan), embed, layers, place(ckpt.rows("model.norm.weight")), head,
                      inv_freq.to(device), scaling, parallel)


def decoder_bytes(model: GraphModel) -> int:
    """Bytes of the decoder layers' parameters one model (or rank) holds."""
    return sum(t.numel() * t.element_size() for layer in model.layers
               for t in vars(layer).values() if t is not None)
