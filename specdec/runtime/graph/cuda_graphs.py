"""Run the graph model over sessions: padded to a bucket, replayed from a CUDA graph where captured.

What this module decides:
- A bucket is a BatchShape (sessions × tokens × blocks per row × tree window). Buckets are
  captured at start (`capture`), largest first so the smaller ones reuse its memory pool, all
  sharing one pool; decode is tokens = 1 and verification up to 16 tokens (trees up to 16
  nodes: the window). A forward takes the smallest bucket that holds it; past the largest it
  runs eagerly in its exact shape.
- A captured bucket owns static input tensors and the outputs its graph writes — the logits and
  the final-norm hidden states they come from (a target's heads read those; keeping them costs
  the graph nothing, they are computed anyway): a forward builds its batch on the host, copies
  it into those tensors (one copy per field), replays the graph and slices the real rows'
  logits out, and their hidden states when asked (copied: the next replay overwrites them).
- Without CUDA (or with capture off) the same buckets, padding and model code run eagerly:
  only capture and replay differ, so the CPU test suite proves the captured code path's
  numerics and layout.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from specdec.errors import InvalidArgument
from specdec.runtime.graph.batch import (BatchShape, ForwardBatch, RowInput, build_batch, check_rows, needed_shape,
                                         pad_batch)
from specdec.runtime.graph.model import GraphModel
from specdec.runtime.graph.paged_kv import NULL_BLOCK, PagedKV

log = logging.getLogger(__name__)

DECODE_AND_VERIFY_TOKENS = (1, 2, 4, 8, 16)  # query columns: decode, then verification of γ+1 ≤ 16
SESSION_COUNTS = (1, 2, 4, 8, 16, 32, 64)  # rows per bucket
TREE_WINDOW = 16  # the most tree nodes a captured bucket masks


def context_blocks(max_blocks: int, smallest: int = 8) -> tuple[int, ...]:
    """Per-row block counts for buckets: powers of two from `smallest` up to max_blocks (the
    gathered keys per row are the bucket's, so short contexts take short buckets)."""
    out, n = [], smallest
    while n < max_blocks:
        out.append(n)
        n *= 2
    return tuple(out) + (max_blocks,)


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


@dataclass
class Captured:
    """One bucket's graph and the tensors it reads and writes."""

    graph: torch.cuda.CUDAGraph  # replays the forward of `inputs`
    inputs: ForwardBatch  # static inputs on the device: a forward copies its batch here
    logits: torch.Tensor  # [R, Q, vocab] static output the graph writes
    hidden: torch.Tensor  # [R, Q, hidden] static output: the final-norm hidden states of those logits


def dummy_batch(shape: BatchShape, device: torch.device) -> ForwardBatch:
    """A batch of padding only (writes go to the null block): for warm-up and capture."""
    R, Q, B, W = shape.rows, shape.tokens, shape.blocks, shape.window
    long = dict(dtype=torch.long, device=device)
    return ForwardBatch(torch.zeros((R, Q), **long), torch.zeros((R, Q), **long),
                        torch.full((R, Q), NULL_BLOCK, **long), torch.full((R, Q), -1, **long),
                        torch.full((R, B), NULL_BLOCK, **long), torch.zeros((R,), **long),
                        torch.zeros((R,), **long), torch.zeros((R, Q, W), dtype=torch.bool, device=device))


class CudaGraphRunner:
    """The graph model, its paged pool and its buckets."""

    def __init__(self, model: GraphModel, kv: PagedKV, buckets: Buckets | None = None, capture: bool | None = None):
        """capture: capture CUDA graphs (default: when the model is on a CUDA device)."""
        self.model = model
        self.kv = kv
        buckets = buckets or Buckets()
        if not buckets.blocks:
            longest = min(model.arch.max_context, kv.capacity_tokens)
            buckets = dataclasses.replace(buckets, blocks=context_blocks(kv.blocks_needed(longest)))
        self.buckets = buckets
        self.shapes = self.buckets.shapes()  # smallest first
        self.capture_enabled = model.device.type == "cuda" if capture is None else capture
        if self.capture_enabled and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the model is on {model.device}")
        self.graphs: dict[BatchShape, Captured] = {}
        self.replays = 0  # forwards served from a captured graph
        self.eager_runs = 0  # forwards run eagerly (no capture, or past the largest bucket)

    # ---- capture -----------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> int:
        """Capture every bucket's graph (nothing to do without capture); returns how many."""
        if not self.capture_enabled:
            return 0
        memory_pool = torch.cuda.graph_pool_handle()
        for shape in reversed(self.shapes):  # largest first: the smaller ones fit in its memory
            self.graphs[shape] = self._capture_one(shape, memory_pool)
        torch.cuda.synchronize(self.model.device)
        log.info("captured %d CUDA graphs (largest bucket %s)", len(self.graphs), self.shapes[-1])
        return len(self.graphs)

    def _capture_one(self, shape: BatchShape, memory_pool) -> Captured:
        inputs = dummy_batch(shape, self.model.device)
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side):  # warm-up off the capture: lazy initialisations happen here
            for _ in range(2):
                self.model.forward(inputs, self.kv.pools)
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=memory_pool):
            hidden = self.model.hidden_states(inputs, self.kv.pools)  # [R, Q, hidden]
            logits = self.model.logits(hidden)  # [R, Q, vocab]
        return Captured(graph, inputs, logits, hidden)

    # ---- forwards ----------------------------------------------------------------------------

    def bucket_for(self, needed: BatchShape) -> BatchShape | None:
        """The smallest bucket that holds `needed`, None past the largest."""
        for shape in self.shapes:
            if shape.holds(needed):
                return shape
        return None

    def check_context(self, rows: Sequence[RowInput]) -> None:
        """InvalidArgument for a row that would outgrow the model's context."""
        limit = self.model.arch.max_context
        for row in rows:
            total = self.kv.length(row.session_id) + len(row.tokens)
            if total > limit:
                raise InvalidArgument(f"session {row.session_id!r} would hold {total} tokens, past the "
                                      f"model's context of {limit}")

    def forward(self, rows: Sequence[RowInput]) -> list[torch.Tensor]:
        """Append each row's tokens to its session in ONE forward (rows are distinct sessions,
        each made with kv.new_session); per row, the logits of its last keep_logits tokens
        -> [keep_logits, vocab] in the model's dtype. ResourceExhausted when the pool is full
        (nothing appended). A forward that fails after appending rolls its rows back."""
        return self._run(rows, False)[0]

    def forward_hidden(self, rows: Sequence[RowInput]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """forward, and per row the final-norm hidden states of the same tokens -> [keep_logits,
        hidden] in the model's dtype."""
        return self._run(rows, True)

    @torch.inference_mode()
    def forward_on_device(self, batch: ForwardBatch) -> torch.Tensor:
        """A forward whose inputs are built on the device (the draft's tree loop: its tokens and
        tree windows come from the device) in its exact shape, its slots allocated by the caller:
        padded there to the smallest bucket that holds it and replayed where captured (eager in
        the bucket's shape otherwise; in its own shape past the largest) -> logits [R, Q, vocab]
        in the model's dtype; a captured bucket's own output, which its next replay overwrites."""
        shape = self.bucket_for(batch.shape)
        padded = batch if shape is None else pad_batch(batch, shape, NULL_BLOCK * self.kv.spec.block_size)
        logits, _ = self._execute(padded)  # [R', Q', vocab]
        rows, tokens = batch.tokens.shape
        return logits[:rows, logits.shape[1] - tokens:]

    def _execute(self, batch: ForwardBatch, keep: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the graph captured for the batch's shape where there is one (copying the batch
        into its inputs), else run the model eagerly on the batch, its last `keep` columns only
        (all when None) -> logits [R, Q, vocab], hidden states [R, Q, hidden]: a captured
        bucket's own outputs, which its next replay overwrites."""
        captured = self.graphs.get(batch.shape)
        if captured is not None:
            batch.copy_into(captured.inputs)
            captured.graph.replay()
            self.replays += 1
            return captured.logits, captured.hidden
        self.eager_runs += 1
        hidden = self.model.hidden_states(batch.to(self.model.device), self.kv.pools, keep)  # [R, keep, hidden]
        return self.model.logits(hidden), hidden

    @torch.inference_mode()
    def _run(self, rows: Sequence[RowInput], with_hidden: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The forward of forward / forward_hidden (the hidden states only when asked: else [])."""
        check_rows(self.kv, rows)
        self.check_context(rows)
        needed = needed_shape(self.kv, rows)
        bucket = self.bucket_for(needed)
        shape = bucket or needed
        pasts = {row.session_id: self.kv.length(row.session_id) for row in rows}
        host = build_batch(self.kv, rows, shape)
        try:
            # [R, Q or keep, vocab], [R, Q or keep, hidden]
            logits, hidden = self._execute(host, max(row.keep_logits for row in rows))
            width = logits.shape[1]
            kept = [slice(width - row.keep_logits, width) for row in rows]
            return ([logits[r, at].clone() for r, at in enumerate(kept)],
                    [hidden[r, at].clone() for r, at in enumerate(kept)] if with_hidden else [])
        except BaseException:
            for session_id, past in pasts.items():
                self.kv.truncate(session_id, past)
            raise
