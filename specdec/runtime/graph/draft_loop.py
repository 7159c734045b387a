"""The draft's γ-step loop on the device: ONE CUDA graph per bucket, no host read inside.

What this module decides:
- After the first forward of a Propose batch (each row's new tokens, through CudaGraphRunner), the
  loop draws token 1 from each row's last logits, runs it as a one-token forward, draws token 2,
  ... : S draws and S − 1 forwards, S the batch's largest γ. The forwards' K/V slots are
  allocated before the loop (the caller appends S − 1 tokens to each session and keeps only
  what it returns, graph/engine.py), so every step's inputs are known up front: step s of row r
  runs at position positions[r] + s into slots[r, s], seeing positions[r] + s + 1 keys.
- A bucket is (rows × steps × blocks per row); captured at start, largest first, sharing one
  memory pool and one set of static inputs (each bucket reads views of it). A loop takes the smallest bucket that holds it: padding rows are greedy rows
  writing to the null block, padding steps (a bucket deeper than the batch's γ) write to the
  null block too and their draws are dropped. Past the largest bucket it runs eagerly in its
  exact shape; without CUDA every loop runs eagerly in its bucket's shape, the same code.
- The outputs stay on the device (`LoopOutputs`); the caller reads them back once
  (`LoopOutputs.to_host`): the round's one host synchronisation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

import torch

from specdec.runtime.transfer import upload
from specdec.runtime.graph.batched_proposal import RowWarps, draw_rows, proposal_rows
from specdec.runtime.graph.batch import ForwardBatch
from specdec.runtime.graph.model import GraphModel
from specdec.runtime.graph.paged_kv import NULL_BLOCK, PagedKV

log = logging.getLogger(__name__)

DRAFT_STEPS = (1, 2, 4, 8)  # γ buckets of the captured loop (deeper loops run eagerly)


@dataclass(frozen=True)
class LoopShape:
    """The static dimensions of a draft loop (a bucket is one)."""

    rows: int  # R: sessions drafting together
    steps: int  # S: tokens drawn per row (S − 1 forwards)
    blocks: int  # B: block-table entries per row

    def holds(self, other: "LoopShape") -> bool:
        return self.rows >= other.rows and self.steps >= other.steps and self.blocks >= other.blocks


@dataclass
class LoopInputs:
    """What a loop reads (one device; a captured bucket's static inputs)."""

    first_logits: torch.Tensor  # [R, vocab] float32: each row's logits for its first draft
    positions: torch.Tensor  # [R] int64: the position of each row's first draft (its length before the loop)
    slots: torch.Tensor  # [R, S] int64: pool slot of each draft's K/V (the null block's where none is kept)
    block_tables: torch.Tensor  # [R, B] int64: each row's blocks, the loop's slots included
    uniforms: torch.Tensor  # [R, S] float32: each row's draws, from its request's generator
    warps: RowWarps  # each row's sampling warp

    @property
    def shape(self) -> LoopShape:
        rows, steps = self.uniforms.shape
        return LoopShape(rows, steps, self.block_tables.shape[1])

    def view(self, shape: LoopShape) -> "LoopInputs":
        """The first rows, steps and blocks of these inputs: a smaller bucket's inputs in the
        same memory (the captured buckets share one set; they replay one at a time)."""
        R, S, B = shape.rows, shape.steps, shape.blocks
        warps = RowWarps(*(getattr(self.warps, f.name)[:R] for f in fields(RowWarps)))
        return LoopInputs(self.first_logits[:R], self.positions[:R], self.slots[:R, :S], self.block_tables[:R, :B],
                          self.uniforms[:R, :S], warps)

    def copy_into(self, static: "LoopInputs") -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, RowWarps):
                value.copy_into(static.warps)
            else:
                getattr(static, f.name).copy_(value, non_blocking=True)


@dataclass
class LoopOutputs:
    """What a loop drew, still on the device."""

    tokens: torch.Tensor  # [R, S] int64: each row's drafts
    confidence: torch.Tensor  # [R, S] float32: the draft's probability of each (drafting.py's min_confidence)
    ids: torch.Tensor  # [R, S, K] int64: the ids of each draft's sparse q
    probs: torch.Tensor  # [R, S, K] float32: their probabilities (0: not in q)

    def to_host(self, rows: int, steps: int) -> list[list[list[float]]]:
        """The first `rows` rows' first `steps` draws in ONE read: per row and step
        [token, confidence, K ids..., K probs...] (ids and tokens exact in float64)."""
        packed = torch.cat([self.tokens[:rows, :steps, None].double(), self.confidence[:rows, :steps, None].double(),
                            self.ids[:rows, :steps].double(), self.probs[:rows, :steps].double()], dim=-1)
        return packed.tolist()


def run_loop(model: GraphModel, pools: list[torch.Tensor], inputs: LoopInputs, k: int) -> LoopOutputs:
    """The loop (module docstring): S draws and S − 1 one-token forwards, no host reads."""
    logits = inputs.first_logits  # [R, vocab]
    rows, steps = inputs.uniforms.shape
    no_window = torch.zeros((rows, 1, 1), dtype=torch.bool, device=logits.device)  # chains: no tree window
    tokens, confidence, all_ids, all_probs = [], [], [], []
    for s in range(steps):
        ids, probs = proposal_rows(logits, inputs.warps, k)  # [R, K]
        token, sure = draw_rows(logits, ids, probs, inputs.warps, inputs.uniforms[:, s])  # [R]
        tokens.append(token)
        confidence.append(sure)
        all_ids.append(ids)
        all_probs.append(probs)
        if s + 1 < steps:
            position = (inputs.positions + s)[:, None]  # [R, 1]
            step = ForwardBatch(token[:, None], position, inputs.slots[:, s:s + 1], position, inputs.block_tables,
                                position[:, 0] + 1, position[:, 0] + 1, no_window)
            logits = model.forward(step, pools)[:, -1].float()  # [R, vocab]
    return LoopOutputs(torch.stack(tokens, dim=1), torch.stack(confidence, dim=1),
                       torch.stack(all_ids, dim=1), torch.stack(all_probs, dim=1))


def padded_inputs(shape: LoopShape, vocab: int, null_slot: int, device: torch.device) -> LoopInputs:
    """Inputs of padding only (greedy rows writing to the null block): for capture."""
    R, S, B = shape.rows, shape.steps, shape.blocks
    long = dict(dtype=torch.long, device=device)
    return LoopInputs(torch.zeros((R, vocab), device=device), torch.zeros((R,), **long),
                      torch.full((R, S), null_slot, **long), torch.full((R, B), NULL_BLOCK, **long),
                      torch.zeros((R, S), device=device), RowWarps.of([], R).to(device))


@dataclass
class CapturedLoop:
    """One bucket's graph and the tensors it reads and writes."""

    graph: torch.cuda.CUDAGraph  # replays the loop over `inputs`
    inputs: LoopInputs  # static inputs: a loop copies its own here
    outputs: LoopOutputs  # static outputs the graph writes


class DraftLoop:
    """The draft loop of one graph model and its paged pool (module docstring)."""

    def __init__(self, model: GraphModel, kv: PagedKV, k: int, rows: tuple[int, ...], steps: tuple[int, ...],
                 blocks: tuple[int, ...], capture: bool):
        """k: the proposal's top-K (--proposal-top-k); capture: CUDA graphs (a CUDA model only)."""
        self.model = model
        self.kv = kv
        self.k = k
        self.vocab = int(model.head.shape[0])
        self.null_slot = NULL_BLOCK * kv.spec.block_size
        self.shapes = sorted((LoopShape(r, s, b) for r in rows for s in steps for b in blocks),
                             key=lambda x: (x.rows * x.steps * x.blocks, x.rows, x.steps, x.blocks))
        self.capture_enabled = capture
        self.graphs: dict[LoopShape, CapturedLoop] = {}
        self.replays = 0  # loops served from a captured graph
        self.eager_runs = 0  # loops run eagerly

    @torch.inference_mode()
    def capture(self, memory_pool=None) -> int:
        """Capture every bucket's loop (nothing without capture); returns how many."""
        if not self.capture_enabled:
            return 0
        memory_pool = memory_pool or torch.cuda.graph_pool_handle()
        device = self.model.device
        widest = LoopShape(*(max(getattr(s, f.name) for s in self.shapes) for f in fields(LoopShape)))
        shared = padded_inputs(widest, self.vocab, self.null_slot, device)  # one set for every bucket
        for shape in reversed(self.shapes):  # largest first: the smaller ones fit in its memory
            inputs = shared.view(shape)
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # lazy initialisations happen off the capture
                run_loop(self.model, self.kv.pools, inputs, self.k)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=memory_pool):
                outputs = run_loop(self.model, self.kv.pools, inputs, self.k)
            self.graphs[shape] = CapturedLoop(graph, inputs, outputs)
        torch.cuda.synchronize(device)
        log.info("captured %d draft-loop graphs (largest bucket %s)", len(self.graphs), self.shapes[-1])
        return len(self.graphs)

    def bucket_for(self, needed: LoopShape) -> LoopShape | None:
        return next((shape for shape in self.shapes if shape.holds(needed)), None)

    @torch.inference_mode()
    def run(self, first_logits: torch.Tensor, positions: list[int], slots: list[list[int]],
            tables: list[list[int]], uniforms: torch.Tensor, warps: RowWarps) -> LoopOutputs:
        """The loop over R rows of S steps: first_logits [R, vocab] and uniforms [R, S] on the
        device; per row its first draft's position, the S − 1 slots allocated for the drafts it
        runs, and its block table (host lists); warps on the host. Outputs cover the bucket's rows
        and steps (the first R rows and S steps are this loop's)."""
        rows, steps = uniforms.shape
        needed = LoopShape(rows, steps, max(len(table) for table in tables))
        shape = self.bucket_for(needed) or needed
        device = self.model.device
        slot_rows = [row + [self.null_slot] * (shape.steps - len(row)) for row in slots]
        slot_rows += [[self.null_slot] * shape.steps] * (shape.rows - rows)
        table_rows = [table + [NULL_BLOCK] * (shape.blocks - len(table)) for table in tables]
        table_rows += [[NULL_BLOCK] * shape.blocks] * (shape.rows - rows)
        inputs = LoopInputs(_pad(first_logits, shape.rows),
                            upload(positions + [0] * (shape.rows - rows), torch.long, device),
                            upload(slot_rows, torch.long, device), upload(table_rows, torch.long, device),
                            _pad(torch.nn.functional.pad(uniforms, (0, shape.steps - steps)), shape.rows),
                            _pad_warps(warps, shape.rows).to(device))
        captured = self.graphs.get(shape)
        if captured is None:
            self.eager_runs += 1
            return run_loop(self.model, self.kv.pools, inputs, self.k)
        inputs.copy_into(captured.inputs)
        captured.graph.replay()
        self.replays += 1
        return captured.outputs


def _pad(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """tensor [R, ...] with zero rows appended up to `rows`."""
    extra = rows - tensor.shape[0]
    if not extra:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((extra, *tensor.shape[1:]))])


def _pad_warps(warps: RowWarps, rows: int) -> RowWarps:
    """Warps [R] with greedy padding rows appended up to `rows`."""
    padding = RowWarps.of([], rows - warps.greedy.shape[0])
    return RowWarps(*(torch.cat([getattr(warps, f.name), getattr(padding, f.name)]) for f in fields(warps)))
