"""Tensor parallelism of the graph engine's model (--tensor-parallel-size N): the sharding maps,
the process group and its collectives.

What this module decides:
- Megatron-style sharding (as gpt-fast's tp.py and vLLM do): rank r of N holds query heads
  [r·H/N, (r+1)·H/N) and the K/V heads they read; q/k/v and gate/up are column-parallel (each
  rank computes its own heads and MLP channels), o and down row-parallel (each rank's partial
  product is summed by one all-reduce), so a decoder layer costs 2 all-reduces of [R, Q, hidden].
  A row-parallel bias is held by rank 0 alone, so the sum adds it once.
- Fewer K/V heads than ranks: each K/V head is replicated on the N / kv_heads ranks whose query
  heads read it (vLLM's rule), so every rank holds one K/V head; N must then be a multiple of
  the K/V heads. Otherwise the K/V heads are split like the query heads.
- The embedding, the final norm and the output head are replicated: every rank computes the
  full logits (vocab × hidden more weight bytes per rank: 151936 × 1536 × 2 B = 445 MiB for
  Qwen2.5-1.5B in bfloat16, tied so counted once), so sampling and acceptance read them on any
  rank with no gather. Vocab-parallel is the later step for models whose head does not fit.
- The maps are pure functions of (heads, kv_heads, intermediate, rank, N); a model whose counts
  do not divide is refused at start with a ModelLoadError that names the numbers.
- Collectives go through torch.distributed on one process group: NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass

import torch

from specdec.tokenizer import ModelLoadError

COLLECTIVE_TIMEOUT_S = 20  # a rank silent this long fails the collective (then the service exits)


@dataclass(frozen=True)
class ShardPlan:
    """Which slice of each sharded dimension one rank holds (ranges are [first, end))."""

    rank: int  # this process's rank, 0 serves gRPC
    size: int  # ranks in the group (N)
    heads: tuple[int, int]  # query heads held
    kv_heads: tuple[int, int]  # K/V heads held (one replicated head when kv_heads < N)
    intermediate: tuple[int, int]  # MLP channels held (of gate, of up, and columns of down)

    @property
    def local_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def local_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


def check_tensor_parallel(heads: int, kv_heads: int, intermediate: int, size: int) -> None:
    """ModelLoadError naming the numbers when a model cannot be split over `size` ranks."""
    if size < 1:
        raise ModelLoadError(f"--tensor-parallel-size must be >= 1, got {size}")
    if heads % size:
        raise ModelLoadError(f"--tensor-parallel-size {size} must divide the model's {heads} attention heads; "
                             f"choose a divisor of {heads}")
    if kv_heads >= size and kv_heads % size:
        raise ModelLoadError(f"--tensor-parallel-size {size} must divide the model's {kv_heads} key/value heads; "
                             f"choose a divisor of {kv_heads}")
    if kv_heads < size and size % kv_heads:
        raise ModelLoadError(f"--tensor-parallel-size {size} must be a multiple of the model's {kv_heads} key/value "
                             f"heads when larger (each is replicated on {size} / {kv_heads} ranks)")
    if intermediate % size:
        raise ModelLoadError(f"--tensor-parallel-size {size} must divide the model's MLP width {intermediate}")


def shard_plan(heads: int, kv_heads: int, intermediate: int, rank: int, size: int) -> ShardPlan:
    """Rank `rank`'s slices of a model with these counts (checked first)."""
    check_tensor_parallel(heads, kv_heads, intermediate, size)
    h, m = heads // size, intermediate // size
    if kv_heads >= size:
        kv = kv_heads // size
        kv_range = (rank * kv, (rank + 1) * kv)
    else:
        head = rank // (size // kv_heads)  # the K/V head this rank's query heads read
        kv_range = (head, head + 1)
    return ShardPlan(rank, size, (rank * h, (rank + 1) * h), kv_range, (rank * m, (rank + 1) * m))


def qkv_rows(plan: ShardPlan, heads: int, kv_heads: int, head_dim: int) -> list[tuple[int, int]]:
    """The row ranges of the fused [(heads + 2 kv_heads) × dim, hidden] q/k/v matrix one rank
    keeps, in order (its q rows, then k, then v)."""
    (q0, q1), (k0, k1) = plan.heads, plan.kv_heads
    k_base, v_base = heads * head_dim, (heads + kv_heads) * head_dim
    return [(q0 * head_dim, q1 * head_dim), (k_base + k0 * head_dim, k_base + k1 * head_dim),
            (v_base + k0 * head_dim, v_base + k1 * head_dim)]


def gate_up_rows(plan: ShardPlan, intermediate: int) -> list[tuple[int, int]]:
    """The row ranges of the fused [2 × intermediate, hidden] gate/up matrix one rank keeps."""
    m0, m1 = plan.intermediate
    return [(m0, m1), (intermediate + m0, intermediate + m1)]


def take_rows(tensor: torch.Tensor | None, ranges: list[tuple[int, int]]) -> torch.Tensor | None:
    """The rows in `ranges` of a matrix or vector, concatenated (a copy; None stays None)."""
    if tensor is None:
        return None
    return torch.cat([tensor[a:b] for a, b in ranges]).contiguous()


def shard_layer(layer, plan: ShardPlan, heads: int, kv_heads: int, head_dim: int):
    """A full LayerWeights -> the rank's LayerWeights (norms replicated, row-parallel biases on
    rank 0 only)."""
    intermediate = layer.gate_up.shape[0] // 2
    qkv = qkv_rows(plan, heads, kv_heads, head_dim)
    gate_up = gate_up_rows(plan, intermediate)
    (q0, q1), (m0, m1) = plan.heads, plan.intermediate
    return dataclasses.replace(
        layer,
        qkv=take_rows(layer.qkv, qkv),  # [(H/N + 2 kv/N) × dim, hidden]
        qkv_bias=take_rows(layer.qkv_bias, qkv),
        o=layer.o[:, q0 * head_dim:q1 * head_dim].contiguous(),  # [hidden, H/N × dim]
        o_bias=layer.o_bias if plan.rank == 0 else None,
        gate_up=take_rows(layer.gate_up, gate_up),  # [2 × intermediate/N, hidden]
        gate_up_bias=take_rows(layer.gate_up_bias, gate_up),
        down=layer.down[:, m0:m1].contiguous(),  # [hidden, intermediate/N]
        down_bias=layer.down_bias if plan.rank == 0 else None)


def sharded_arch(arch, plan: ShardPlan):
    """The ArchConfig one rank's forward runs: its own query and K/V head counts."""
    return dataclasses.replace(arch, heads=plan.local_heads, kv_heads=plan.local_kv_heads)


class TensorParallel:
    """One rank's place in the group and the collectives the forward calls."""

    def __init__(self, plan: ShardPlan, group=None):
        self.plan = plan
        self.group = group  # torch.distributed group (None: the default one)
        self.reduce_seconds = 0.0  # not measured in a graph; a hook for the timings of issue 45

    @property
    def rank(self) -> int:
        return self.plan.rank

    @property
    def size(self) -> int:
        return self.plan.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks in place (every rank gets the same sum) -> x."""
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank src's x on every rank (in place) -> x."""
        import torch.distributed as dist

        dist.broadcast(x, src, group=self.group)
        return x


def collective_backend(device: torch.device | str) -> str:
    """NCCL on CUDA, gloo elsewhere."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_group(rank: int, size: int, init_method: str, device: torch.device | str,
               timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
    """Join the process group of `size` ranks at init_method (tcp://host:port or file://path)."""
    import torch.distributed as dist

    dist.init_process_group(collective_backend(device), init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
