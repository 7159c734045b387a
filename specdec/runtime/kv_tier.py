"""An engine's K/V beyond its own sessions: the pod's prefix cache and the shared chunk store.

A session's committed history is cut into chunks of `chunk_tokens` tokens; each full chunk has a
content address (specdec/kv/chunks.py: a hash chain over the model's fingerprint, the cache salt
and the token ids), so the same prefix has the same keys in every session, on every replica.

- **Restore.** When a call brings a history the session's cache lacks (a new session's prompt, a
  resend after a cache miss, a session moved to this replica), the engine looks up the chunks
  past what it holds: first in the pod's prefix cache, then, for the rest, in the store (one
  round trip for all the keys). The longest run of chunks found from there is loaded into the
  session's K/V and only the rest is prefilled. A chunk missing, corrupt, of another layout or
  another model ends the run: the rest is prefilled, the output does not change.
- **Keep.** After a call, the full chunks of its committed history (never a draft the target has
  not accepted) that the session has not kept yet are copied out of its K/V (one device copy on
  the model thread), put into the prefix cache and offered to the store's background writer,
  which encodes and writes them off the model thread, or skips them when its queue is full.

The last token of a call's history is always run, for its logits, so a restore never covers it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specdec.kv.chunks import ChunkError, ChunkLayout, chunk_keys, decode_chunk, encode_chunk
from specdec.kv.chunk_store import ChunkStore
from specdec.kv.writer import ChunkWriter
from specdec.runtime.kv_cache import SessionCache

log = logging.getLogger(__name__)


class PrefixCache:
    """Chunks this pod used recently, by key, least recently used first out past `max_bytes`."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.chunks: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def get(self, key: bytes) -> torch.Tensor | None:
        chunk = self.chunks.get(key)
        if chunk is not None:
            self.chunks.move_to_end(key)
        return chunk

    def put(self, key: bytes, chunk: torch.Tensor) -> None:
        size = chunk.numel() * chunk.element_size()
        if size > self.max_bytes or key in self.chunks:
            return
        self.chunks[key] = chunk
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, old = self.chunks.popitem(last=False)
            self.nbytes -= old.numel() * old.element_size()


@dataclass
class TierCounters:
    """What the engine's K/V tier did since start (the services' metrics read them)."""

    restored_tokens: int = 0     # tokens loaded from chunks instead of prefilled
    cache_hits: int = 0          # chunks found in the pod's prefix cache
    store_hits: int = 0          # chunks read from the store
    store_misses: int = 0        # chunks looked up in the store and not found
    rejected: int = 0            # chunks found but unusable (corrupt, another layout or model)
    kept_chunks: int = 0         # chunks copied out of sessions' K/V after their calls
    restore_seconds: float = 0.0  # time spent looking chunks up and loading them


class KVTier:
    """An engine's prefix cache and chunk store, with the engine's two K/V accessors:
    `read(entry, begin, end)` -> a copy of positions [begin, end) [layers, 2, kv_heads, n, head_dim],
    `load(entry, chunks, tokens)`: append `tokens` whose K/V are the concatenated chunks."""

    def __init__(self, model_key: bytes, layout: ChunkLayout, cache: PrefixCache | None,
                 store: ChunkStore | None, writer: ChunkWriter | None,
                 read: Callable[[SessionCache, int, int], torch.Tensor],
                 load: Callable[[SessionCache, list[torch.Tensor], Sequence[int]], None],
                 device: torch.device | None = None):
        if cache is None and store is None:
            raise ValueError("a K/V tier needs a prefix cache or a store")
        self.model_key, self.layout = model_key, layout
        self.chunk_tokens = layout.tokens
        self.cache, self.store, self.writer = cache, store, writer
        self.read, self.load = read, load
        self.device = device  # where chunks read from the store are decoded to (the engine's K/V device)
        self.counters = TierCounters()

    def metrics(self) -> dict[str, float]:
        """The values of specdec.metrics' KV_CHUNK_COUNTERS and KV_CHUNK_GAUGES (read when
        /metrics is scraped: from another thread, so plain reads of plain counters)."""
        c = self.counters
        values = {
            "specdec_kv_restored_tokens": c.restored_tokens, "specdec_kv_prefix_cache_hits": c.cache_hits,
            "specdec_kv_store_hits": c.store_hits, "specdec_kv_store_misses": c.store_misses,
            "specdec_kv_chunks_rejected": c.rejected, "specdec_kv_restore_seconds": c.restore_seconds,
            "specdec_kv_chunks_kept": c.kept_chunks,
        }
        if self.cache is not None:
            values["specdec_kv_prefix_cache_bytes"] = self.cache.nbytes
        if self.store is not None:
            stats = self.store.stats()
            values.update({
                "specdec_kv_store_bytes_read": stats.bytes_read, "specdec_kv_store_bytes_written": stats.bytes_written,
                "specdec_kv_store_chunks_written": stats.chunks_written,
                "specdec_kv_store_writes_skipped": stats.writes_skipped,
                "specdec_kv_store_writes_failed": stats.writes_failed,
                "specdec_kv_store_up": 1.0 if self.store.healthy else 0.0,
            })
        return values

    def keys(self, tokens: Sequence[int], salt: str = "") -> list[bytes]:
        return chunk_keys(self.model_key, tokens, self.chunk_tokens, salt)

    def restore(self, entry: SessionCache, sequence: Sequence[int], limit: int, salt: str = "") -> int:
        """Load into `entry` (which holds a prefix of `sequence`) the chunks of sequence[:limit]
        found past what it holds; the tokens gained."""
        size, held = self.chunk_tokens, len(entry)
        first, last = held // size, limit // size  # chunk indices: first to look up, end
        if last <= first:
            return 0
        t0 = time.perf_counter()
        keys = self.keys(sequence[:last * size], salt)[first:]
        chunks = self._found(keys)
        begin, end = first * size, (first + len(chunks)) * size
        if end <= held:
            return 0
        if not entry.crop(begin):
            return 0
        self.load(entry, chunks, sequence[begin:end])
        entry.chunks_kept_upto, entry.chunk_salt = end, salt  # those chunks are kept already
        gained = end - held
        counters = self.counters
        counters.restored_tokens += gained
        counters.restore_seconds += time.perf_counter() - t0
        return gained

    def _found(self, keys: list[bytes]) -> list[torch.Tensor]:
        """The chunks of the longest run of `keys` found: the prefix cache's, then the store's."""
        counters = self.counters
        chunks: list[torch.Tensor] = []
        for key in keys:
            chunk = None if self.cache is None else self.cache.get(key)
            if chunk is None:
                break
            chunks.append(chunk)
        counters.cache_hits += len(chunks)
        rest = keys[len(chunks):]
        if not rest or self.store is None:
            return chunks
        for key, value in zip(rest, self.store.get_many(rest)):
            if value is None:
                counters.store_misses += 1
                break
            try:
                chunk = decode_chunk(value, key, self.layout, self.device)
            except ChunkError as exc:
                counters.rejected += 1
                log.warning("K/V chunk %s… unusable (%s): prefilling from there", key.hex()[:12], exc)
                break
            counters.store_hits += 1
            chunks.append(chunk)
            if self.cache is not None:
                self.cache.put(key, chunk)
        return chunks

    def keep(self, entry: SessionCache, committed: int, salt: str = "") -> None:
        """After a call: the full chunks of the first `committed` tokens of `entry` that it has
        not kept yet go to the prefix cache and the store's writer."""
        size = self.chunk_tokens
        if entry.chunk_salt != salt:  # what it kept was keyed for another salt
            entry.chunks_kept_upto, entry.chunk_salt = 0, salt
        last = min(committed, len(entry)) // size
        first = min(entry.chunks_kept_upto // size, last)
        if last <= first:
            return
        keys = self.keys(entry.tokens[:last * size], salt)
        for index in range(first, last):
            key = keys[index]
            chunk = self.read(entry, index * size, (index + 1) * size)  # [layers, 2, heads, size, dim]
            if self.cache is not None:
                self.cache.put(key, chunk)
            if self.writer is not None:
                nbytes = chunk.numel() * chunk.element_size()  # a refusal is counted by the writer
                self.writer.offer(key, lambda chunk=chunk, key=key: encode_chunk(chunk, key), nbytes)
            self.counters.kept_chunks += 1
        entry.chunks_kept_upto = last * size


def weights_digest(model: torch.nn.Module) -> str:
    """blake2b over every parameter and buffer of the model as loaded (names, dtypes, shapes,
    bytes): the same checkpoint in the same dtype and quantization digests the same on every
    replica, any other does not."""
    return tensors_digest(model.state_dict().items())


def tensors_digest(named) -> str:
    """blake2b over (name, tensor) pairs: their names, dtypes, shapes and bytes, in order."""
    import hashlib

    digest = hashlib.blake2b(digest_size=32)
    for name, tensor in named:
        if not isinstance(tensor, torch.Tensor):
            digest.update(f"{name}={tensor!r};".encode())
            continue
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        if tensor.is_mkldnn:  # a weight prepacked for oneDNN (prepack.py): its values, in plain layout
            tensor = tensor.to_dense()
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return digest.hexdigest()
