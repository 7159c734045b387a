"""Run a causal LM over sessions: roll back, append tokens, return logits."""

from __future__ import annotations

import logging
import threading

import torch

from specdec.errors import CacheMiss, InvalidArgument, ResourceExhausted
from specdec.logtag import session_tag
from specdec.runtime.kv_cache import SessionCache, SessionCaches
from specdec.runtime.loader import (
    LoadedModel,
    eos_token_ids,
    max_context_length,
    tokenizer_fingerprint,
)
from specdec.types import ModelDescription

log = logging.getLogger(__name__)


class ModelRunner:
    """One model, many sessions. Calls are serialised by a lock (one forward at a time)."""

    def __init__(self, loaded: LoadedModel, caches: SessionCaches, max_speculative_tokens: int):
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.caches = caches
        self.lock = threading.Lock()
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.embedding_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.context_length = max_context_length(self.model, loaded.tokenizer)
        self.description = ModelDescription(
            model_id=loaded.model_id,
            vocab_size=self.vocab_size,
            tokenizer_fingerprint=tokenizer_fingerprint(loaded.tokenizer),
            tokenizer_vocab_size=len(loaded.tokenizer),
            eos_token_ids=eos_token_ids(self.model, loaded.tokenizer),
            max_context_length=self.context_length,
            dtype=str(loaded.dtype).removeprefix("torch."),
            device=str(self.device),
            max_speculative_tokens=max_speculative_tokens,
        )

    def check_request(self, session_id: str, prefix_len: int, new_tokens: list[int], extra: int) -> None:
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

    def check_token_ids(self, ids: list[int], what: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.embedding_size]
        if bad:
            raise InvalidArgument(
                f"{what} holds ids outside the vocabulary [0, {self.embedding_size}): {bad[:5]}"
            )

    def session(self, session_id: str, prefix_len: int) -> SessionCache:
        """The session's cache rolled back to prefix_len; a fresh one when prefix_len is 0."""
        if prefix_len == 0:
            entry = SessionCache()
            self.caches.put(session_id, entry)
            return entry
        entry = self.caches.get(session_id)
        held = 0 if entry is None else len(entry)
        if entry is None or held < prefix_len or not entry.crop(prefix_len):
            raise CacheMiss(session_id, held, prefix_len)
        return entry

    @torch.inference_mode()
    def forward(self, entry: SessionCache, tokens: list[int], keep_logits: int) -> torch.Tensor:
        """Append tokens to the session; return float32 logits of the last keep_logits positions.

        -> [keep_logits, vocab]
        """
        input_ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, n]
        try:
            out = self.model(input_ids=input_ids, cache=entry.cache, use_cache=True,
                             logits_to_keep=keep_logits)
        except torch.OutOfMemoryError as exc:
            raise ResourceExhausted(f"out of device memory running {len(tokens)} tokens: {exc}") from exc
        entry.cache = out.cache
        entry.tokens.extend(tokens)
        return out.logits[0, -keep_logits:].float()  # [keep_logits, vocab]

    def finish(self, session_id: str) -> None:
        """Apply the cache bounds after a call (never evicting the session just used)."""
        evicted = self.caches.enforce_limits(keep=session_id)
        if evicted:
            log.info("evicted %d session cache(s): %s", len(evicted), [session_tag(s) for s in evicted])

    def release(self, session_id: str) -> bool:
        with self.lock:
            return self.caches.release(session_id)


def runner_from_config(config) -> ModelRunner:
    """Load the model of a ModelServiceConfig and wrap it in a runner with its cache bounds."""
    from specdec.runtime.loader import load_model

    loaded = load_model(config.model, config.dtype, config.device, config.trust_remote_code)
    caches = SessionCaches(config.max_sessions, config.kv_cache_bytes)
    return ModelRunner(loaded, caches, config.max_speculative_tokens)
