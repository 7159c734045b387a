"""Batching: concurrent sessions share forwards, and each session's output is IDENTICAL to what it
gets alone (float64 tiny models, real gRPC).

Here the unit tests; the other tiers' are in tests/service/test_batching.py and
tests/e2e/test_batching.py. The tier split shares one description: see tests/service/test_batching.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from specdec_cli import tiny
from specdec.runtime.kv_cache import SessionCaches
from specdec.runtime.loader import load_model
from specdec.runtime.torch.engine import TorchEngine
from specdec.runtime.session_kv import Row
from specdec.runtime.torch.kv_buffers import KVBuffer, grown_capacity


# ---- the K/V buffers ----------------------------------------------------------------------------

@pytest.fixture
def engines(models):
    """The same model with K/V buffers and with the DynamicCache fallback."""
    loaded = load_model(models["llama"]["target"], "float64")
    buffered = TorchEngine(loaded, SessionCaches(64, 1 << 30), 16)
    fallback = TorchEngine(loaded, SessionCaches(64, 1 << 30), 16)
    fallback.kv_spec = None
    assert buffered.kv_spec is not None
    return buffered, fallback


def test_batched_buffers_match_the_dynamic_cache_with_rollbacks(engines):
    buffered, fallback = engines
    rng = random.Random(9)
    for step in range(12):
        rows = {r: [] for r in engines}
        for sid in (f"s{i}" for i in range(6)):
            if rng.random() < 0.3:
                continue  # this session sits the step out (others join and leave)
            tokens = [rng.randrange(1, 380) for _ in range(rng.choice([1, 2, 5, 30]))]
            keep = rng.randrange(1, len(tokens) + 1)
            rollback = rng.randrange(0, 4)
            for engine in engines:
                entry = engine.caches.get(sid)
                if entry is None:
                    entry = engine.new_entry()
                    engine.caches.put(sid, entry)
                entry.crop(max(0, len(entry) - rollback))
                rows[engine].append(Row(sid, entry, tokens, keep))
        if not rows[buffered]:
            continue
        for got, expected in zip(buffered.forward_batch(rows[buffered]), fallback.forward_batch(rows[fallback])):
            assert got.shape == expected.shape
            assert torch.allclose(got, expected, rtol=0, atol=1e-6), (got - expected).abs().max()
    # the byte total is kept call by call; it equals a scan of every session
    caches = buffered.caches
    assert caches.total_bytes() == sum(e.nbytes() for e in caches._entries.values()) > 0
    caches.release("s0")
    caches.max_sessions = 2
    caches.enforce_limits()
    assert len(caches) == 2 and caches.total_bytes() == sum(e.nbytes() for e in caches._entries.values())


def test_buffer_growth_keeps_memory_near_the_kv_size(engines):
    buffered, _ = engines
    spec = buffered.kv_spec
    assert spec.bytes_per_token == 2 * 2 * 2 * 8 * 8  # layers × (K, V) × kv heads × head dim × float64
    for needed in (1, 17, 300, 1000, 4000, 10_000):
        capacity = grown_capacity(0, needed)
        assert needed <= capacity <= needed + max(8, needed / 16 + 4), (needed, capacity)
        assert capacity % 4 == 0 and grown_capacity(capacity, needed) == capacity  # no growth needed
    buffer = KVBuffer(spec)
    buffer.reserve(5, 0)
    buffer.data[:, :, :, :5] = 7.0
    buffer.reserve(2000, 5)  # grows, keeping the valid part
    assert buffer.capacity >= 2000 and bool((buffer.data[:, :, :, :5] == 7.0).all())
    assert buffer.nbytes() == buffer.capacity * spec.bytes_per_token


def test_sliding_window_models_fall_back_to_the_dynamic_cache(tmp_path, caplog):
    from transformers import AutoModelForCausalLM

    tokenizer = tiny.byte_level_tokenizer()
    config = tiny.model_config("qwen2", len(tokenizer), tokenizer.eos_token_id)
    config.use_sliding_window, config.sliding_window = True, 8
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with caplog.at_level("WARNING"):
        engine = TorchEngine(load_model(str(tmp_path), "float64"), SessionCaches(8, 1 << 30), 4)
    assert engine.kv_spec is None
    assert "DynamicSlidingWindowLayer" in caplog.text and "no batched forwards" in caplog.text
    rows = []
    for sid, tokens in (("a", [5, 6, 7]), ("b", [8] * 12)):
        entry = engine.new_entry()
        engine.caches.put(sid, entry)
        rows.append(Row(sid, entry, tokens, 2))
    logits = engine.forward_batch(rows)  # still one call for both rows, run row by row
    assert [tuple(x.shape) for x in logits] == [(2, 384), (2, 384)]
    assert len(engine.caches.get("b")) == 12


def test_start_up_check_catches_a_model_that_batches_wrongly(engines):
    buffered, _ = engines
    assert buffered._batches_agree()
    forward = buffered.model.model.forward

    def positions_ignored(*args, **kwargs):  # as a model computing positions from the cache would
        kwargs.pop("position_ids", None)
        return forward(*args, **kwargs)

    buffered.model.model.forward = positions_ignored
    try:
        assert not buffered._batches_agree()
    finally:
        buffered.model.model.forward = forward
