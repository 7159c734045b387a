"""Content-addressed K/V chunks: the format a session's K/V cache takes in a shared store.

A session's committed tokens are cut into chunks of `chunk_tokens` (256 by default) aligned to
multiples of it; only FULL chunks are stored. Chunk i of a session's K/V is
data[:, :, :, i·n:(i+1)·n, :] of the buffer [layers, 2, kv_heads, capacity, head_dim].

Its key depends only on what determines its content: the model (a fingerprint of the weights,
config, dtype, ... and of LAYOUT_VERSION), an optional salt (a tenant, to keep caches apart),
and every token up to the chunk's end, chained like a hash list:

    key 0 = H(model ‖ H(salt) ‖ tokens of chunk 0)
    key i = H(key i−1 ‖ tokens of chunk i)

so the same prefix gets the same keys in every session and on every replica, a change in
chunk j changes keys j.. and no earlier one, and a key carries no token text. H is blake2b with
a 32-byte digest, token ids are hashed as little-endian int32.

A stored value is a fixed 72-byte header (magic, layout version, dtype, shape, the key echoed,
crc32 and length of the payload) followed by the raw K/V bytes, so a reader detects a value
found under the wrong key, written by another model or layout, or damaged, and never loads it.
The payload is in the host's byte order (little-endian on every platform this runs on).
"""

from __future__ import annotations

import hashlib
import struct
import sys
import zlib
from array import array
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

LAYOUT_VERSION = 1  # the K/V layout "layers,2,kv_heads,tokens,head_dim"; bump when it changes
KEY_BYTES = 32  # a chunk key and a model fingerprint are 32-byte digests
MAGIC = b"SDKV"

# dtype <-> code in the header; codes are part of the format: never renumber, only append
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
}
_CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}

# magic, version, dtype code, shape (layers, 2, kv_heads, tokens, head_dim), key, crc32, length
_HEADER = struct.Struct(f"<4sHH5I{KEY_BYTES}sIQ")
HEADER_BYTES = _HEADER.size  # 72

_SALT_DOMAIN = b"specdec-kv-salt\x00"  # H(salt) = blake2b(domain ‖ salt): fixed for salt ""


class ChunkError(ValueError):
    """A stored value that must not be loaded; `reason` is one of REASONS (for metrics), the
    message says what was found."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


REASONS = ("truncated", "magic", "version", "dtype", "shape", "key", "length", "checksum")


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in parts:
        h.update(part)
    return h.digest()


def model_fingerprint(identity: Mapping[str, str]) -> bytes:
    """32 bytes naming what a chunk's K/V depend on besides the tokens: sha256 over
    LAYOUT_VERSION and the sorted (name, value) pairs an engine supplies (weights digest, config,
    dtype, ...), each string length-prefixed so ("ab", "c") and ("a", "bc") differ."""
    h = hashlib.sha256(b"specdec-kv-model\x00")
    h.update(struct.pack("<I", LAYOUT_VERSION))
    for name, value in sorted(identity.items()):
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError(f"model identity entries must be str: {name!r}={value!r}")
        for text in (name, value):
            raw = text.encode("utf-8")
            h.update(struct.pack("<Q", len(raw)))
            h.update(raw)
    return h.digest()


def _check_chunk_tokens(chunk_tokens: int) -> None:
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be an integer >= 1, got {chunk_tokens!r}")


def _token_bytes(tokens: Sequence[int]) -> memoryview:
    """The token ids as little-endian int32 bytes."""
    try:
        ids = array("i", tokens)
    except OverflowError as exc:
        raise ValueError("token ids must fit in int32") from exc
    if ids.itemsize != 4:  # pragma: no cover - no such platform in use
        raise ValueError("array('i') is not 32-bit on this platform")
    if sys.byteorder == "big":  # pragma: no cover
        ids.byteswap()
    return memoryview(ids).cast("B")


def chunk_keys(model: bytes, tokens: Sequence[int], chunk_tokens: int, salt: str = "") -> list[bytes]:
    """One 32-byte key per FULL chunk of `tokens` (len(tokens) // chunk_tokens keys; a partial
    tail chunk has none). model: a model_fingerprint(); salt: keeps caches apart (e.g. per
    tenant); "" is the default and differs from every non-empty salt."""
    _check_chunk_tokens(chunk_tokens)
    if len(model) != KEY_BYTES:
        raise ValueError(f"model fingerprint must be {KEY_BYTES} bytes, got {len(model)}")
    count = len(tokens) // chunk_tokens
    raw = _token_bytes(tokens[: count * chunk_tokens])  # [count · chunk_tokens · 4]
    step = chunk_tokens * 4
    keys: list[bytes] = []
    prev = bytes(model) + _digest(_SALT_DOMAIN, salt.encode("utf-8"))
    for i in range(count):
        prev = _digest(prev, raw[i * step : (i + 1) * step])
        keys.append(prev)
    return keys


@dataclass(frozen=True)
class ChunkLayout:
    """What a stored chunk of a given model must look like."""

    layers: int  # decoder layers holding K/V
    kv_heads: int  # key/value heads per layer
    head_dim: int  # elements per head
    dtype: torch.dtype  # element type of the cache
    tokens: int  # chunk length in tokens (chunk_tokens)

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ChunkLayout.{name} must be an integer >= 1, got {value!r}")
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"unsupported K/V dtype {self.dtype}; supported: {list(DTYPE_CODES)}")

    @classmethod
    def from_spec(cls, spec: Any, tokens: int) -> ChunkLayout:
        """The layout of `tokens`-token chunks of anything with layers, kv_heads, head_dim and
        dtype attributes (a runtime.kv_cache.KVSpec)."""
        return cls(spec.layers, spec.kv_heads, spec.head_dim, spec.dtype, tokens)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """[layers, 2, kv_heads, tokens, head_dim]"""
        return (self.layers, 2, self.kv_heads, self.tokens, self.head_dim)

    @property
    def nbytes(self) -> int:
        """Size of the payload: the chunk's theoretical K/V size."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.layers * 2 * self.kv_heads * self.tokens * self.head_dim * element


def encode_chunk(kv: torch.Tensor, key: bytes) -> bytes:
    """The stored value of one chunk: header + raw K/V bytes.

    kv: [layers, 2, kv_heads, n, head_dim] of float32 / float16 / bfloat16 / float64, on any
    device, contiguous or a slice of a bigger buffer; key: its chunk_keys() entry.
    """
    if kv.dim() != 5 or kv.shape[1] != 2 or kv.numel() == 0:
        raise ValueError(f"expected a non-empty [layers, 2, kv_heads, n, head_dim] tensor, got {tuple(kv.shape)}")
    if kv.dtype not in DTYPE_CODES:
        raise ValueError(f"unsupported K/V dtype {kv.dtype}; supported: {list(DTYPE_CODES)}")
    if len(key) != KEY_BYTES:
        raise ValueError(f"chunk key must be {KEY_BYTES} bytes, got {len(key)}")
    nbytes = kv.numel() * kv.element_size()
    out = bytearray(HEADER_BYTES + nbytes)
    # one copy, straight from kv (strided, any device) into the value's payload region
    payload = torch.frombuffer(out, dtype=kv.dtype, count=kv.numel(), offset=HEADER_BYTES)
    payload.view(kv.shape).copy_(kv.detach())  # [layers, 2, kv_heads, n, head_dim]
    crc = zlib.crc32(memoryview(out)[HEADER_BYTES:])
    _HEADER.pack_into(out, 0, MAGIC, LAYOUT_VERSION, DTYPE_CODES[kv.dtype], *kv.shape, bytes(key), crc, nbytes)
    return bytes(out)


def decode_chunk(value: bytes, key: bytes, layout: ChunkLayout, device: Any = None) -> torch.Tensor:
    """The K/V of a stored value: a fresh [layers, 2, kv_heads, tokens, head_dim] tensor of
    layout.dtype (on `device`, CPU by default), or ChunkError(reason) when the value is not
    exactly a chunk of this layout stored under this key. Raises nothing else for any bytes."""
    view = memoryview(value).cast("B")
    if len(view) < HEADER_BYTES:
        raise ChunkError("truncated", f"{len(view)} bytes, shorter than the {HEADER_BYTES}-byte header")
    magic, version, code, *shape, echoed, crc, length = _HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise ChunkError("magic", f"not a K/V chunk (magic {magic!r})")
    if version != LAYOUT_VERSION:
        raise ChunkError("version", f"layout version {version}, expected {LAYOUT_VERSION}")
    dtype = _CODE_DTYPES.get(code)
    if dtype != layout.dtype:
        raise ChunkError("dtype", f"dtype {dtype or f'code {code}'}, expected {layout.dtype}")
    if tuple(shape) != layout.shape:
        raise ChunkError("shape", f"shape {tuple(shape)}, expected {layout.shape}")
    if echoed != key:
        raise ChunkError("key", "value was stored under another key")
    if length != layout.nbytes:
        raise ChunkError("length", f"declared payload {length} bytes, layout needs {layout.nbytes}")
    got = len(view) - HEADER_BYTES
    if got < length:
        raise ChunkError("truncated", f"payload {got} of {length} bytes")
    if got > length:
        raise ChunkError("length", f"{got - length} trailing bytes after the payload")
    body = view[HEADER_BYTES:]
    if zlib.crc32(body) != crc:
        raise ChunkError("checksum", "payload crc32 mismatch")
    kv = torch.frombuffer(bytearray(body), dtype=layout.dtype).view(layout.shape)  # owns its copy
    return kv if device is None else kv.to(device)
