"""Run the graph model over sessions: padded to a bucket, replayed from a CUDA graph where captured.

What this module decides:
- A bucket is a BatchShape (sessions × tokens × blocks per row × tree window); which ones are
  captured, and why so few, is buckets.py's. Buckets are captured at start (`capture`), largest
  first so the smaller ones reuse its memory, all sharing one pool; a bucket that fails to
  capture runs eagerly (capture.py). A forward takes the smallest bucket that holds it; past
  the largest it runs eagerly in its exact shape.
- A captured bucket owns static input tensors; its outputs — the logits and the final-norm
  hidden states they come from (a target's heads read those) — are views of ONE logits buffer
  and ONE hidden-state buffer per engine, sized for the largest bucket (buckets replay one at a
  time; one output per bucket took 5.6 GiB for a 7B's buckets). A forward builds its batch on
  the host, copies it into those tensors (one copy per field), replays the graph and slices the
  real rows' logits out, and their hidden states when asked (copied: the next replay
  overwrites them).
- Without CUDA (or with capture off: --cuda-graphs off, SPECDEC_CUDA_GRAPHS=off) the same
  buckets, padding and model code run eagerly: only capture and replay differ, so the CPU test
  suite proves the captured code path's numerics and layout (and, with capture.eager_graph as
  the capturer, the capture path itself: static inputs, shared outputs, failures).
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
from specdec.runtime.graph.buckets import (DECODE_AND_VERIFY_TOKENS, SESSION_COUNTS, TREE_WINDOW,  # noqa: F401
                                           Buckets, context_blocks)
from specdec.runtime.graph.capture import (CaptureReport, Capturer, Replayable, capture_each, capturing, cuda_graph,
                                           memory_pool_for)
from specdec.runtime.graph.model import GraphModel
from specdec.runtime.graph.paged_kv import NULL_BLOCK, PagedKV

log = logging.getLogger(__name__)



@dataclass
class Captured:
    """One bucket's graph and the tensors it reads and writes."""

    graph: Replayable  # replays the forward of `inputs` (a torch.cuda.CUDAGraph on CUDA)
    inputs: ForwardBatch  # static inputs on the device: a forward copies its batch here
    logits: torch.Tensor  # [R, Q, vocab] a view of the engine's one logits buffer, which the graph writes
    hidden: torch.Tensor  # [R, Q, hidden] a view of its one hidden-state buffer: the final-norm states of those logits


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

    def __init__(self, model: GraphModel, kv: PagedKV, buckets: Buckets | None = None, capture: bool | None = None,
                 capturer: Capturer | None = None):
        """capture: capture CUDA graphs (default: when the model is on a CUDA device); capturer:
        how a bucket is captured (default cuda_graph; the CPU tests pass capture.eager_graph)."""
        self.model = model
        self.kv = kv
        buckets = buckets or Buckets()
        if not buckets.blocks:
            longest = min(model.arch.max_context, kv.capacity_tokens)
            buckets = dataclasses.replace(buckets, blocks=context_blocks(kv.blocks_needed(longest)))
        self.buckets = buckets
        self.shapes = self.buckets.shapes()  # smallest first
        self.capture_enabled = model.device.type == "cuda" if capture is None else capture
        if self.capture_enabled and model.device.type != "cuda" and capturer is None:
            raise ValueError(f"CUDA graphs need a CUDA device; the model is on {model.device}")
        self.capturer = capturer or cuda_graph
        self.graphs: dict[BatchShape, Captured] = {}
        self.report = CaptureReport()  # what capture() did
        self.logits_buffer: torch.Tensor | None = None  # [slots · vocab] every bucket's logits (views of it)
        self.hidden_buffer: torch.Tensor | None = None  # [slots · hidden] every bucket's hidden states
        self.memory_pool = None  # the graphs' shared pool (the draft loop captures into it too)
        self.replays = 0  # forwards served from a captured graph
        self.eager_runs = 0  # forwards run eagerly (no capture, or past the largest bucket)

    # ---- capture -----------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> int:
        """Capture every bucket's graph (nothing to do without capture); returns how many. A
        bucket that fails to capture is logged at WARNING and runs eagerly."""
        if not self.capture_enabled:
            return 0
        device = self.model.device
        slots = self.buckets.largest_slots()
        self.logits_buffer = torch.empty(slots * int(self.model.head.shape[0]), dtype=self.model.dtype, device=device)
        self.hidden_buffer = torch.empty(slots * self.model.arch.hidden, dtype=self.model.dtype, device=device)
        self.memory_pool = memory_pool_for(device)
        with capturing(device):  # largest first: the smaller ones fit in its memory
            self.report = capture_each(reversed(self.shapes), self._capture_one, "forward", self.graphs)
        log.info("captured %d forward CUDA graphs in %.1f s (%d failed, running eagerly; largest bucket %s; "
                 "shared logits buffer %d bytes)", self.report.captured, self.report.seconds, self.report.failed,
                 self.shapes[-1], self.logits_buffer.numel() * self.logits_buffer.element_size())
        return self.report.captured

    def output_views(self, shape: BatchShape) -> tuple[torch.Tensor, torch.Tensor]:
        """A bucket's logits [R, Q, vocab] and hidden states [R, Q, hidden]: the first R·Q rows of
        the shared buffers (buckets replay one at a time)."""
        R, Q = shape.rows, shape.tokens
        vocab, hidden = int(self.model.head.shape[0]), self.model.arch.hidden
        return (self.logits_buffer[:R * Q * vocab].view(R, Q, vocab),
                self.hidden_buffer[:R * Q * hidden].view(R, Q, hidden))

    def _capture_one(self, shape: BatchShape) -> Captured:
        inputs = dummy_batch(shape, self.model.device)
        logits, hidden = self.output_views(shape)
        head = self.model.head

        def run() -> None:
            states = self.model.hidden_states(inputs, self.kv.pools)  # [R, Q, hidden]
            hidden.copy_(states)
            torch.matmul(states, head.t(), out=logits)  # [R, Q, vocab], as GraphModel.logits

        return Captured(self.capturer(run, self.model.device, self.memory_pool), inputs, logits, hidden)

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
