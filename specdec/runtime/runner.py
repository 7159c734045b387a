"""Run a causal LM over sessions: roll back, append tokens, return logits.

`forward_batch` runs several sessions in ONE forward over their K/V buffers (a ragged batch,
see batch_cache.py); models whose cache cannot live in buffers run the rows one by one.
A runner is driven by one model worker thread (specdec/runtime/worker.py), so its methods
never run concurrently and need no lock. Long inputs are prefilled in chunks
(`prefill_step`), each a separate worker task, so one long prompt does not hold the model
for every other session.
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from specdec.errors import CacheMiss, InvalidArgument, ResourceExhausted
from specdec.logtag import session_tag
from specdec.runtime import batch_cache
from specdec.runtime.kv_cache import DynamicKV, KVBuffer, SessionCache, SessionCaches, common_prefix
from specdec.runtime.loader import LoadedModel, eos_token_ids, max_context_length
from specdec.tokenizer import tokenizer_fingerprint
from specdec.types import ModelDescription, Quantization

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Row:
    """One session's part of a forward: append `tokens`, return the last keep_logits logits."""

    session_id: str
    entry: SessionCache
    tokens: Sequence[int]
    keep_logits: int


class ModelRunner:
    """One model, many sessions."""

    def __init__(self, loaded: LoadedModel, caches: SessionCaches, max_speculative_tokens: int,
                 prefill_chunk: int = 512):
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.caches = caches
        self.prefill_chunk = max(1, prefill_chunk)
        self.tokens_run = 0  # tokens forwarded since start (prefill work included)
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
        )
        self.kv_spec, why = batch_cache.buffered_spec(self.model, self.device, loaded.dtype)
        if self.kv_spec is not None and not self._batches_agree():
            self.kv_spec, why = None, "a batched forward of two sessions disagreed with running them alone"
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

    def new_entry(self) -> SessionCache:
        """An empty session cache of the kind this model uses."""
        return SessionCache(DynamicKV() if self.kv_spec is None else KVBuffer(self.kv_spec))

    # ---- validation (no cache access) -----------------------------------------------------

    def check_request(self, session_id: str, prefix_len: int, new_tokens: Sequence[int], extra: int) -> None:
        """Validate a call's shape before touching any cache."""
        if not session_id:
            raise InvalidArgument("session_id is required")
        if prefix_len < 0:
            raise InvalidArgument(f"prefix_len must be >= 0, got {prefix_len}")
        if not new_tokens:
            raise InvalidArgument("new_tokens must hold at least one token")
        self.check_token_ids(new_tokens, "new_tokens")
        total = prefix_len + len(new_tokens) + extra
        if total > self.context_length:
            raise InvalidArgument(
                f"sequence of {total} tokens exceeds the model context of {self.context_length}"
            )

    def check_token_ids(self, ids: Sequence[int], what: str) -> None:
        if ids and not (0 <= min(ids) and max(ids) < self.embedding_size):
            bad = [t for t in ids if not 0 <= t < self.embedding_size]
            raise InvalidArgument(
                f"{what} holds ids outside the vocabulary [0, {self.embedding_size}): {bad[:5]}"
            )

    def needs_prefill_steps(self, new_tokens: Sequence[int]) -> bool:
        """True when the input is long enough to be prefilled in several worker tasks."""
        return len(new_tokens) > self.prefill_chunk

    # ---- session state (worker thread only) -----------------------------------------------

    def _held(self, session_id: str, prefix_len: int, prefix_hash: int) -> SessionCache:
        """The session's cache, checked to hold the assumed prefix; CacheMiss otherwise."""
        entry = self.caches.get(session_id)
        if entry is None or not entry.holds(prefix_len, prefix_hash):
            raise CacheMiss(session_id, 0 if entry is None else len(entry), prefix_len)
        return entry

    def _reusing(self, session_id: str, sequence: Sequence[int], limit: int) -> SessionCache:
        """The session's cache cropped to its longest common prefix with sequence[:limit]
        (a fresh cache when nothing is shared)."""
        entry = self.caches.get(session_id)
        keep = 0 if entry is None else common_prefix(entry.tokens, sequence[:limit])
        if entry is None or keep == 0 or not entry.crop(keep):
            entry = self.new_entry()
            self.caches.put(session_id, entry)
        return entry

    def begin(self, session_id: str, prefix_len: int, prefix_hash: int,
              new_tokens: Sequence[int]) -> tuple[SessionCache, Sequence[int]]:
        """Roll the session back to what the call assumes: (cache, tokens still to run).

        prefix_len 0 assumes nothing: the call carries the whole history and the cache keeps
        whatever prefix of it it already holds (a resend after a timeout or a cache miss
        reuses the finished work). The last token is always run again, for its logits.
        """
        if prefix_len == 0:
            entry = self._reusing(session_id, new_tokens, len(new_tokens) - 1)
            return entry, new_tokens[len(entry):]
        entry = self._held(session_id, prefix_len, prefix_hash)
        if not entry.crop(prefix_len):
            raise CacheMiss(session_id, len(entry), prefix_len)
        return entry, new_tokens

    def held_prefix(self, session_id: str, prefix_len: int, prefix_hash: int) -> array:
        """The first prefix_len tokens the session holds, checked against the fingerprint."""
        if prefix_len == 0:
            return array("i")
        return self._held(session_id, prefix_len, prefix_hash).tokens[:prefix_len]

    def prefill_step(self, session_id: str, sequence: Sequence[int], upto: int) -> tuple[int, int]:
        """Advance the session towards holding sequence[:upto] by at most one chunk.

        Safe to interleave with other calls on the session: each step starts from the longest
        common prefix of what the cache holds. Returns (tokens held, their fingerprint).
        """
        entry = self._reusing(session_id, sequence, upto)
        held = len(entry)
        if held < upto:
            self.forward(session_id, entry, sequence[held:min(held + self.prefill_chunk, upto)], 1)
        self.finish(session_id)
        return len(entry), entry.hashes.at(len(entry))

    def forward(self, session_id: str, entry: SessionCache, tokens: Sequence[int],
                keep_logits: int) -> torch.Tensor:
        """Append tokens to one session; float32 logits of its last keep_logits positions.

        -> [keep_logits, vocab]."""
        return self.forward_batch([Row(session_id, entry, tokens, keep_logits)])[0]

    @torch.inference_mode()
    def forward_batch(self, rows: Sequence[Row]) -> list[torch.Tensor]:
        """Append each row's tokens to its session in ONE forward (rows are distinct sessions);
        per row, float32 logits of its last keep_logits positions -> [keep_logits, vocab].

        A forward that fails part-way may leave layers that disagree: the rows' caches are then
        dropped, so their next calls rebuild them.
        """
        try:
            if self.kv_spec is None:
                logits = [self._forward_dynamic(row) for row in rows]
            else:
                logits = self._forward_buffered(rows)
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
        return logits

    def _forward_dynamic(self, row: Row) -> torch.Tensor:
        """The fallback: one session through its DynamicCache -> [keep_logits, vocab]."""
        input_ids = torch.tensor([list(row.tokens)], dtype=torch.long, device=self.device)  # [1, n]
        kv = row.entry.kv
        out = self.model(input_ids=input_ids, cache=kv.cache, use_cache=True, logits_to_keep=row.keep_logits)
        kv.cache = out.cache
        return out.logits[0, -row.keep_logits:].float()

    def _forward_buffered(self, rows: Sequence[Row]) -> list[torch.Tensor]:
        """Every row in one forward over the sessions' K/V buffers (see batch_cache)."""
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
        out = self.model(
            input_ids=batch_cache.input_ids([row.tokens for row in rows], n, self.device),  # [B, n]
            position_ids=batch_cache.position_ids(pasts, lengths, n, self.device),  # [B, n]
            # one row: the model's own causal mask over the buffer view (often none at all)
            attention_mask=None if kv is None else batch_cache.attention_mask(pasts, lengths, n, self.loaded.dtype,
                                                                              self.device),
            cache=cache, use_cache=True, logits_to_keep=keep)
        if kv is not None:
            batch_cache.scatter(kv, buffers, pasts, lengths)
        logits = out.logits.float()  # [B, keep, vocab]
        return [logits[b, keep - row.keep_logits:] for b, row in enumerate(rows)]

    def finish(self, keep: str | Iterable[str], extra_bytes: int = 0) -> None:
        """Apply the cache bounds after a call (never evicting the sessions just used), or before
        a forward that grows buffers by extra_bytes."""
        evicted = self.caches.enforce_limits(keep=keep, extra_bytes=extra_bytes)
        if evicted:
            log.info("evicted %d session cache(s): %s", len(evicted), [session_tag(s) for s in evicted])

    def release(self, session_id: str) -> bool:
        """Forget a session's cache. Never waits for the model: a forward running on it keeps
        its own reference and the memory is freed when it ends."""
        return self.caches.release(session_id)


def runner_from_config(config) -> ModelRunner:
    """Load the model of a ModelServiceConfig and wrap it in a runner with its cache bounds."""
    from specdec.runtime.loader import load_model

    loaded = load_model(config.model, config.dtype, config.device, config.trust_remote_code,
                        getattr(config, "quantize", Quantization.NONE))
    caches = SessionCaches(config.max_sessions, config.kv_cache_bytes)
    return ModelRunner(loaded, caches, config.max_speculative_tokens, config.prefill_chunk)
