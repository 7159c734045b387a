"""K/V chunks beyond one session (specdec/runtime/kv_tier.py): the pod's prefix cache and the
K/V store shared by replicas (--prefix-cache-bytes, --kv-store).

Here the unit tests; the other tiers' are in tests/service/test_kv_tier.py and
tests/e2e/test_kv_tier.py. The tier split shares one description: see tests/service/test_kv_tier.py.
"""

from __future__ import annotations

import torch

from specdec.config import TargetConfig
from specdec.runtime.engines import engine_from_config
from tests.service.test_kv_tier import make_engine, history, run


def test_sessions_sharing_a_prefix_prefill_it_once(models):
    engine = make_engine(models["llama"]["target"], prefix_cache_bytes=64 << 20)
    prompt = history(100)
    first, ran_first = run(engine, "a", prompt)
    second, ran_second = run(engine, "b", prompt)
    assert ran_first == 100
    assert ran_second == 100 - 96  # six chunks restored; the last token always runs
    assert torch.equal(first, second)
    assert engine.kv_tier.counters.cache_hits == 6 and engine.kv_tier.counters.restored_tokens == 96
    # a prompt that shares only its first two chunks restores those two
    other = prompt[:40] + history(60, seed=1)
    expected, _ = run(make_engine(models["llama"]["target"]), "x", other)
    got, ran = run(engine, "c", other)
    assert ran == 100 - 32 and torch.equal(got, expected)


def test_the_prefix_cache_stays_within_its_budget(models):
    engine = make_engine(models["llama"]["target"], prefix_cache_bytes=1)  # smaller than one chunk
    prompt = history(40)
    run(engine, "a", prompt)
    _, ran = run(engine, "b", prompt)
    assert ran == 40 and engine.kv_tier.cache.nbytes == 0


def test_drafts_of_a_call_made_ahead_are_never_kept(models):
    """Only the committed history's chunks are kept: a session whose last 20 tokens are drafts
    keeps the chunks that end before them."""
    engine = make_engine(models["llama"]["target"], prefix_cache_bytes=64 << 20)
    tokens = history(70)
    entry, feed = engine.begin("a", 0, 0, tokens)
    engine.forward("a", entry, feed, 1)
    engine.keep_committed(entry, 50)
    assert engine.kv_tier.counters.kept_chunks == 3  # chunks [0, 48): the one to 64 holds drafts
    _, feed_b = engine.begin("b", 0, 0, tokens)
    assert len(feed_b) == 70 - 48


def test_a_different_cache_salt_shares_nothing(models):
    engine = make_engine(models["llama"]["target"], prefix_cache_bytes=64 << 20)
    prompt = history(70)
    entry, feed = engine.begin("a", 0, 0, prompt, "tenant-a")
    engine.forward("a", entry, feed, 1)
    engine.keep_committed(entry, len(prompt), "tenant-a")
    assert len(engine.begin("b", 0, 0, prompt, "tenant-b")[1]) == 70  # another tenant: nothing
    assert len(engine.begin("c", 0, 0, prompt)[1]) == 70              # no salt: nothing
    assert len(engine.begin("d", 0, 0, prompt, "tenant-a")[1]) == 70 - 64
    assert engine.take_restored("d") == 64 and engine.take_restored("d") == 0


def test_engines_that_cannot_cut_chunks_say_so_at_start_up(models, tmp_path, caplog):
    """A DynamicCache model (sliding-window layers) and the llama.cpp engine keep no chunks, and
    their services say so when they start, rather than taking --kv-store silently."""
    from transformers import AutoModelForCausalLM

    from specdec_cli import tiny
    from tests.gguf_writer import write_llama_gguf

    tokenizer = tiny.byte_level_tokenizer()
    config = tiny.model_config("qwen2", len(tokenizer), tokenizer.eos_token_id)
    config.use_sliding_window, config.sliding_window = True, 8
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "sliding")
    tokenizer.save_pretrained(tmp_path / "sliding")
    with caplog.at_level("WARNING"):
        engine = make_engine(str(tmp_path / "sliding"), "memory://", prefix_cache_bytes=1 << 20)
    assert engine.kv_tier is None
    assert "no prefix cache or K/V store" in caplog.text and "DynamicCache" in caplog.text
    caplog.clear()
    gguf = write_llama_gguf(models["llama"]["target"], tmp_path / "target.gguf")
    with caplog.at_level("WARNING"):
        llama = engine_from_config(TargetConfig(model=str(gguf), backend="llama.cpp", kv_store="memory://",
                                                kv_cache_tokens=256))
    try:
        assert llama.kv_tier is None
        assert "no K/V store on the llama.cpp backend" in caplog.text
    finally:
        llama.close()
