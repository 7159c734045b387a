"""Llama / Qwen2 / Mistral decoder written for static shapes over the paged K/V pool.

What this module decides:
- Weights come from the transformers model specdec/runtime/loader.py loads (the same
  safetensors or HF directory, same dtype and device): `GraphModel.from_hf` takes its tensors
  (norms and embeddings shared, q/k/v and gate/up concatenated into one matrix each, so a
  layer is 4 matrix products), `GraphModel.load` goes through `load_model` and frees each HF
  projection as soon as it is fused.
- Numerics follow transformers' own modules so the logits agree to the dtype's rounding: the
  RMS of RMSNorm is taken in float32 and the rotary angles are float32 (as transformers does),
  the inverse frequencies and their attention scaling are the HF model's own (default, linear,
  llama3 and yarn rope types; dynamic and longrope, which change with the length, are refused).
- GQA without copying K/V: the query heads that share a K/V head are folded into the query
  length ([R, kv_heads, group × Q, dim] against [R, kv_heads, K, dim]), so each gathered key is
  read once per K/V head and any SDPA kernel that takes a mask applies (no enable_gqa needed).
- Attention is torch's scaled_dot_product_attention over each row's K/V gathered through its
  block table, with a boolean mask [R, 1, Q, K] built on the device from the batch tensors.
  Why SDPA and not flex_attention: it runs eagerly on every device and dtype, float64 included
  (the exactness tests), with no compilation step, and its mask is a plain tensor whose shape
  is fixed by the bucket, so one CUDA graph per bucket captures it; flex_attention needs
  torch.compile to be fast and block masks rebuilt per batch. The cost is reading B × block_size
  keys per row (the bucket's block count, not the row's length): context buckets bound it.
- Every step is a fixed-shape tensor operation with no host synchronisation, so the forward
  can be captured in a CUDA graph as it is (cuda_graphs.py).
- Sliding-window layers (Mistral, Qwen2 with use_sliding_window) see every key while a sequence
  is no longer than the window, so the model's context is capped at the window (max_context).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from specdec.runtime.graph.batch import ForwardBatch
from specdec.runtime.graph.paged_kv import DEFAULT_BLOCK_SIZE, PoolSpec
from specdec.tokenizer import ModelLoadError

ARCHITECTURES = ("llama", "qwen2", "mistral")  # config.model_type values this model covers
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # rotary types whose frequencies are fixed


@dataclass(frozen=True)
class ArchConfig:
    """The facts of a checkpoint the forward needs."""

    model_type: str  # llama, qwen2 or mistral
    vocab_size: int  # rows of the output head
    hidden: int  # model width
    layers: int  # decoder layers
    heads: int  # query heads
    kv_heads: int  # key/value heads (GQA when fewer than heads)
    head_dim: int  # channels per head
    eps: float  # RMSNorm epsilon
    act: str  # MLP activation name (transformers' ACT2FN key)
    max_context: int  # the longest sequence served (capped at a sliding window)


@dataclass
class LayerWeights:
    """One decoder layer's tensors (biases None where the checkpoint has none)."""

    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(heads + 2 kv_heads) × head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(heads + 2 kv_heads) × head_dim] (Qwen2)
    o: torch.Tensor  # [hidden, heads × head_dim]
    o_bias: torch.Tensor | None  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 × intermediate, hidden]
    gate_up_bias: torch.Tensor | None  # [2 × intermediate]
    down: torch.Tensor  # [hidden, intermediate]
    down_bias: torch.Tensor | None  # [hidden]


def arch_config(config: Any) -> ArchConfig:
    """ModelLoadError naming what this model does not cover."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ModelLoadError(f"the graph engine covers {', '.join(ARCHITECTURES)} models, not {model_type!r}; "
                             "use --backend torch")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    context = config.max_position_embeddings
    window = sliding_window(config)
    return ArchConfig(model_type, config.vocab_size, config.hidden_size, config.num_hidden_layers, heads,
                      getattr(config, "num_key_value_heads", None) or heads, head_dim, config.rms_norm_eps,
                      config.hidden_act, min(context, window) if window else context)


def sliding_window(config: Any) -> int | None:
    """The window of the model's sliding-window layers, None when every layer sees everything."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window:
        return None
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    return window if config.model_type == "mistral" else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., hidden] -> [..., hidden]; the RMS in float32, as transformers takes it."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotary(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [R, Q] -> cos, sin [R, Q, 1, head_dim] (angles in float32, as transformers)."""
    freqs = positions[..., None].to(torch.float32) * inv_freq.to(torch.float32)  # [R, Q, dim/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [R, Q, dim]
    cos = (angles.cos() * scaling).to(dtype)
    sin = (angles.sin() * scaling).to(dtype)
    return cos[:, :, None], sin[:, :, None]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [R, Q, heads, dim] rotated by its tokens' angles."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


def attention_mask(batch: ForwardBatch, keys: int) -> torch.Tensor:
    """What each query sees among its row's first `keys` gathered keys -> [R, 1, Q, K] bool."""
    R, Q = batch.key_index.shape
    W = batch.window_mask.shape[2]
    j = torch.arange(keys, device=batch.key_index.device)[None, None, :]  # [1, 1, K]
    own = batch.key_index[:, :, None]  # [R, Q, 1]
    start = batch.window_start[:, None, None]  # [R, 1, 1]
    history = (j < start) & (j <= own)  # [R, Q, K]
    node = (j - start).clamp(0, W - 1).expand(R, Q, keys)  # [R, Q, K]
    in_tree = (j >= start) & batch.window_mask.gather(2, node)  # [R, Q, K]
    allowed = (history | in_tree) & (j < batch.kv_lens[:, None, None])
    allowed = allowed | ((own < 0) & (j == 0))  # padding sees key 0, so no row is all masked
    return allowed[:, None]


class GraphModel:
    """The decoder: `forward(batch, pools)` writes the batch's K/V into the pool and returns logits."""

    def __init__(self, arch: ArchConfig, embed: torch.Tensor, layers: list[LayerWeights], norm: torch.Tensor,
                 head: torch.Tensor, inv_freq: torch.Tensor, rope_scaling: float, parallel: Any = None):
        """parallel: this rank's parallel.TensorParallel when the layers are one rank's shards
        (arch then counts the rank's own heads); None on one device."""
        from transformers.activations import ACT2FN

        self.arch = arch
        self.embed = embed  # [vocab, hidden]
        self.layers = layers
        self.norm = norm  # [hidden]
        self.head = head  # [vocab, hidden] (the embedding itself when tied)
        self.inv_freq = inv_freq  # [head_dim / 2] float32
        self.rope_scaling = rope_scaling  # cos/sin multiplier (yarn's attention factor; 1 otherwise)
        self.act = ACT2FN[arch.act]
        self.parallel = parallel
        self.dtype = embed.dtype
        self.device = embed.device

    @classmethod
    def from_hf(cls, model: Any, consume: bool = False) -> "GraphModel":
        """The weights of a transformers Llama / Qwen2 / Mistral causal LM (not quantized).

        consume: free each HF projection once fused (the HF model is unusable afterwards)."""
        arch = arch_config(model.config)
        rotary_emb = model.model.rotary_emb
        rope_type = getattr(rotary_emb, "rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ModelLoadError(f"the graph engine takes rope types {', '.join(ROPE_TYPES)}, not {rope_type!r} "
                                 "(its frequencies change with the length); use --backend torch")
        layers = [fused_layer(layer, consume) for layer in model.model.layers]
        return cls(arch, model.get_input_embeddings().weight.detach(), layers, model.model.norm.weight.detach(),
                   model.get_output_embeddings().weight.detach(), rotary_emb.inv_freq.detach().clone(),
                   float(rotary_emb.attention_scaling))

    @classmethod
    def load(cls, spec: str, dtype: str = "float32", device: str = "cpu",
             trust_remote_code: bool = False) -> tuple["GraphModel", Any]:
        """(the model, its tokenizer) from a directory or hub id, through loader.load_model."""
        from specdec.runtime.loader import load_model

        loaded = load_model(spec, dtype, device, trust_remote_code)
        return cls.from_hf(loaded.model, consume=True), loaded.tokenizer

    def pool_spec(self, block_size: int = DEFAULT_BLOCK_SIZE) -> PoolSpec:
        return PoolSpec(self.arch.layers, self.arch.kv_heads, self.arch.head_dim, self.dtype, self.device,
                        block_size)

    def forward(self, batch: ForwardBatch, pools: list[torch.Tensor], keep: int | None = None) -> torch.Tensor:
        """Write the batch's K/V into `pools` (PagedKV.pools) and return the logits of each row's
        last `keep` columns (all Q when None) -> [R, keep, vocab] in the model's dtype."""
        return self.logits(self.hidden_states(batch, pools, keep))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer: final-norm hidden states [..., hidden] -> logits [..., vocab]."""
        return F.linear(hidden, self.head)

    def hidden_states(self, batch: ForwardBatch, pools: list[torch.Tensor], keep: int | None = None) -> torch.Tensor:
        """forward without the output layer: the final-norm hidden states of each row's last `keep`
        columns (what the output layer takes, and a target's heads) -> [R, keep, hidden]."""
        arch = self.arch
        R, Q = batch.tokens.shape
        B = batch.block_tables.shape[1]
        block_size = pools[0].shape[2]
        group = arch.heads // arch.kv_heads
        mask = attention_mask(batch, B * block_size).repeat(1, 1, group, 1)  # [R, 1, group·Q, K]
        cos, sin = rotary(batch.positions, self.inv_freq, self.rope_scaling, self.dtype)  # [R, Q, 1, dim]
        slots = batch.slots.reshape(-1)  # [R·Q]
        x = F.embedding(batch.tokens, self.embed)  # [R, Q, hidden]
        for weights, pool in zip(self.layers, pools):
            h = rms_norm(x, weights.input_norm, arch.eps)
            h = self.attention(h, weights, pool, slots, batch.block_tables, mask, cos, sin)
            x = x + h
            h = rms_norm(x, weights.post_norm, arch.eps)
            x = x + self.mlp(h, weights)
        if keep is not None and keep < Q:
            x = x[:, Q - keep:]  # [R, keep, hidden]
        return rms_norm(x, self.norm, arch.eps)  # [R, keep, hidden]

    def attention(self, h: torch.Tensor, w: LayerWeights, pool: torch.Tensor, slots: torch.Tensor,
                  block_tables: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
        """h [R, Q, hidden] -> [R, Q, hidden]; the tokens' K/V are written to their slots first, so
        the gathered keys hold each row's history and its new tokens."""
        arch = self.arch
        R, Q, _ = h.shape
        qkv = F.linear(h, w.qkv, w.qkv_bias)  # [R, Q, (heads + 2 kv_heads) · dim]
        qk, v = qkv.split([(arch.heads + arch.kv_heads) * arch.head_dim, arch.kv_heads * arch.head_dim], dim=-1)
        qk = rotate(qk.view(R, Q, arch.heads + arch.kv_heads, arch.head_dim), cos, sin)  # queries and keys at once
        q, k = qk.split([arch.heads, arch.kv_heads], dim=2)  # [R, Q, heads, dim], [R, Q, kv_heads, dim]
        v = v.view(R, Q, arch.kv_heads, arch.head_dim)
        flat = pool.view(2, -1, arch.kv_heads, arch.head_dim)  # [2, slots, kv_heads, dim]
        flat[0].index_copy_(0, slots, k.reshape(-1, arch.kv_heads, arch.head_dim))
        flat[1].index_copy_(0, slots, v.reshape(-1, arch.kv_heads, arch.head_dim))
        kv = pool[:, block_tables]  # [2, R, B, block_size, kv_heads, dim]
        kv = kv.flatten(2, 3).transpose(2, 3)  # [2, R, kv_heads, K, dim]
        group = arch.heads // arch.kv_heads  # query heads per K/V head (head h reads K/V head h // group)
        q = q.reshape(R, Q, arch.kv_heads, group, arch.head_dim).permute(0, 2, 3, 1, 4)  # [R, kv_heads, group, Q, dim]
        out = F.scaled_dot_product_attention(q.reshape(R, arch.kv_heads, group * Q, arch.head_dim), kv[0], kv[1],
                                             attn_mask=mask, scale=arch.head_dim ** -0.5)  # [R, kv_heads, group·Q, dim]
        out = out.view(R, arch.kv_heads, group, Q, arch.head_dim).permute(0, 3, 1, 2, 4)  # [R, Q, kv_heads, group, dim]
        return self.reduced(F.linear(out.reshape(R, Q, arch.heads * arch.head_dim), w.o, w.o_bias))

    def mlp(self, h: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        """h [R, Q, hidden] -> [R, Q, hidden]."""
        gate, up = F.linear(h, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)  # [R, Q, intermediate] each
        return self.reduced(F.linear(self.act(gate) * up, w.down, w.down_bias))

    def reduced(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel product [R, Q, hidden] summed over the ranks (as it is on one device)."""
        return partial if self.parallel is None else self.parallel.all_reduce(partial)


def _bias(*linears: Any) -> torch.Tensor | None:
    biases = [linear.bias for linear in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat([b.detach() if b is not None else torch.zeros(linear.out_features, dtype=linear.weight.dtype,
                                                                   device=linear.weight.device)
                      for b, linear in zip(biases, linears)])


def fused_layer(layer: Any, consume: bool) -> LayerWeights:
    """One HF decoder layer's weights, q/k/v and gate/up concatenated."""
    attn, mlp = layer.self_attn, layer.mlp
    if not all(hasattr(m, "weight") for m in (attn.q_proj, attn.o_proj, mlp.gate_proj, mlp.down_proj)):
        raise ModelLoadError("the graph engine takes plain linear layers, not quantized ones; use --backend torch")
    with torch.no_grad():
        weights = LayerWeights(
            layer.input_layernorm.weight.detach(),
            torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
            _bias(attn.q_proj, attn.k_proj, attn.v_proj),
            attn.o_proj.weight.detach(), None if attn.o_proj.bias is None else attn.o_proj.bias.detach(),
            layer.post_attention_layernorm.weight.detach(),
            torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), _bias(mlp.gate_proj, mlp.up_proj),
            mlp.down_proj.weight.detach(), None if mlp.down_proj.bias is None else mlp.down_proj.bias.detach())
    if consume:
        for module in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            module.weight = torch.nn.Parameter(torch.empty(0, dtype=module.weight.dtype, device=module.weight.device),
                                               requires_grad=False)
    return weights
