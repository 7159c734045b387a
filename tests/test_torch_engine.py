"""The model engine: rollback, reuse of a resent prefix, chunked prefill, and a forward that fails
part-way (out of memory in a later layer) drops the session's cache instead of leaving layers that disagree."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import CacheMiss
from specdec.fingerprint import fingerprint
from specdec.runtime.kv_cache import SessionCaches, common_prefix
from specdec.runtime.loader import load_model
from specdec.runtime.torch.engine import TorchEngine

pytestmark = pytest.mark.unit

HISTORY = [5, 17, 42, 9, 33, 8, 21, 64, 3, 77]


@pytest.fixture
def engine(models):
    return TorchEngine(load_model(models["llama"]["target"], "float64"), SessionCaches(8, 1 << 30), 16,
                       prefill_chunk=4)


def run(engine, sid, prefix_len, new_tokens):
    entry, feed = engine.begin(sid, prefix_len, fingerprint(HISTORY[:prefix_len]), new_tokens)
    return engine.forward(sid, entry, feed, 1)  # [1, vocab]


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 2, 3], [1, 9, 3]) == 1
    assert common_prefix([], [1]) == 0 and common_prefix(list(range(1000)), list(range(999)) + [5]) == 999


def test_a_forward_failing_part_way_drops_the_cache(engine):
    expected = run(engine, "fresh", 0, HISTORY)
    run(engine, "s", 0, HISTORY[:6])
    layer = engine.model.model.layers[1]
    original = layer.forward

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated: out of memory in layer 1")

    layer.forward = out_of_memory  # layer 0 has already appended its K/V when this raises
    try:
        with pytest.raises(Exception, match="out of device memory"):
            run(engine, "s", 6, HISTORY[6:])
    finally:
        layer.forward = original
    assert "s" not in engine.caches
    with pytest.raises(CacheMiss):
        run(engine, "s", 6, HISTORY[6:])
    # rebuilt from the full history, the result is what an untroubled cache gives
    assert torch.equal(run(engine, "s", 0, HISTORY), expected)


def test_resend_reuses_the_common_prefix_and_prefill_steps_resume(engine):
    run(engine, "r", 0, HISTORY[:7])
    before = engine.tokens_run
    run(engine, "r", 0, HISTORY)  # a resend of the whole history: only the tail runs again
    assert engine.tokens_run - before == len(HISTORY) - 7
    # prefill steps advance one chunk (4 tokens) at a time from whatever is held
    engine.release("p")
    for expected_held in (4, 8, 9, 9):
        held, prefix_hash = engine.prefill_step("p", HISTORY, len(HISTORY) - 1)
        assert held == expected_held and prefix_hash == fingerprint(HISTORY[:held])
