"""Cost tables of the timed device (bench/timed_device.py): how long a GPU would take for one
forward of `rows` sessions × `tokens` new tokens each, on `context` cached tokens per row.

A table is data (`CostTable`): from the roofline of a shape on a device (the weight bytes and
the K/V bytes a forward reads, over a memory bandwidth; the matmuls' FLOPs over a compute rate;
whichever is longer, plus a fixed per-forward cost), or from a curve bench/gpu.py measured
(`from_gpu_json`: one session's forward of k new tokens; a batch of R rows × k tokens costs
what one forward of R·k tokens did there, the weights read once). The ready tables (TABLES) pair
a target with its draft on one device:

  h200-7b    Qwen2.5-7B target, Qwen2.5-0.5B draft, one H200 (bf16);
  h200-1.5b  Qwen2.5-1.5B target, Qwen2.5-0.5B draft, one H200;
  h100-70b   a Llama-70B target at tensor parallel 4 on H100s (each GPU reads a quarter of the
             weights and K/V; all-reduces as a fixed cost), a Llama-3.2-1B draft on one H100.

Bandwidths are what a well-made decode step achieves, not the data sheet: 4.2 TB/s on an H200
(88 % of 4.8; the 7B step is then 3.6 ms), 2.95 TB/s per H100 (88 % of 3.35). Compute at 600
TFLOP/s bf16 per GPU (about 60 % of the dense peak). A benchmark's model, not a measurement:
where bench/gpu.py has measured the shape, pass its JSON instead.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path

H200_BANDWIDTH = 4.2e12  # bytes/s a decode step reaches (88 % of 4.8 TB/s)
H100_BANDWIDTH = 2.95e12  # the same share of 3.35 TB/s
BF16_FLOPS = 6.0e14  # FLOP/s a large batched forward reaches on either GPU (about 60 % of dense peak)


@dataclass(frozen=True)
class Shape:
    """What a forward of one model reads and computes, per GPU of its tensor-parallel group."""

    name: str
    params: float  # parameters of the whole model
    kv_bytes_per_token: int  # K and V of one token, all layers, the whole model
    weight_bytes_per_param: int = 2  # bf16
    tensor_parallel: int = 1


def kv_bytes(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """K and V of one token over all layers."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


QWEN_7B = Shape("qwen2.5-7b", 7.62e9, kv_bytes(28, 4, 128))
QWEN_1_5B = Shape("qwen2.5-1.5b", 1.54e9, kv_bytes(28, 2, 128))
QWEN_0_5B = Shape("qwen2.5-0.5b", 0.494e9, kv_bytes(24, 2, 64))
LLAMA_70B_TP4 = Shape("llama-70b-tp4", 70.6e9, kv_bytes(80, 8, 128), tensor_parallel=4)
LLAMA_1B = Shape("llama-3.2-1b", 1.24e9, kv_bytes(16, 8, 64))


def roofline_seconds(shape: Shape, rows: int, tokens: int, context: int, bandwidth: float,
                     flops: float = BF16_FLOPS, fixed_s: float = 0.0) -> float:
    """One forward of `rows` sessions × `tokens` new tokens on `context` cached tokens each, on
    one GPU of the shape's tensor-parallel group: the weights and the K/V read (the cached and
    the new) over the bandwidth, or the matmuls (2 FLOPs a parameter a token) over the compute
    rate, whichever is longer; plus a fixed cost per forward."""
    if rows < 0 or tokens < 0 or context < 0:
        raise ValueError(f"rows, tokens and context must be >= 0, got {rows}, {tokens}, {context}")
    if rows == 0 or tokens == 0:
        return 0.0
    tp = shape.tensor_parallel
    memory = (shape.params * shape.weight_bytes_per_param + shape.kv_bytes_per_token * rows * (context + tokens)) / tp
    compute = 2.0 * shape.params * rows * tokens / tp
    return fixed_s + max(memory / bandwidth, compute / flops)


@dataclass(frozen=True)
class CostTable:
    """One model's forward times on one device: the roofline of `shape`, or a measured curve
    (`curve_ms`: new tokens of one forward -> ms, a forward of more tokens than measured
    extrapolated linearly from the last two points)."""

    name: str
    shape: Shape
    bandwidth: float
    flops: float = BF16_FLOPS
    fixed_s: float = 0.0
    curve_ms: dict[int, float] = field(default_factory=dict)

    def seconds(self, rows: int, tokens: int, context: int) -> float:
        """A forward of rows × tokens new tokens on `context` cached tokens per row."""
        if self.curve_ms:
            return interpolate_ms(self.curve_ms, rows * tokens) / 1e3 if rows and tokens else 0.0
        return roofline_seconds(self.shape, rows, tokens, context, self.bandwidth, self.flops, self.fixed_s)

    def draft_loop_seconds(self, rows: int, gamma: int, context: int) -> float:
        """The draft's γ-step loop: γ forwards of one token per row (the first one's new tokens
        taken as one; the K/V growing a token a step)."""
        return sum(self.seconds(rows, 1, context + step) for step in range(gamma))


def interpolate_ms(curve: dict[int, float], tokens: int) -> float:
    """The curve's ms at `tokens` new tokens: linear between measured points, the first point's
    below them, extrapolated from the last two above."""
    sizes = sorted(curve)
    if tokens <= sizes[0]:
        return curve[sizes[0]]
    if len(sizes) == 1:
        return curve[sizes[0]] * tokens / sizes[0]
    i = min(max(bisect.bisect_left(sizes, tokens), 1), len(sizes) - 1)
    lo, hi = sizes[i - 1], sizes[i]
    return curve[lo] + (curve[hi] - curve[lo]) * (tokens - lo) / (hi - lo)


@dataclass(frozen=True)
class DevicePair:
    """The cost tables of one deployment: its target and its draft."""

    name: str
    target: CostTable
    draft: CostTable

    def describe(self) -> dict:
        return {"name": self.name, **{role: {"table": t.name, "shape": t.shape.name, "bandwidth": t.bandwidth,
                                             "tensor_parallel": t.shape.tensor_parallel, "measured": bool(t.curve_ms),
                                             "decode_ms": 1e3 * t.seconds(1, 1, 512)}
                                      for role, t in (("target", self.target), ("draft", self.draft))}}


TABLES = {
    "h200-7b": DevicePair("h200-7b", CostTable("h200 qwen2.5-7b", QWEN_7B, H200_BANDWIDTH, fixed_s=20e-6),
                          CostTable("h200 qwen2.5-0.5b", QWEN_0_5B, H200_BANDWIDTH, fixed_s=20e-6)),
    "h200-1.5b": DevicePair("h200-1.5b", CostTable("h200 qwen2.5-1.5b", QWEN_1_5B, H200_BANDWIDTH, fixed_s=20e-6),
                            CostTable("h200 qwen2.5-0.5b", QWEN_0_5B, H200_BANDWIDTH, fixed_s=20e-6)),
    "h100-70b": DevicePair("h100-70b", CostTable("h100 tp4 llama-70b", LLAMA_70B_TP4, H100_BANDWIDTH,
                                                 fixed_s=300e-6),  # 160 all-reduces of a few µs
                           CostTable("h100 llama-3.2-1b", LLAMA_1B, H100_BANDWIDTH, fixed_s=20e-6)),
}


def from_gpu_json(path: str | Path, shape_name: str, engine: str = "graph", base: str = "h200-7b") -> DevicePair:
    """The `base` pair with its target's times replaced by the curve bench/gpu.py measured for
    `shape_name` on `engine` (its document's shapes.<shape>.engines.<engine>.curve.ms)."""
    document = json.loads(Path(path).read_text())
    try:
        curve = document["shapes"][shape_name]["engines"][engine]["curve"]["ms"]
    except KeyError as exc:
        raise ValueError(f"{path}: no {engine} curve for shape {shape_name!r} (missing {exc})") from None
    pair = TABLES[base]
    target = CostTable(f"measured {shape_name} {engine}", pair.target.shape, pair.target.bandwidth,
                       curve_ms={int(k): float(v) for k, v in curve.items()})
    return DevicePair(f"{base}+{Path(path).name}", target, pair.draft)
