"""The llama.cpp engine: a GGUF model served through llama-cpp-python's bindings to llama.h.

One llama.cpp context holds every session: a session is one llama.cpp sequence in a K/V pool
that all sequences share (`kv_unified`), its tokens at positions 0..n-1. Rolling a session
back removes its positions past the kept prefix (`llama_memory_seq_rm`); a batch of sessions
is ONE `llama_decode` over a multi-sequence batch that asks for logits exactly at the
positions the draft or the acceptance step reads. Those logits go through the same sampling
and acceptance code as the torch engine's, so the guarantee does not depend on the engine.

A token tree is verified in the same decode with sequence sets (`_tree_plan`): each leaf of
the tree gets a spare sequence that first shares the session's cells (`llama_memory_seq_cp`
adds a sequence id to cells, it copies nothing in a unified pool); the tokens fed before the
tree carry the session's id and every leaf's, and a node carries the ids of the leaves below
it. llama.cpp masks a token to the cells that hold its first sequence id at positions up to
its own, and a node sits at the root's position plus its depth: so it sees the history and
its own ancestors only, as the torch engine's tree mask does. Afterwards `keep_path` adds the
session's id to the accepted path's cells (they already sit at consecutive positions) and
drops the leaves' ids, which frees every other node's cell. The draft does not grow trees on
this engine (a node of a later depth would need the cached nodes of earlier ones).

The pool is allocated when the service starts: its cells are the memory budget
(`--kv-cache-tokens`, else `--kv-cache-bytes` over the bytes of one token's K/V), and the LRU
bound of SessionCaches evicts sessions before a forward would not fit.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from specdec.cores import this_placement
from specdec.errors import ResourceExhausted
from specdec.runtime.kv_cache import SessionCache, SessionCaches
from specdec.runtime.session_engine import SessionEngine
from specdec.runtime.session_kv import Row
from specdec.tokenizer import ModelLoadError, load_tokenizer, tokenizer_fingerprint
from specdec.maths.tree import TokenTree
from specdec.types import KVCacheType, ModelDescription

log = logging.getLogger(__name__)

MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: sequences one context holds
DEFAULT_MAX_CELLS = 32768  # K/V cells allocated when only --kv-cache-bytes bounds them
GGML_LOG_ERROR = 4  # ggml_log_level: llama.cpp's errors are logged as warnings, the rest at debug


def llama_cpp_module() -> Any:
    """llama-cpp-python's low-level bindings; ModelLoadError saying how to install them."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise ModelLoadError(f"the llama.cpp backend needs llama-cpp-python ({exc}): "
                             "pip install llama-cpp-python, or pass --backend torch") from exc
    return llama_cpp


_backend_ready = False
_log_callback = None  # kept referenced: llama.cpp calls it for as long as the process lives


def _init_backend(llama: Any) -> None:
    """Once per process: route llama.cpp's log lines to logging, start its backend."""
    global _backend_ready, _log_callback
    if _backend_ready:
        return

    @llama.llama_log_callback
    def route(level: int, text: bytes, _user: Any) -> None:
        line = text.decode("utf-8", "replace").rstrip()
        if line:
            log.log(logging.WARNING if level == GGML_LOG_ERROR else logging.DEBUG, "llama.cpp: %s", line)

    _log_callback = route
    llama.llama_log_set(route, ctypes.c_void_p(0))
    llama.llama_backend_init()
    _backend_ready = True


@dataclass(frozen=True)
class LlamaOptions:
    """How the llama.cpp context is built."""

    threads: int = 0  # CPU threads of a decode (0 = every core this process may use)
    kv_cache_type: str = KVCacheType.F16  # element type of the K/V pool
    kv_cache_tokens: int = 0  # cells of the K/V pool (0 = kv_cache_bytes / bytes per token, capped)
    batch_tokens: int = 512  # most tokens of one llama_decode; longer forwards are split
    device: str = "cpu"  # cpu, or a GPU when llama-cpp-python was built with one (every layer offloaded)


_KV_TYPES = {KVCacheType.F16: ("GGML_TYPE_F16", 2.0), KVCacheType.BF16: ("GGML_TYPE_BF16", 2.0),
             KVCacheType.F32: ("GGML_TYPE_F32", 4.0), KVCacheType.Q8_0: ("GGML_TYPE_Q8_0", 34 / 32)}


class LlamaSequence:
    """One session's K/V: a llama.cpp sequence id and how many positions it holds."""

    __slots__ = ("engine", "seq", "length", "closed", "spares", "node_seqs")

    def __init__(self, engine: "LlamaCppEngine", seq: int):
        self.engine = engine
        self.seq = seq
        self.length = 0
        self.closed = False
        # after a tree's forward: its leaves' spare sequences, and per node one that holds it
        self.spares: list[int] = []
        self.node_seqs: list[int] = []

    def nbytes(self) -> int:
        return self.length * self.engine.bytes_per_token

    def crop(self, held: int, length: int) -> bool:
        """Remove the positions from `length` on (worker thread only)."""
        self.engine.release_leaves(self)  # a tree's nodes are past any kept prefix
        if length < self.length:
            self.engine.remove_positions(self.seq, length)
            self.length = length
        return True

    def close(self) -> None:
        """The session is dropped (any thread): its sequence is cleared and reused after the
        worker's current call ends, so a forward still running on it stays whole."""
        if not self.closed:
            self.closed = True
            self.engine.closed.extend([self.seq, *self.spares])
            self.spares, self.node_seqs = [], []


class LlamaCppEngine(SessionEngine):
    """One GGUF model in one llama.cpp context, many sessions."""

    def __init__(self, path: str, caches_max_sessions: int, kv_cache_bytes: int, max_speculative_tokens: int,
                 prefill_chunk: int = 512, options: LlamaOptions = LlamaOptions()):
        llama = self.llama = llama_cpp_module()
        if not str(path).endswith(".gguf") or not Path(path).is_file():
            raise ModelLoadError(f"the llama.cpp backend serves a .gguf file; {path!r} is not one")
        if options.kv_cache_type not in _KV_TYPES:
            raise ModelLoadError(f"unknown --kv-cache-type {options.kv_cache_type!r}; choose from "
                                 f"{', '.join(_KV_TYPES)}")
        _init_backend(llama)
        self.tokenizer = load_tokenizer(str(path))
        model_params = llama.llama_model_default_params()
        model_params.n_gpu_layers = 0 if options.device == "cpu" else 999
        if options.device != "cpu" and not llama.llama_supports_gpu_offload():
            raise ModelLoadError(f"--device {options.device}: this llama-cpp-python was built without GPU "
                                 "support; use --device cpu, or --backend torch")
        self.model = llama.llama_model_load_from_file(str(path).encode(), model_params)
        if not self.model:
            raise ModelLoadError(f"llama.cpp cannot load {path!r} (see the llama.cpp lines logged above)")
        self.vocab = llama.llama_model_get_vocab(self.model)
        self.vocab_size = self.embedding_size = int(llama.llama_vocab_n_tokens(self.vocab))
        type_name, element_bytes = _KV_TYPES[KVCacheType(options.kv_cache_type)]
        layers = llama.llama_model_n_layer(self.model)
        kv_width = (llama.llama_model_n_embd(self.model) // llama.llama_model_n_head(self.model)
                    * llama.llama_model_n_head_kv(self.model))
        self.bytes_per_token = max(1, int(layers * 2 * kv_width * element_bytes))
        cells = options.kv_cache_tokens or min(kv_cache_bytes // self.bytes_per_token, DEFAULT_MAX_CELLS)
        cells = max(256, cells)
        self.batch_tokens = max(1, min(options.batch_tokens, cells))
        self.context = self._new_context(llama, cells, type_name, options)
        self.memory = llama.llama_get_memory(self.context)
        # a token carries its session's sequence id and, fed before or inside a tree, its leaves'
        self.batch = llama.llama_batch_init(self.batch_tokens, 0, 1 + max_speculative_tokens)
        self.cells = int(llama.llama_n_ctx(self.context))
        # sessions kept: MAX_SEQUENCES less room for one batch of new sessions before finish()
        # applies the bound (so a free sequence id is always there)
        kept = min(caches_max_sessions, MAX_SEQUENCES - min(64, MAX_SEQUENCES // 4))
        if kept < caches_max_sessions:
            log.info("llama.cpp: at most %d sessions kept (one context holds %d sequences)", kept, MAX_SEQUENCES)
        self.caches = SessionCaches(kept, self.cells * self.bytes_per_token)  # the pool is the budget
        self.free = list(range(MAX_SEQUENCES - 1, -1, -1))  # sequence ids not in use
        self.closed: collections.deque[int] = collections.deque()  # dropped, cleared at the next finish()
        self.prefill_chunk = max(1, prefill_chunk)
        self.tokens_run = 0
        self.restored = {}
        self.device = torch.device("cpu")  # where the logits are handed over
        self.context_length = min(int(llama.llama_model_n_ctx_train(self.model)), self.cells)
        desc = ctypes.create_string_buffer(256)
        llama.llama_model_desc(self.model, desc, len(desc))
        self.description = ModelDescription(
            model_id=str(path),
            vocab_size=self.vocab_size,
            tokenizer_fingerprint=tokenizer_fingerprint(self.tokenizer, self.vocab_size),
            tokenizer_vocab_size=len(self.tokenizer),
            eos_token_ids=self._eos_token_ids(),
            max_context_length=self.context_length,
            dtype=f"gguf ({desc.value.decode(errors='replace')})",
            device=f"llama.cpp {options.device}",
            max_speculative_tokens=max_speculative_tokens,
            cpu=this_placement(self.threads) if options.device == "cpu" else None,
            verifies_trees=True,
        )
        log.info("%s: llama.cpp, %d K/V cells of %d bytes (%s), %d threads", path, self.cells,
                 self.bytes_per_token, options.kv_cache_type, self.threads)

    def _new_context(self, llama: Any, cells: int, type_name: str, options: LlamaOptions) -> Any:
        params = llama.llama_context_default_params()
        self.threads = options.threads or len(os.sched_getaffinity(0))
        params.n_ctx = cells
        params.n_batch = params.n_ubatch = self.batch_tokens
        params.n_seq_max = MAX_SEQUENCES
        params.n_threads = params.n_threads_batch = self.threads
        params.type_k = params.type_v = getattr(llama, type_name)
        params.kv_unified = True  # one pool of cells for every sequence
        params.no_perf = True
        context = llama.llama_init_from_model(self.model, params)
        if not context:
            raise ModelLoadError(f"llama.cpp cannot create a context of {cells} K/V cells "
                                 f"(--kv-cache-type {options.kv_cache_type}): see the lines logged above")
        return context

    def _eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: the tokenizer's eos and llama.cpp's end-of-generation set."""
        ids = {int(i) for i in range(self.vocab_size) if self.llama.llama_vocab_is_eog(self.vocab, i)}
        if isinstance(self.tokenizer.eos_token_id, int):
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    # ---- sequences (worker thread, `close` aside) -------------------------------------------

    def new_entry(self) -> SessionCache:
        """A session cache on a free llama.cpp sequence."""
        if not self.free:
            raise ResourceExhausted(f"all {MAX_SEQUENCES} llama.cpp sequences are in use; retry shortly",
                                    retry_after_s=0.1)
        return SessionCache(LlamaSequence(self, self.free.pop()))

    @property
    def verifies_trees(self) -> bool:
        return True  # sequence sets mask a tree in one decode (the module docstring)

    @property
    def grows_trees(self) -> bool:
        return False

    def keep_path(self, entry: SessionCache, base: int, path: Sequence[int]) -> None:
        kv = entry.kv
        tokens = [entry.tokens[base + node] for node in path]
        # a leaf's sequence below the path's end holds the path at base, base + 1, ...
        source = kv.node_seqs[path[-1]] if path else None
        spares, kv.spares, kv.node_seqs = kv.spares, [], []  # alive through the crop
        entry.crop(base)  # the session's own sequence never held the nodes
        if source is not None:
            self.llama.llama_memory_seq_cp(self.memory, source, kv.seq, base, base + len(path))
        kv.spares = spares
        self.release_leaves(kv)
        entry.append(tokens)
        kv.length = base + len(path)

    def release_leaves(self, kv: "LlamaSequence") -> None:
        """Drop a tree's spare sequences: the cells only they held are free again."""
        for seq in kv.spares:
            self.remove_positions(seq, -1)
            self.free.append(seq)
        kv.spares, kv.node_seqs = [], []

    def _tree_plan(self, kv: "LlamaSequence", tree: TokenTree, fed: int) -> list[tuple[int, ...]]:
        """Spare sequences for a tree's leaves, sharing the session's cells; per token of the
        row (the `fed` tokens before the tree, then the nodes) the sequence ids it carries."""
        children = tree.children()
        leaves = [node for node in range(len(tree)) if not children[node + 1]]
        if len(self.free) < len(leaves):
            raise ResourceExhausted(f"all {MAX_SEQUENCES} llama.cpp sequences are in use; retry shortly",
                                    retry_after_s=0.1)
        kv.spares = [self.free.pop() for _ in leaves]
        carried: list[list[int]] = [[] for _ in range(len(tree))]  # node -> the leaves' sequences below it
        for leaf, seq in zip(leaves, kv.spares):
            self.llama.llama_memory_seq_cp(self.memory, kv.seq, seq, -1, -1)
            for node in tree.path(leaf):
                carried[node].append(seq)
        kv.node_seqs = [seqs[0] for seqs in carried]
        return [(kv.seq, *kv.spares)] * fed + [tuple(seqs) for seqs in carried]

    def remove_positions(self, seq: int, start: int) -> None:
        """Forget a sequence's positions from `start` on (-1: all of them)."""
        self.llama.llama_memory_seq_rm(self.memory, seq, start, -1)

    def _recycle_closed(self, busy: frozenset[int] = frozenset()) -> None:
        """Clear the sequences of dropped sessions and make their ids free again, but for the
        `busy` ones (a forward of the running call is still on them: released meanwhile from
        another thread, they are cleared after the call)."""
        for _ in range(len(self.closed)):
            seq = self.closed.popleft()
            if seq in busy:
                self.closed.append(seq)
                continue
            self.remove_positions(seq, -1)
            self.free.append(seq)

    def finish(self, keep, extra_bytes: int = 0) -> None:
        """Apply the cache bounds; after a call (extra_bytes 0) clear every dropped sequence."""
        super().finish(keep, extra_bytes)
        if not extra_bytes:
            self._recycle_closed()

    # ---- forwards -------------------------------------------------------------------------

    def forward_batch(self, rows: Sequence[Row]) -> list[torch.Tensor]:
        """Append each row's tokens to its sequence in one llama_decode (split only past
        --prefill-chunk-sized batches); per row, float32 logits of its last keep_logits
        positions -> [keep_logits, vocab]. A failed decode drops the rows' caches."""
        tokens = sum(len(row.tokens) for row in rows)
        self.finish([row.session_id for row in rows], tokens * self.bytes_per_token)
        self._recycle_closed(frozenset(row.entry.kv.seq for row in rows))  # the evicted cells are room
        try:
            logits = self._decode_all(rows)
        except BaseException:
            for row in rows:
                self.caches.discard(row.session_id, row.entry)
            raise
        for row in rows:
            row.entry.kv.length += len(row.tokens)
            row.entry.append(row.tokens)
            self.caches.account(row.entry)
        self.tokens_run += tokens
        return logits

    def _decode_all(self, rows: Sequence[Row]) -> list[torch.Tensor]:
        """Every row's tokens, in decodes of at most batch_tokens tokens; their outputs in order.
        A row with a tree: its nodes at the root's position plus their depths, in the sequences
        of `_tree_plan`."""
        plan: list[tuple[int, tuple[int, ...], int, bool]] = []  # (token, sequences, position, wants logits)
        for row in rows:
            kv, start, n = row.entry.kv, row.entry.kv.length, len(row.tokens)
            positions = list(range(start, start + n))
            seqs = [(kv.seq,)] * n
            if row.tree is not None:
                fed = n - len(row.tree)
                positions[fed:] = [start + fed - 1 + depth for depth in row.tree.depths()]
                seqs = self._tree_plan(kv, row.tree, fed)
            for i, token in enumerate(row.tokens):
                plan.append((token, seqs[i], positions[i], i >= n - row.keep_logits))
        outputs: list[torch.Tensor] = []
        for begin in range(0, len(plan), self.batch_tokens):
            outputs.append(self._decode(plan[begin:begin + self.batch_tokens]))
        flat = torch.cat(outputs) if len(outputs) > 1 else outputs[0]  # [outputs, vocab]
        result, at = [], 0
        for row in rows:
            result.append(flat[at:at + row.keep_logits])
            at += row.keep_logits
        return result

    def _decode(self, part: Sequence[tuple[int, tuple[int, ...], int, bool]]) -> torch.Tensor:
        """One llama_decode -> the float32 logits of the positions that want them [n, vocab]."""
        batch = self.batch
        for i, (token, seqs, position, wants) in enumerate(part):
            batch.token[i] = token
            batch.pos[i] = position
            batch.n_seq_id[i] = len(seqs)
            for k, seq in enumerate(seqs):
                batch.seq_id[i][k] = seq
            batch.logits[i] = wants
        batch.n_tokens = len(part)
        status = self.llama.llama_decode(self.context, batch)
        if status == 1:
            raise ResourceExhausted(f"the llama.cpp K/V pool ({self.cells} cells) has no room for {len(part)} "
                                    "more tokens; raise --kv-cache-tokens or retry", retry_after_s=0.1)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}")
        wanted = sum(1 for *_, wants in part if wants)
        if not wanted:
            return torch.empty((0, self.vocab_size))
        address = ctypes.cast(self.llama.llama_get_logits(self.context), ctypes.c_void_p).value
        floats = (ctypes.c_float * (wanted * self.vocab_size)).from_address(address)
        return torch.frombuffer(floats, dtype=torch.float32).view(wanted, self.vocab_size).clone()

    def close(self) -> None:
        """Free the context and the model (the engine is unusable afterwards)."""
        llama = self.llama
        if self.context:
            llama.llama_batch_free(self.batch)
            llama.llama_free(self.context)
            llama.llama_model_free(self.model)
            self.context = self.model = None
