"""The graph engine's buckets: which shapes are captured at start, and what they cost.

What this module decides:
- A bucket is a BatchShape (sessions × tokens × blocks per row × tree window) of the forward, or
  a LoopShape (sessions × steps × blocks) of the draft loop. The captured set is the product of
  three ladders; a forward takes the smallest bucket that holds it, padding the rest.
- The trade (docs/design.md, "Engines"): every bucket is a graph captured at start (time: a
  synchronisation and tens of ms each; memory: its activations live in the shared pool), and
  every padded row, column or block is work done for nothing. The ladders grow by 4 (rows 1, 4,
  16, 64; blocks of 16 tokens 32, 128, 512, 2048 — the keys gathered per row) and the query
  columns are 1 (decode) and 5, 9, 16 (verifying γ ≤ 4, ≤ 8, ≤ 15, trees up to 16 nodes). At
  the defaults a target captures 4 × 4 × 2 = 32 graphs for a 2k context and 64 for 32k (it
  was 175 and 315 with ladders that grew by 2); padding wastes at most 3/4 of the rows and
  3/4 of the gathered keys — which costs little where graphs matter (small batches, where a
  forward reads the weights once whatever its rows) — and a γ = 1 verification runs 5 columns.
- All buckets write their logits into ONE buffer per engine, sized for the largest bucket
  (`logits_buffer_bytes`; it was one [rows, tokens, vocab] output per bucket:
  `per_bucket_logits_bytes`).
- `capture_reserve_bytes` estimates what capture adds on the device (the shared outputs and
  the largest bucket's activations), which the K/V pool's memory fraction leaves free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.runtime.graph.batch import BatchShape

DECODE_AND_VERIFY_TOKENS = (1, 5, 9, 16)  # query columns: decode, then verification of γ+1 ≤ 5, 9, 16
SESSION_COUNTS = (1, 4, 16, 64)  # rows per bucket (the largest is the service's --max-batch-size)
TREE_WINDOW = 16  # the most tree nodes a captured bucket masks
LADDER_RATIO = 4  # each rung of the rows and blocks ladders is this many times the last
SMALLEST_BLOCKS = 32  # block-table entries of the shortest bucket (512 tokens of 16)
DRAFT_STEPS = (1, 2, 4, 8)  # γ buckets of the captured draft loop (deeper loops run eagerly)


def ladder(smallest: int, largest: int, ratio: int = LADDER_RATIO) -> tuple[int, ...]:
    """smallest, smallest·ratio, ... below largest, then largest itself (at least 1 rung)."""
    out, n = [], max(1, smallest)
    while n < largest:
        out.append(n)
        n *= ratio
    return tuple(out) + (max(1, largest),)


def context_blocks(max_blocks: int, smallest: int = SMALLEST_BLOCKS, ratio: int = LADDER_RATIO) -> tuple[int, ...]:
    """Per-row block counts for buckets: a ladder up to max_blocks (the gathered keys per row are
    the bucket's, so short contexts take short buckets)."""
    return ladder(smallest, max_blocks, ratio)


def session_counts(max_batch: int) -> tuple[int, ...]:
    """Rows per bucket for a service batching up to max_batch sessions."""
    return ladder(1, max(1, max_batch))


@dataclass(frozen=True)
class Buckets:
    """The shapes captured at start (their product)."""

    rows: tuple[int, ...] = SESSION_COUNTS  # sessions per forward
    tokens: tuple[int, ...] = DECODE_AND_VERIFY_TOKENS  # query columns per session
    blocks: tuple[int, ...] = ()  # block-table entries per session; () = context_blocks of the model's context
    window: int = TREE_WINDOW  # tree nodes the window mask covers

    def shapes(self) -> list[BatchShape]:
        """Every bucket, smallest first."""
        return sorted((BatchShape(r, t, b, self.window) for r in self.rows for t in self.tokens for b in self.blocks),
                      key=lambda s: (s.rows * s.tokens * s.blocks, s.rows, s.tokens, s.blocks))

    def largest_slots(self) -> int:
        """Query slots (rows × tokens) of the widest bucket: what the shared outputs hold."""
        return max(self.rows) * max(self.tokens)


def service_buckets(max_batch: int, context_tokens: int, block_size: int = 16) -> Buckets:
    """A service's buckets at the defaults (graph_engine_from_config's)."""
    return Buckets(rows=session_counts(max_batch), blocks=context_blocks(-(-context_tokens // block_size)))


def loop_steps(max_speculative_tokens: int) -> tuple[int, ...]:
    """The draft loop's captured γs for a service allowing max_speculative_tokens."""
    return tuple(s for s in DRAFT_STEPS if s <= max_speculative_tokens)


@dataclass(frozen=True)
class GraphCount:
    """How many graphs a service captures (nothing is captured to count them)."""

    forward: int  # forward buckets (target and draft)
    loop: int = 0  # draft-loop buckets (a draft service only)
    shapes: list = field(default_factory=list, compare=False)  # the forward buckets

    @property
    def total(self) -> int:
        return self.forward + self.loop


def count_graphs(buckets: Buckets, steps: tuple[int, ...] = ()) -> GraphCount:
    """The graphs of a service with these forward buckets and, for a draft, these loop steps."""
    shapes = buckets.shapes()
    return GraphCount(len(shapes), len(buckets.rows) * len(steps) * len(buckets.blocks), shapes)


def logits_buffer_bytes(buckets: Buckets, vocab: int, itemsize: int) -> int:
    """The one logits buffer every bucket writes into: the widest bucket's [rows, tokens, vocab]."""
    return buckets.largest_slots() * vocab * itemsize


def per_bucket_logits_bytes(buckets: Buckets, vocab: int, itemsize: int) -> int:
    """What one [rows, tokens, vocab] output per bucket held (before the shared buffer)."""
    return sum(s.rows * s.tokens for s in buckets.shapes()) * vocab * itemsize


def capture_reserve_bytes(buckets: Buckets, *, vocab: int, hidden: int, intermediate: int, heads: int,
                          kv_heads: int, head_dim: int, itemsize: int, block_size: int = 16) -> int:
    """An estimate of the device memory capture takes besides the weights and the K/V pool: the
    shared logits and hidden-state outputs, and twice the largest bucket's biggest live
    activations (one layer's: residual and projections, the gathered K/V, the attention scores)."""
    slots = buckets.largest_slots()
    rows, keys = max(buckets.rows), max(buckets.blocks or (1,)) * block_size
    outputs = slots * (vocab + hidden) * itemsize
    projections = slots * (3 * hidden + (heads + 2 * kv_heads) * head_dim + 3 * intermediate) * itemsize
    gathered = 2 * rows * keys * kv_heads * head_dim * itemsize
    scores = rows * heads * max(buckets.tokens) * keys * 4
    return outputs + 2 * (projections + gathered + scores)
