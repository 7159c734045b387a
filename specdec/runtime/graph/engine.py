"""The graph engine behind the services (--backend graph): GraphEngine.

What this module decides:
- A session's K/V is its block table in one PagedKV pool, allocated at start from the memory
  budget (--kv-cache-bytes, or --kv-cache-memory-fraction of the GPU's free memory once the
  model is loaded; at most what --max-sessions sessions of the full context take).
  Its SessionCache holds a `PagedBlocks`, whose pool id is its own (not the session id: a
  session re-created while its old cache is still referenced gets a new id).
- Rollback (`crop`) is a length edit; keeping a tree's accepted path moves those nodes' rows
  in the pool (PagedKV.keep_path). Forwards go through CudaGraphRunner: padded to a bucket,
  replayed from a CUDA graph where captured, eager otherwise (the CPU runs the same code).
- The LRU bound of SessionCaches is mapped onto the pool: a session's bytes are its blocks,
  the byte bound is the pool, and before a forward that needs more blocks than are free the
  least recently used sessions (never the forward's own) are evicted. Only when that is not
  enough does the forward fail with RESOURCE_EXHAUSTED.
- A session released from another thread (`close`) is only marked: its blocks go back to the
  free list on the model thread, after any forward still running on it (as llama.cpp's
  sequences are recycled).
- K/V chunks (--prefix-cache-bytes, --kv-store) read and append a session's rows in the pool:
  the layout is the torch engine's, keyed for this engine (engine "graph").
- A target's heads (--heads) share the model's head matrix (`GraphModel.logits`) and read the
  final-norm hidden states every forward leaves beside its logits (`forward_hidden`).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
from typing import Any, Sequence

import torch

from specdec.cores import this_placement
from specdec.errors import ResourceExhausted
from specdec.runtime.graph.batch import RowInput
from specdec.runtime.graph.cuda_graphs import Buckets, CudaGraphRunner
from specdec.runtime.graph.draft_loop import DRAFT_STEPS, DraftLoop, LoopOutputs
from specdec.runtime.graph.tree_loop import TreeLoopInputs, run_tree_loop
from specdec.runtime.graph.model import GraphModel
from specdec.runtime.graph.paged_kv import NULL_BLOCK, PagedKV, blocks_for, budget_bytes
from specdec.runtime.kv_cache import SessionCache, SessionCaches
from specdec.runtime.loader import LoadedModel, eos_token_ids, max_context_length
from specdec.runtime.transfer import upload
from specdec.runtime.graph.batched_proposal import RowWarps
from specdec.runtime.graph.device_drafting import DeviceDrafting
from specdec.runtime.graph.device_verification import DeviceVerification
from specdec.runtime.session_engine import SessionEngine
from specdec.runtime.session_kv import Row
from specdec.runtime.target_heads import TargetHeads
from specdec.tokenizer import tokenizer_fingerprint
from specdec.maths.tree import TREE_WIDTH
from specdec.types import ModelDescription, SamplingParams

log = logging.getLogger(__name__)


class PagedBlocks:
    """One session's K/V: its id in the pool (the `kv` of its SessionCache)."""

    __slots__ = ("engine", "pool_id", "closed")

    def __init__(self, engine: "GraphEngine", pool_id: str):
        self.engine = engine
        self.pool_id = pool_id  # the session's key in engine.kv (unique per cache)
        self.closed = False  # dropped: its blocks are freed on the model thread

    def nbytes(self) -> int:
        kv = self.engine.kv
        entry = kv.sessions.get(self.pool_id)
        return 0 if entry is None else len(entry.blocks) * kv.spec.bytes_per_block

    def crop(self, held: int, length: int) -> bool:
        """Keep the first `length` positions: a length edit (whole blocks past it are freed)."""
        if not self.closed:
            self.engine.kv.truncate(self.pool_id, length)
        return True

    def close(self) -> None:
        """The session is dropped (any thread): its blocks are freed at the next recycle."""
        if not self.closed:
            self.closed = True
            self.engine.closed.append(self.pool_id)


def pool_budget(kv_cache_bytes: int, max_sessions: int, context: int, bytes_per_token: int) -> int:
    """The pool's bytes: --kv-cache-bytes, at most what max_sessions full contexts take."""
    return min(kv_cache_bytes, max(1, max_sessions) * context * bytes_per_token)


class GraphEngine(SessionEngine):
    """One Llama / Qwen2 / Mistral model on the graph engine, many sessions in one paged pool."""

    def __init__(self, loaded: LoadedModel, max_sessions: int, kv_cache_bytes: int | float, max_speculative_tokens: int,
                 prefill_chunk: int = 512, block_size: int = 16, buckets: Buckets | None = None,
                 capture: bool | None = None):
        """kv_cache_bytes: the pool's budget in bytes, or a float in (0, 1]: that fraction of the
        device's free memory (CUDA only); capture: CUDA graphs at start (default: on CUDA)."""
        hf = loaded.model
        self.hf_config = hf.config  # what the K/V tier keys chunks with
        context = max_context_length(hf, loaded.tokenizer)
        eos = eos_token_ids(hf, loaded.tokenizer)
        self.model = GraphModel.from_hf(hf, consume=True)
        self.device = self.model.device
        self.tokenizer = loaded.tokenizer
        self.kv_spec = self.model.pool_spec(block_size)
        context = min(context, self.model.arch.max_context)
        budget = pool_budget(budget_bytes(kv_cache_bytes, self.device), max_sessions, context,
                             self.kv_spec.bytes_per_token)
        self.kv = PagedKV(self.kv_spec, blocks_for(self.kv_spec, budget))
        self.graph = CudaGraphRunner(self.model, self.kv, buckets, capture)
        self.max_speculative_tokens = max_speculative_tokens
        self.draft_loop: DraftLoop | None = None  # made by drafting(): only a draft service drafts
        self.caches = SessionCaches(max_sessions, self.kv.capacity_tokens * self.kv_spec.bytes_per_token)
        self.closed: collections.deque[str] = collections.deque()  # pool ids of dropped sessions
        self._ids = itertools.count()
        self.prefill_chunk = max(1, prefill_chunk)
        self.tokens_run = 0
        self.restored = {}
        self.vocab_size = int(self.model.head.shape[0])
        self.embedding_size = int(self.model.embed.shape[0])
        self.context_length = min(context, self.kv.capacity_tokens)
        self.description = ModelDescription(
            model_id=loaded.model_id,
            vocab_size=self.vocab_size,
            tokenizer_fingerprint=tokenizer_fingerprint(loaded.tokenizer, self.vocab_size),
            tokenizer_vocab_size=len(loaded.tokenizer),
            eos_token_ids=eos,
            max_context_length=self.context_length,
            dtype=str(loaded.dtype).removeprefix("torch."),
            device=f"graph {self.device}",
            max_speculative_tokens=max_speculative_tokens,
            cpu=this_placement(torch.get_num_threads()) if self.device.type == "cpu" else None,
            verifies_trees=True,
        )
        self.heads = TargetHeads.of(loaded.heads, self.model.logits)
        if self.heads is not None:
            self.description = self.heads.describe(self.description)
        log.info("%s: graph engine, paged K/V pool of %d blocks x %d tokens (%d bytes per token)",
                 loaded.model_id, self.kv.num_blocks, block_size, self.kv_spec.bytes_per_token)

    def capture(self) -> int:
        """Capture the buckets' CUDA graphs (before the service reports SERVING); how many."""
        return self.graph.capture()

    def warm_up(self) -> None:
        """Capture the CUDA graphs (on CUDA; nothing on a CPU) — the draft loop's too once
        drafting() made it — then the engines' common warm-up."""
        captured = self.capture() + (self.draft_loop.capture() if self.draft_loop is not None else 0)
        if captured:
            log.info("%s: %d CUDA graphs captured", self.description.model_id, captured)
        super().warm_up()

    def verification(self) -> DeviceVerification:
        """Chains decided together on the device, one host read per batch."""
        return DeviceVerification(self)

    def drafting(self, proposal_top_k: int) -> DeviceDrafting:
        """Chains drafted by the device loop (graph/draft_loop.py), one host read per batch;
        its graphs are captured by warm_up (call this first)."""
        buckets = self.graph.buckets
        steps = tuple(s for s in DRAFT_STEPS if s <= self.max_speculative_tokens)
        self.draft_loop = DraftLoop(self.model, self.kv, proposal_top_k, buckets.rows, steps, buckets.blocks,
                                    self.graph.capture_enabled)
        return DeviceDrafting(self, proposal_top_k)

    def draft_steps(self, sessions: Sequence[tuple[str, SessionCache]], first_logits: torch.Tensor, steps: int,
                    warps: RowWarps, uniforms: torch.Tensor) -> LoopOutputs:
        """Draw `steps` drafts for each session after its first forward, on the device:
        first_logits [R, vocab] and uniforms [R, steps] there, warps on the host. Each session's
        pool then holds its steps − 1 drafts run; `keep_drafts` keeps the ones wanted.
        RESOURCE_EXHAUSTED, nothing appended, when the pool cannot hold them."""
        assert self.draft_loop is not None, "drafting() makes the draft loop"
        self._make_room([Row(session_id, entry, [0] * (steps - 1), 1) for session_id, entry in sessions])
        pool_ids = [entry.kv.pool_id for _, entry in sessions]
        positions = [self.kv.length(pool_id) for pool_id in pool_ids]
        self.kv.reserve({pool_id: steps - 1 for pool_id in pool_ids})  # all or nothing
        slots = [self.kv.append(pool_id, steps - 1) for pool_id in pool_ids]
        self.tokens_run += len(pool_ids) * (steps - 1)
        try:
            return self.draft_loop.run(first_logits, positions, slots,
                                       [self.kv.block_table(pool_id) for pool_id in pool_ids], uniforms, warps)
        except BaseException:
            for pool_id, length in zip(pool_ids, positions):
                self.kv.truncate(pool_id, length)
            raise

    def tree_steps(self, sessions: Sequence[tuple[str, SessionCache]], first_logits: torch.Tensor, depths: int,
                   params: Sequence[SamplingParams]) -> torch.Tensor:
        """Grow each session's tree `depths` deep after its first forward, on the device
        (graph/tree_loop.py): first_logits [C, vocab] there -> each depth's kept children
        [C, depths, TREE_WIDTH, 4] there. The sessions then hold their histories only, as
        before. RESOURCE_EXHAUSTED, nothing appended, when the pool cannot hold the nodes run."""
        runs = TREE_WIDTH * (depths - 1)  # node slots run, every depth but the last
        pool_ids = [entry.kv.pool_id for _, entry in sessions]
        bases = [self.kv.length(pool_id) for pool_id in pool_ids]
        if runs:
            self._make_room([Row(session_id, entry, [0] * runs, 1) for session_id, entry in sessions])
            self.kv.reserve({pool_id: runs for pool_id in pool_ids})  # all or nothing
        try:
            slots = [self.kv.append(pool_id, runs) if runs else [] for pool_id in pool_ids]
            self.tokens_run += len(pool_ids) * runs
            tables = [self.kv.block_table(pool_id) for pool_id in pool_ids]
            width = max(len(table) for table in tables)
            device = self.device
            inputs = TreeLoopInputs(first_logits, upload(bases, torch.long, device),
                                    upload(slots, torch.long, device).view(len(slots), max(0, depths - 1), TREE_WIDTH),
                                    upload([t + [NULL_BLOCK] * (width - len(t)) for t in tables], torch.long, device),
                                    RowWarps.of(params).to(device), params)
            with torch.inference_mode():
                return run_tree_loop(self.graph.forward_on_device, inputs, depths)
        finally:
            for pool_id, length in zip(pool_ids, bases):
                self.kv.truncate(pool_id, length)

    def keep_drafts(self, entry: SessionCache, held: int, drafts: Sequence[int]) -> None:
        """After draft_steps: the session holds its `held` tokens then `drafts` (the ones run
        whose K/V it keeps); the pool's extra drafts are dropped."""
        self.kv.truncate(entry.kv.pool_id, held + len(drafts))
        entry.append(list(drafts))
        self.caches.account(entry)

    # ---- sessions (model thread, `PagedBlocks.close` aside) -----------------------------------

    def new_entry(self) -> SessionCache:
        pool_id = f"#{next(self._ids)}"
        self.kv.new_session(pool_id)
        return SessionCache(PagedBlocks(self, pool_id))

    @property
    def verifies_trees(self) -> bool:
        return True

    @property
    def grows_trees(self) -> bool:
        return True

    def keep_path(self, entry: SessionCache, base: int, path: Sequence[int]) -> None:
        tokens = [entry.tokens[base + node] for node in path]
        self.kv.keep_path(entry.kv.pool_id, base, path)  # rows moved, length base + len(path)
        del entry.tokens[base:]  # the token half of entry.crop(base): the pool is edited already
        entry.hashes.truncate(base)
        entry.chunks_kept_upto = min(entry.chunks_kept_upto, base)
        entry.append(tokens)

    def _recycle_closed(self, busy: frozenset[str] = frozenset()) -> None:
        """Free the blocks of dropped sessions, but for the `busy` ones (a running call's rows)."""
        for _ in range(len(self.closed)):
            pool_id = self.closed.popleft()
            if pool_id in busy:
                self.closed.append(pool_id)
            else:
                self.kv.drop(pool_id)

    def finish(self, keep, extra_bytes: int = 0) -> None:
        """Apply the cache bounds, with the kept sessions' sizes brought up to date (a crop or a
        kept path freed blocks); after a call (extra_bytes 0) free every dropped session."""
        for session_id in [keep] if isinstance(keep, str) else list(keep):
            entry = self.caches.get(session_id)
            if entry is not None:
                self.caches.account(entry)
        super().finish(keep, extra_bytes)
        if not extra_bytes:
            self._recycle_closed()

    def _make_room(self, rows: Sequence[Row]) -> None:
        """Evict least recently used sessions until the rows' new blocks are free."""
        busy = frozenset(row.entry.kv.pool_id for row in rows)
        self._recycle_closed(busy)
        kv = self.kv
        needed = sum(max(0, kv.blocks_needed(kv.length(row.entry.kv.pool_id) + len(row.tokens))
                         - len(kv.sessions[row.entry.kv.pool_id].blocks)) for row in rows)
        if needed > kv.free_blocks:
            for row in rows:
                self.caches.account(row.entry)
            self.finish([row.session_id for row in rows], needed * kv.spec.bytes_per_block)
            self._recycle_closed(busy)

    # ---- forwards -----------------------------------------------------------------------------

    def forward_batch(self, rows: Sequence[Row]) -> list[torch.Tensor]:
        """Append each row's tokens to its session in ONE forward (rows are distinct sessions);
        per row, float32 logits of its last keep_logits positions -> [keep_logits, vocab].
        RESOURCE_EXHAUSTED, nothing appended, when the pool cannot hold the rows even after
        evicting every other session."""
        return self._run(rows, False)[0]

    def forward_hidden(self, rows: Sequence[Row]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """forward_batch, and per row the final-norm hidden states of the same positions
        -> [keep_logits, hidden] in the model's dtype (what the heads read)."""
        return self._run(rows, True)

    def _run(self, rows: Sequence[Row], hidden: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The forward of forward_batch: per row its logits and, when `hidden`, its hidden states."""
        self._make_room(rows)
        inputs = [RowInput(row.entry.kv.pool_id, list(row.tokens), row.keep_logits, row.tree) for row in rows]
        try:
            # per row [keep_logits, vocab] (and [keep_logits, hidden]); rolled back on failure
            logits, states = self.graph.forward_hidden(inputs) if hidden else (self.graph.forward(inputs), [])
        except torch.OutOfMemoryError as exc:
            tokens = sum(len(row.tokens) for row in rows)
            raise ResourceExhausted(f"out of device memory running {tokens} tokens: {exc}") from exc
        for row in rows:
            row.entry.append(row.tokens)
            self.caches.account(row.entry)
            self.tokens_run += len(row.tokens)
        return [row_logits.float() for row_logits in logits], states

    # ---- K/V chunks (kv_tier.py) --------------------------------------------------------------

    def read_chunk(self, entry: SessionCache, begin: int, end: int) -> torch.Tensor:
        """A copy of the session's K/V at positions [begin, end) -> [layers, 2, kv_heads, n, head_dim]."""
        return self.kv.read(entry.kv.pool_id, begin, end)

    def load_chunks(self, entry: SessionCache, chunks: list[torch.Tensor], tokens: Sequence[int]) -> None:
        """Append `tokens` whose K/V are the chunks (each [layers, 2, kv_heads, n, head_dim]) in order."""
        if sum(chunk.shape[3] for chunk in chunks) != len(tokens):
            raise ValueError(f"{sum(c.shape[3] for c in chunks)} positions of chunks for {len(tokens)} tokens")
        self.kv.reserve({entry.kv.pool_id: len(tokens)})  # all or nothing
        for chunk in chunks:
            self.kv.extend(entry.kv.pool_id, chunk)
        entry.append(tokens)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Every tensor of the model (for the weights digest of K/V chunks shared by replicas)."""
        model = self.model
        named = {"embed": model.embed, "norm": model.norm, "head": model.head}
        for i, layer in enumerate(model.layers):
            for field in dataclasses.fields(layer):
                tensor = getattr(layer, field.name)
                if tensor is not None:
                    named[f"layers.{i}.{field.name}"] = tensor
        return named


def graph_engine_from_config(config: Any, loaded: LoadedModel) -> GraphEngine:
    """The engine of a ModelServiceConfig on the graph engine (its graphs are captured by warm_up)."""
    rows = tuple(r for r in Buckets().rows if r <= max(1, config.max_batch_size))
    memory = config.kv_cache_memory_fraction or config.kv_cache_bytes  # a fraction of free memory, or bytes
    engine = GraphEngine(loaded, config.max_sessions, memory, config.max_speculative_tokens,
                         config.prefill_chunk, buckets=Buckets(rows=rows))
    return engine
