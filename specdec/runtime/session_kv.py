"""The session half of every engine: a session's cache rolled back to what a call assumes,
chunked prefill, the cache bounds. An engine adds `new_entry` and `forward_batch`.

An engine is driven by one model worker thread (specdec/runtime/serving/worker.py), so its methods
never run concurrently and need no lock (`release` aside, which only drops the entry).
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from specdec.errors import CacheMiss, InvalidArgument
from specdec.logtag import session_tag
from specdec.runtime.kv_cache import SessionCache, SessionCaches, common_prefix
from specdec.maths.tree import TokenTree
from specdec.types import ModelDescription

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Row:
    """One session's part of a forward: append `tokens`, return the last keep_logits logits."""

    session_id: str
    entry: SessionCache
    tokens: Sequence[int]
    keep_logits: int
    tree: TokenTree | None = None  # the session's last len(tree) tokens after this forward (None: a chain)


class SessionKV:
    """One model, many sessions: the engine-independent half of an engine.

    An engine sets caches, prefill_chunk, context_length, embedding_size, vocab_size,
    description, device, tokenizer, tokens_run and restored (an empty dict), and implements
    new_entry and forward_batch."""

    caches: SessionCaches
    prefill_chunk: int
    context_length: int  # longest sequence the model takes
    embedding_size: int  # token ids the model accepts: [0, embedding_size)
    vocab_size: int  # logits per position
    description: ModelDescription
    device: Any  # the torch device of the logits forward_batch returns
    tokenizer: Any  # the model's transformers tokenizer
    tokens_run: int  # tokens forwarded since start (prefill work included)
    kv_tier: Any = None  # a KVTier (kv_tier.py) where the engine can move K/V chunks, else None
    restored: dict[str, int]  # per session, tokens restored from chunks not yet reported by a call
    heads: Any = None  # the target's Medusa-style heads (target_heads.TargetHeads), None without --heads

    def new_entry(self) -> SessionCache:
        """An empty session cache of the kind this engine uses."""
        raise NotImplementedError

    @property
    def verifies_trees(self) -> bool:
        """Whether forward_batch takes rows with a tree (and keep_path compacts one)."""
        return False

    @property
    def grows_trees(self) -> bool:
        """Whether forward_batch also takes a tree whose earlier depths are in the cache already
        (the draft grows a tree one depth per forward)."""
        return self.verifies_trees

    def keep_path(self, entry: SessionCache, base: int, path: Sequence[int]) -> None:
        """After a tree's forward: keep the session's first `base` tokens, then the tree nodes
        `path` (node indices, ascending) moved to the positions right after them."""
        raise NotImplementedError

    def forward_batch(self, rows: Sequence[Row]) -> list:
        """Append each row's tokens to its session in ONE forward (rows are distinct sessions);
        per row, float32 logits of its last keep_logits positions -> [keep_logits, vocab]."""
        raise NotImplementedError

    def forward_hidden(self, rows: Sequence[Row]) -> tuple[list, list]:
        """forward_batch, and per row the hidden states its output layer took at the same positions
        -> ([keep_logits, vocab] float32, [keep_logits, hidden] in the model's dtype) per row. Only
        an engine with heads (`heads` set) hands them out."""
        raise NotImplementedError(f"{type(self).__name__} hands out no hidden states")

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

    def _reusing(self, session_id: str, sequence: Sequence[int], limit: int, salt: str = "") -> SessionCache:
        """The session's cache cropped to its longest common prefix with sequence[:limit]
        (a fresh cache when nothing is shared), extended by the K/V chunks of the rest the K/V
        tier finds (keys salted with `salt`)."""
        entry = self.caches.get(session_id)
        keep = 0 if entry is None else common_prefix(entry.tokens, sequence[:limit])
        if entry is None or keep == 0 or not entry.crop(keep):
            entry = self.new_entry()
            self.caches.put(session_id, entry)
        if self.kv_tier is not None:
            restored = self.kv_tier.restore(entry, sequence, limit, salt)
            if restored:
                self.caches.account(entry)
                self.restored[session_id] = self.restored.get(session_id, 0) + restored
        return entry

    def take_restored(self, session_id: str) -> int:
        """Tokens restored from chunks for the session since this was last asked (its prefill
        steps' and its final step's): what its call reports."""
        return self.restored.pop(session_id, 0)

    def begin(self, session_id: str, prefix_len: int, prefix_hash: int,
              new_tokens: Sequence[int], salt: str = "") -> tuple[SessionCache, Sequence[int]]:
        """Roll the session back to what the call assumes: (cache, tokens still to run).

        prefix_len 0 assumes nothing: the call carries the whole history and the cache keeps
        whatever prefix of it it already holds (a resend after a timeout or a cache miss
        reuses the finished work). The last token is always run again, for its logits.
        """
        if prefix_len == 0:
            entry = self._reusing(session_id, new_tokens, len(new_tokens) - 1, salt)
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

    def prefill_step(self, session_id: str, sequence: Sequence[int], upto: int,
                     salt: str = "") -> tuple[int, int]:
        """Advance the session towards holding sequence[:upto] by at most one chunk.

        Safe to interleave with other calls on the session: each step starts from the longest
        common prefix of what the cache holds. Returns (tokens held, their fingerprint).
        """
        entry = self._reusing(session_id, sequence, upto, salt)
        held = len(entry)
        if held < upto:
            self.forward(session_id, entry, sequence[held:min(held + self.prefill_chunk, upto)], 1)
        self.keep_committed(entry, len(entry), salt)
        self.finish(session_id)
        return len(entry), entry.hashes.at(len(entry))

    def forward(self, session_id: str, entry: SessionCache, tokens: Sequence[int],
                keep_logits: int) -> Any:
        """Append tokens to one session; float32 logits of its last keep_logits positions.

        -> [keep_logits, vocab]."""
        return self.forward_batch([Row(session_id, entry, tokens, keep_logits)])[0]

    def keep_committed(self, entry: SessionCache, committed: int, salt: str = "") -> None:
        """After a call: hand the full chunks of the session's first `committed` tokens (its
        committed history, never drafts) to the K/V tier, keyed with `salt`."""
        if self.kv_tier is not None:
            self.kv_tier.keep(entry, committed, salt)

    def finish(self, keep: str | Iterable[str], extra_bytes: int = 0) -> None:
        """Apply the cache bounds after a call (never evicting the sessions just used), or before
        a forward that grows buffers by extra_bytes."""
        evicted = self.caches.enforce_limits(keep=keep, extra_bytes=extra_bytes)
        if evicted:
            log.info("evicted %d session cache(s): %s", len(evicted), [session_tag(s) for s in evicted])

    def release(self, session_id: str) -> bool:
        """Forget a session's cache. Never waits for the model: a forward running on it keeps
        its own reference and the memory is freed when it ends."""
        self.restored.pop(session_id, None)
        return self.caches.release(session_id)
