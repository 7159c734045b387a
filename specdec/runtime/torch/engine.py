"""The torch engine: run a transformers causal LM over sessions and return logits.

`forward_batch` runs several sessions in ONE forward over their K/V buffers (a ragged batch,
see batch_cache.py); models whose cache cannot live in buffers run the rows one by one. With
heads (`--heads`), a forward pre-hook on the output layer keeps what it takes, and
`forward_hidden` hands it out per row beside the logits (target_heads.py).
Rollback, chunked prefill and the cache bounds are the engine-independent half
(session_kv.py). Long inputs are prefilled in chunks (`prefill_step`), each a separate
worker task, so one long prompt does not hold the model for every other session.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import torch

from specdec.cores import this_placement
from specdec.errors import ResourceExhausted
from specdec.runtime.torch import batch_cache
from specdec.runtime.kv_cache import SessionCache, SessionCaches
from specdec.runtime.loader import LoadedModel, eos_token_ids, max_context_length
from specdec.runtime.session_engine import SessionEngine
from specdec.runtime.session_kv import Row
from specdec.runtime.torch.kv_buffers import DynamicKV, KVBuffer
from specdec.runtime.target_heads import OutputLayerInputs, TargetHeads
from specdec.tokenizer import tokenizer_fingerprint
from specdec.types import ModelDescription


log = logging.getLogger(__name__)


class TorchEngine(SessionEngine):
    """One transformers model, many sessions."""

    def __init__(self, loaded: LoadedModel, caches: SessionCaches, max_speculative_tokens: int,
                 prefill_chunk: int = 512):
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.tokenizer = loaded.tokenizer
        self.caches = caches
        self.prefill_chunk = max(1, prefill_chunk)
        self.tokens_run = 0  # tokens forwarded since start (prefill work included)
        self.restored = {}
        self.output_inputs: OutputLayerInputs | None = None  # with heads: what the output layer took last
        head = self.model.get_output_embeddings()  # out_features: an int8 head has no .weight
        self.vocab_size = int(getattr(head, "out_features", None) or head.weight.shape[0])
        self.embedding_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.context_length = max_context_length(self.model, loaded.tokenizer)
        self.description = ModelDescription(
            model_id=loaded.model_id,
            vocab_size=self.vocab_size,
            tokenizer_fingerprint=tokenizer_fingerprint(loaded.tokenizer, self.vocab_size),
            tokenizer_vocab_size=len(loaded.tokenizer),
            eos_token_ids=eos_token_ids(self.model, loaded.tokenizer),
            max_context_length=self.context_length,
            dtype=str(loaded.dtype).removeprefix("torch."),
            device=str(self.device),
            max_speculative_tokens=max_speculative_tokens,
            cpu=this_placement(torch.get_num_threads()) if self.device.type == "cpu" else None,
        )
        self.kv_spec, why = batch_cache.buffered_spec(self.model, self.device, loaded.dtype)
        if self.kv_spec is not None and not self._batches_agree():
            self.kv_spec, why = None, "a batched forward of two sessions disagreed with running them alone"
        self.description = dataclasses.replace(self.description, verifies_trees=self.verifies_trees)
        self.heads = TargetHeads.of(loaded.heads, head)
        if self.heads is not None:
            self.output_inputs = OutputLayerInputs(head)
            self.description = self.heads.describe(self.description)
        if self.kv_spec is None:
            log.warning("%s: per-session DynamicCache, no batched forwards (%s)", loaded.model_id, why)
        else:
            log.info("%s: K/V in per-session buffers, %d bytes per token; batched forwards",
                     loaded.model_id, self.kv_spec.bytes_per_token)

    def _batches_agree(self) -> bool:
        """Start-up check: two sessions of different lengths in one batched forward get the
        logits they get alone (a model that ignored position_ids or the 4-D mask would not)."""
        generator = torch.Generator().manual_seed(0)
        high = min(self.embedding_size, self.vocab_size)
        tokens = [torch.randint(1, high, (n,), generator=generator).tolist() for n in (9, 4)]
        alone, together = [], [self.new_entry(), self.new_entry()]
        for seq, entry in zip(tokens, together):
            self.forward("", entry, seq[:-2], 1)
            mine = self.new_entry()
            self.forward("", mine, seq[:-2], 1)
            alone.append(self.forward("", mine, seq[-2:], 2))
        batched = self.forward_batch([Row("", e, seq[-2:], 2) for seq, e in zip(tokens, together)])
        self.tokens_run = 0
        return all(torch.allclose(b, a, rtol=0.02, atol=0.02 * float(a.abs().max()))
                   for a, b in zip(alone, batched))

    def read_chunk(self, entry: SessionCache, begin: int, end: int) -> torch.Tensor:
        """A copy of the session's K/V at positions [begin, end) -> [layers, 2, kv_heads, n, head_dim]."""
        return entry.kv.data[:, :, :, begin:end].clone()

    def load_chunks(self, entry: SessionCache, chunks: list[torch.Tensor], tokens: Sequence[int]) -> None:
        """Append `tokens` whose K/V are the chunks (each [layers, 2, kv_heads, n, head_dim]) in order."""
        held, buffer = len(entry), entry.kv
        buffer.reserve(held + len(tokens), held)
        at = held
        for chunk in chunks:
            n = chunk.shape[3]
            buffer.data[:, :, :, at:at + n].copy_(chunk)
            at += n
        if at != held + len(tokens):
            raise ValueError(f"{at - held} positions of chunks for {len(tokens)} tokens")
        entry.append(tokens)

    @property
    def verifies_trees(self) -> bool:
        return self.kv_spec is not None  # a tree needs its own mask: buffered forwards only

    @torch.inference_mode()
    def keep_path(self, entry: SessionCache, base: int, path: Sequence[int]) -> None:
        data = entry.kv.data  # [layers, 2, kv_heads, capacity, head_dim]
        for k, node in enumerate(path):  # nodes ascend, node >= k: no source is overwritten before use
            if node != k:
                data[:, :, :, base + k] = data[:, :, :, base + node]
        tokens = [entry.tokens[base + node] for node in path]
        entry.crop(base)
        entry.append(tokens)

    def new_entry(self) -> SessionCache:
        """An empty session cache of the kind this model uses."""
        return SessionCache(DynamicKV() if self.kv_spec is None else KVBuffer(self.kv_spec))

    def forward_batch(self, rows: Sequence[Row]) -> list[torch.Tensor]:
        """Append each row's tokens to its session in ONE forward (rows are distinct sessions);
        per row, float32 logits of its last keep_logits positions -> [keep_logits, vocab].

        A forward that fails part-way may leave layers that disagree: the rows' caches are then
        dropped, so their next calls rebuild them.
        """
        return self._run(rows, False)[0]

    def forward_hidden(self, rows: Sequence[Row]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """forward_batch, and per row what the output layer took at the same positions
        -> [keep_logits, hidden] (with heads only)."""
        if self.output_inputs is None:
            raise RuntimeError(f"{self.description.model_id} serves no heads: it keeps no hidden states")
        return self._run(rows, True)

    @torch.inference_mode()
    def _run(self, rows: Sequence[Row], hidden: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The forward of forward_batch: per row its logits and, when `hidden`, its hidden states."""
        try:
            if self.kv_spec is None:
                pairs = [self._forward_dynamic(row) for row in rows]
                logits, states = [logit for logit, _ in pairs], [state for _, state in pairs]
            else:
                logits, states = self._forward_buffered(rows)
        except BaseException as exc:
            for row in rows:
                self.caches.discard(row.session_id, row.entry)
            if isinstance(exc, torch.OutOfMemoryError):
                tokens = sum(len(row.tokens) for row in rows)
                raise ResourceExhausted(f"out of device memory running {tokens} tokens: {exc}") from exc
            raise
        for row in rows:
            row.entry.append(row.tokens)
            self.caches.account(row.entry)
            self.tokens_run += len(row.tokens)
        return logits, (states if hidden else [])

    def _hidden_rows(self, rows: Sequence[Row]) -> list[torch.Tensor | None]:
        """Per row, the output layer's input at its last keep_logits positions -> [keep_logits,
        hidden] (rows right-aligned: the last columns); None per row without heads."""
        if self.output_inputs is None:
            return [None] * len(rows)
        taken = self.output_inputs.take()  # [B, keep, hidden]
        width = taken.shape[1]
        return [taken[b, width - row.keep_logits:] for b, row in enumerate(rows)]

    def _forward_dynamic(self, row: Row) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fallback: one session through its DynamicCache -> [keep_logits, vocab] and, with
        heads, [keep_logits, hidden]."""
        input_ids = batch_cache.input_ids([row.tokens], len(row.tokens), self.device)  # [1, n]
        kv = row.entry.kv
        out = self.model(input_ids=input_ids, cache=kv.cache, use_cache=True, logits_to_keep=row.keep_logits)
        kv.cache = out.cache
        return out.logits[0, -row.keep_logits:].float(), self._hidden_rows([row])[0]

    def _forward_buffered(self, rows: Sequence[Row]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Every row in one forward over the sessions' K/V buffers (see batch_cache): per row its
        logits and, with heads, its hidden states."""
        pasts = [len(row.entry) for row in rows]
        lengths = [len(row.tokens) for row in rows]
        n = max(lengths)
        buffers = [row.entry.kv for row in rows]
        growth = sum(b.growth_bytes(past + length) for b, past, length in zip(buffers, pasts, lengths))
        if growth:  # make room first, so the budget holds while the buffers grow too
            self.finish([row.session_id for row in rows], growth)
        for buffer, past, length in zip(buffers, pasts, lengths):
            buffer.reserve(past + length, past)
        if len(rows) == 1:
            kv, cache = None, batch_cache.single_cache(buffers[0], pasts[0])
        else:
            kv = batch_cache.gather(buffers, pasts, n, self.kv_spec)  # [layers, 2, B, heads, P+n, dim]
            cache = batch_cache.BufferCache(kv, max(pasts))
        keep = max(row.keep_logits for row in rows)
        trees = [row.tree for row in rows]
        positions = batch_cache.position_ids(pasts, lengths, n, self.device)  # [B, n]
        mask = None  # one chain: the model's own causal mask over the buffer view (often none at all)
        if kv is not None or any(trees):
            mask = batch_cache.attention_mask(pasts, lengths, n, self.loaded.dtype, self.device)  # [B, 1, n, P+n]
            batch_cache.place_trees(mask, positions, pasts, lengths, trees)
        out = self.model(
            input_ids=batch_cache.input_ids([row.tokens for row in rows], n, self.device),  # [B, n]
            position_ids=positions, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=keep)
        if kv is not None:
            batch_cache.scatter(kv, buffers, pasts, lengths)
        logits = out.logits.float()  # [B, keep, vocab]
        return [logits[b, keep - row.keep_logits:] for b, row in enumerate(rows)], self._hidden_rows(rows)
