"""Content-addressed K/V chunks: stable chained keys, exact round trips, every bad value refused."""

from __future__ import annotations

import random
from array import array

import pytest
import torch

from specdec.kv.chunks import (
    HEADER_BYTES,
    LAYOUT_VERSION,
    ChunkError,
    ChunkLayout,
    chunk_keys,
    decode_chunk,
    encode_chunk,
    model_fingerprint,
)
from specdec.runtime.torch.kv_buffers import KVSpec

MODEL = model_fingerprint({"weights": "sha256:abc", "config": "qwen2", "dtype": "bfloat16"})
OTHER_MODEL = model_fingerprint({"weights": "sha256:abd", "config": "qwen2", "dtype": "bfloat16"})
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
            torch.float64: torch.int64}


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(150_000) for _ in range(n)]


def _kv(layout: ChunkLayout, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.shape, generator=g, dtype=torch.float64).to(layout.dtype)  # [L, 2, H, n, D]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))


SMALL = ChunkLayout(layers=2, kv_heads=1, head_dim=4, dtype=torch.float16, tokens=4)


@pytest.mark.unit
def test_keys_are_stable_one_per_full_chunk_and_chained():
    tokens = _tokens(1000)
    keys = chunk_keys(MODEL, tokens, 256)
    assert len(keys) == 1000 // 256 == 3  # the 232-token tail has no key
    assert all(len(k) == 32 for k in keys) and len(set(keys)) == 3
    assert chunk_keys(MODEL, list(tokens), 256) == keys == chunk_keys(MODEL, array("i", tokens), 256)
    assert chunk_keys(MODEL, tokens[:768], 256) == keys  # the tail does not touch the full chunks
    assert chunk_keys(MODEL, tokens[:255], 256) == []
    assert len(chunk_keys(MODEL, tokens, 7)) == 1000 // 7
    for j, pos in ((0, 0), (1, 256 + 17), (2, 767)):
        changed = list(tokens)
        changed[pos] += 1
        other = chunk_keys(MODEL, changed, 256)
        assert other[:j] == keys[:j]
        assert all(a != b for a, b in zip(other[j:], keys[j:]))
    # a change in the tail leaves every key alone
    changed = list(tokens)
    changed[900] += 1
    assert chunk_keys(MODEL, changed, 256) == keys


@pytest.mark.unit
def test_keys_depend_on_model_salt_and_chunk_size_and_carry_no_token_text():
    tokens = _tokens(512, seed=1)
    keys = chunk_keys(MODEL, tokens, 256)
    for other in (chunk_keys(OTHER_MODEL, tokens, 256), chunk_keys(MODEL, tokens, 256, salt="a")):
        assert len(other) == 2 and all(a != b for a, b in zip(other, keys))
    assert chunk_keys(MODEL, tokens, 256, salt="") == keys
    assert chunk_keys(MODEL, tokens, 256, salt="a") != chunk_keys(MODEL, tokens, 256, salt="b")
    assert chunk_keys(MODEL, tokens, 128)[1] != keys[0]  # same 256 tokens, other chunking
    small = [1, 2, 3, 4, 5, 6, 7, 8]
    raw = array("i", small).tobytes()
    (key,) = chunk_keys(MODEL, small, 8)
    assert len(key) == 32 and key != raw[:32] and raw not in key and raw[:8] not in key
    # the chain is key 0 = H(model ‖ H(salt) ‖ ids), key i = H(key i-1 ‖ ids): a chunk's key
    # is not the key of the same ids starting a fresh sequence
    assert chunk_keys(MODEL, small[4:], 4)[0] != chunk_keys(MODEL, small, 4)[1]


@pytest.mark.unit
def test_chunk_keys_and_spans_validate_arguments():
    for bad in (0, -1):
        with pytest.raises(ValueError, match="chunk_tokens"):
            chunk_keys(MODEL, [1, 2], bad)
    with pytest.raises(ValueError, match="32 bytes"):
        chunk_keys(MODEL[:16], [1, 2], 1)
    with pytest.raises(ValueError, match="int32"):
        chunk_keys(MODEL, [2**31], 1)


@pytest.mark.unit
def test_model_fingerprint_ignores_order_and_tells_every_change_apart():
    base = {"weights": "w1", "config": "c", "dtype": "bfloat16"}
    fp = model_fingerprint(base)
    assert len(fp) == 32
    assert model_fingerprint(dict(reversed(list(base.items())))) == fp
    for name in base:
        assert model_fingerprint({**base, name: base[name] + "x"}) != fp
    assert model_fingerprint({**base, "extra": ""}) != fp
    assert model_fingerprint({"ab": "c"}) != model_fingerprint({"a": "bc"})
    assert model_fingerprint({"a": "b", "c": "d"}) != model_fingerprint({"a": "bc", "": "d"})
    assert model_fingerprint({}) != model_fingerprint({"": ""})


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_round_trip_is_bit_identical(dtype):
    layout = ChunkLayout(layers=3, kv_heads=2, head_dim=8, dtype=dtype, tokens=5)
    kv = _kv(layout, seed=2)
    kv.view(-1)[:3] = torch.tensor([float("nan"), float("-inf"), -0.0], dtype=dtype)
    key = chunk_keys(MODEL, _tokens(5), 5)[0]
    value = encode_chunk(kv, key)
    assert isinstance(value, bytes) and len(value) == HEADER_BYTES + layout.nbytes
    out = decode_chunk(value, key, layout)
    assert _bits_equal(out, kv) and out.shape == (3, 2, 2, 5, 8)
    assert decode_chunk(bytearray(value), key, layout, device="cpu").dtype == dtype
    out.add_(1)  # a fresh tensor: neither the value nor the source change
    assert not _bits_equal(out, kv)
    assert _bits_equal(decode_chunk(value, key, layout), kv)


@pytest.mark.unit
def test_round_trip_of_a_slice_of_a_session_buffer():
    spec = KVSpec(layers=2, kv_heads=2, head_dim=4, dtype=torch.bfloat16, device=torch.device("cpu"))
    data = torch.randn(2, 2, 2, 20, 4).to(torch.bfloat16)  # [layers, 2, kv_heads, capacity, head_dim]
    layout = ChunkLayout.from_spec(spec, tokens=8)
    assert layout.nbytes == 8 * spec.bytes_per_token
    key = chunk_keys(MODEL, _tokens(16), 8)[1]
    chunk = data[:, :, :, 8:16, :]
    assert not chunk.is_contiguous()
    out = decode_chunk(encode_chunk(chunk, key), key, layout)
    assert _bits_equal(out, chunk.contiguous())
    assert not _bits_equal(out, data[:, :, :, 0:8, :].contiguous())


@pytest.mark.unit
def test_each_bad_value_is_refused_with_its_reason():
    kv = _kv(SMALL, seed=3)
    key, other_key = chunk_keys(MODEL, _tokens(8), 4)
    value = encode_chunk(kv, key)

    def reason(data: bytes, k: bytes = key, layout: ChunkLayout = SMALL) -> str:
        with pytest.raises(ChunkError) as err:
            decode_chunk(data, k, layout)
        return err.value.reason

    def flip(data: bytes, byte: int, bit: int = 0) -> bytes:
        b = bytearray(data)
        b[byte] ^= 1 << bit
        return bytes(b)

    assert reason(b"") == reason(value[:HEADER_BYTES - 1]) == "truncated"
    assert reason(value[:-1]) == reason(value[:HEADER_BYTES]) == "truncated"
    assert reason(value + b"\0") == "length"
    assert reason(flip(value, 0)) == "magic"
    assert reason(flip(value, 4)) == "version"  # the version field follows the magic
    assert reason(value, other_key) == "key"
    assert reason(encode_chunk(kv, other_key)) == "key"
    assert reason(flip(value, HEADER_BYTES + 5, 3)) == "checksum"
    assert reason(flip(value, len(value) - 1, 7)) == "checksum"
    assert reason(value, layout=ChunkLayout(2, 1, 4, torch.bfloat16, 4)) == "dtype"
    assert reason(encode_chunk(kv.float(), key)) == "dtype"
    for dims in ((3, 1, 4), (2, 2, 4), (2, 1, 8)):
        assert reason(value, layout=ChunkLayout(*dims, torch.float16, 4)) == "shape"
    assert reason(value, layout=ChunkLayout(2, 1, 4, torch.float16, 8)) == "shape"
    assert reason(encode_chunk(kv[:, :, :, :3, :], key)) == "shape"
    assert str(ChunkError("key", "value was stored under another key")).startswith("key: ")
    decode_chunk(value, key, SMALL)  # the original is still fine


@pytest.mark.unit
def test_any_corruption_raises_chunk_error_only():
    kv = _kv(SMALL, seed=4)
    (key,) = chunk_keys(MODEL, _tokens(4), 4)
    value = encode_chunk(kv, key)
    reasons = set()
    for i in range(len(value) * 8):  # every single-bit flip, header and payload
        bad = bytearray(value)
        bad[i // 8] ^= 1 << (i % 8)
        with pytest.raises(ChunkError) as err:
            decode_chunk(bytes(bad), key, SMALL)
        reasons.add(err.value.reason)
    assert {"magic", "version", "dtype", "shape", "key", "length", "checksum"} <= reasons
    rng = random.Random(5)
    for n in range(len(value)):  # every truncation
        with pytest.raises(ChunkError):
            decode_chunk(value[:n], key, SMALL)
    for _ in range(500):  # random bytes, random splices of a valid header
        size = rng.randrange(0, 2 * len(value))
        noise = bytes(rng.randrange(256) for _ in range(size))
        cut = rng.randrange(len(value))
        for bad in (noise, value[:cut] + noise, noise[:8] + value[8:]):
            if bad == value:
                continue
            with pytest.raises(ChunkError):
                decode_chunk(bad, key, SMALL)


@pytest.mark.unit
def test_encode_rejects_what_it_cannot_store():
    key = chunk_keys(MODEL, [1], 1)[0]
    with pytest.raises(ValueError, match="layers, 2"):
        encode_chunk(torch.zeros(2, 3, 1, 4, 4), key)
    with pytest.raises(ValueError, match="dtype"):
        encode_chunk(torch.zeros(2, 2, 1, 4, 4, dtype=torch.int8), key)
    with pytest.raises(ValueError, match="32 bytes"):
        encode_chunk(torch.zeros(2, 2, 1, 4, 4), key[:31])
    with pytest.raises(ValueError, match="tokens"):
        ChunkLayout(2, 1, 4, torch.float16, 0)


@pytest.mark.unit
def test_stored_size_is_within_5_percent_of_the_theoretical_kv():
    # Qwen2.5-1.5B: 28 layers, 2 K/V heads, head_dim 128, bfloat16; one 256-token chunk (~7 MB)
    spec = KVSpec(layers=28, kv_heads=2, head_dim=128, dtype=torch.bfloat16, device=torch.device("cpu"))
    layout = ChunkLayout.from_spec(spec, tokens=256)
    assert spec.bytes_per_token == 28 * 2 * 2 * 128 * 2
    kv = torch.zeros(layout.shape, dtype=torch.bfloat16)
    kv.view(-1)[::997] = 1.5
    key = chunk_keys(MODEL, _tokens(256), 256)[0]
    value = encode_chunk(kv, key)
    assert HEADER_BYTES < 100 and len(value) - layout.nbytes == HEADER_BYTES
    assert len(value) <= 1.05 * 256 * spec.bytes_per_token
    assert torch.equal(decode_chunk(value, key, layout), kv)
    assert LAYOUT_VERSION == 1
