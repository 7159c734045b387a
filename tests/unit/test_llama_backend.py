"""The llama.cpp engine under the torch engine's exactness tests.

Here the unit tests; the other tiers' are in tests/service/test_llama_backend.py and
tests/e2e/test_llama_backend.py. The tier split shares one description: see tests/e2e/test_llama_backend.py.
"""

from __future__ import annotations

import pytest
import torch

from specdec.runtime.engines import resolve_backend
from specdec.runtime.llama_cpp.engine import LlamaOptions, LlamaCppEngine
from specdec.runtime.session_kv import Row
from specdec.tokenizer import ModelLoadError
from specdec.types import Backend
from tests.e2e.test_llama_backend import PROMPTS, gguf_pair, llama_engine, _ids, _fresh
# llama.cpp's float32 kernels differ with the batch shape: logits agree to about 1e-4 of their range
TOLERANCE = 1e-3


def test_backend_choice():
    assert resolve_backend("auto", "m.gguf", llama_cpp_available=True) == Backend.LLAMA_CPP
    assert resolve_backend("auto", "m.gguf", llama_cpp_available=False) == Backend.TORCH
    assert resolve_backend("auto", "some/dir", llama_cpp_available=True) == Backend.TORCH
    assert resolve_backend("torch", "m.gguf") == Backend.TORCH
    with pytest.raises(ModelLoadError, match="serves a .gguf file"):
        resolve_backend("llama.cpp", "some/dir")
    with pytest.raises(ModelLoadError, match="unknown backend"):
        resolve_backend("onnx", "m.gguf")


def test_batched_sequences_and_rollback_agree_with_one_session(llama_engine):
    ids = _ids(llama_engine, " ".join(PROMPTS))
    assert len(ids) >= 10
    alone = llama_engine.forward("a", _fresh(llama_engine, "a"), ids, len(ids))  # [n, vocab]
    assert alone.shape == (len(ids), llama_engine.vocab_size) and alone.dtype == torch.float32
    # token by token (what target-only decoding runs) against the one forward (what verification runs)
    entry = _fresh(llama_engine, "b")
    stepped = torch.cat([llama_engine.forward("b", entry, [t], 1) for t in ids])
    assert torch.allclose(stepped, alone, atol=TOLERANCE * float(alone.abs().max()))
    # two sessions of different lengths in one decode
    first, second = _fresh(llama_engine, "c"), _fresh(llama_engine, "d")
    together = llama_engine.forward_batch([Row("c", first, ids, len(ids)), Row("d", second, ids[:5], 2)])
    assert torch.allclose(together[0], alone, atol=TOLERANCE * float(alone.abs().max()))
    assert torch.allclose(together[1], alone[3:5], atol=TOLERANCE * float(alone.abs().max()))
    # rollback: drop the last positions, run other tokens, then the original ones again
    assert first.crop(4) and len(first) == 4
    other = llama_engine.forward("c", first, [7, 8, 9], 3)
    assert not torch.allclose(other, alone[4:7])
    assert first.crop(4)
    again = llama_engine.forward("c", first, ids[4:], len(ids) - 4)
    assert torch.allclose(again, alone[4:], atol=TOLERANCE * float(alone.abs().max()))
    assert llama_engine.tokens_run > 0 and len(llama_engine.caches) == 4


#        root                n0 the chain, n1 an alternative under the root; n3 beside n2
#       /    \
#     n0      n1
#     /  \     |
#   n2   n3   n4
#    |
#   n5
TREE_PARENTS = (0, 0, 1, 1, 2, 3)


def test_a_tree_forward_scores_each_node_as_its_path_alone(llama_engine):
    """One decode of a tree beside a chain: each node's logits are those of its own path run
    alone (sequence sets mask it to the history and its ancestors); keep_path leaves the session
    holding exactly the history and the accepted path, and frees the spare sequences."""
    from specdec.maths.tree import TokenTree

    history = _ids(llama_engine, PROMPTS[0])
    nodes = (11, 12, 13, 14, 15, 16)
    tree = TokenTree(nodes, TREE_PARENTS)
    free = len(llama_engine.free)
    entry, beside = _fresh(llama_engine, "tree"), _fresh(llama_engine, "chain")
    llama_engine.forward("tree", entry, history[:-2], 1)  # part of the history in the cache already
    out = llama_engine.forward_batch([Row("tree", entry, history[-2:] + list(nodes), 1 + len(tree), tree),
                                Row("chain", beside, history, 3)])
    assert len(llama_engine.free) == free - 2 - 3  # two sessions, three leaves (n4, n5 and n3)
    scale = TOLERANCE * float(out[0].abs().max())
    for node in range(len(tree)):
        path = [nodes[i] for i in tree.path(node)]
        alone = llama_engine.forward("alone", _fresh(llama_engine, "alone"), history + path, 1)
        assert torch.allclose(out[0][1 + node], alone[0], atol=scale), node
    root = llama_engine.forward("alone", _fresh(llama_engine, "alone"), history, 1)
    assert torch.allclose(out[0][0], root[0], atol=scale)
    # keep n1 -> n4: the session then continues as if history + n1 n4 had been fed
    llama_engine.keep_path(entry, len(history), [1, 4])
    assert list(entry.tokens) == history + [12, 15] and entry.kv.length == len(history) + 2
    assert len(llama_engine.free) == free - 3  # the leaves' sequences are free again ("alone" holds one)
    after = llama_engine.forward("tree", entry, [17], 1)
    fresh = llama_engine.forward("alone", _fresh(llama_engine, "alone"), history + [12, 15, 17], 1)
    assert torch.allclose(after, fresh, atol=scale)
    # a path of nothing: the history only
    entry2 = _fresh(llama_engine, "tree2")
    llama_engine.forward_batch([Row("tree2", entry2, history + list(nodes), 1 + len(tree), tree)])
    llama_engine.keep_path(entry2, len(history), [])
    assert list(entry2.tokens) == history and entry2.kv.length == len(history)
    assert torch.allclose(llama_engine.forward("tree2", entry2, [17], 1),
                          llama_engine.forward("alone", _fresh(llama_engine, "alone"), history + [17], 1), atol=scale)


def test_released_and_evicted_sequences_are_reused(gguf_pair):
    engine = LlamaCppEngine(gguf_pair["target"], 3, 1 << 30, 16, 512,
                            LlamaOptions(kv_cache_type="f32", kv_cache_tokens=256))
    try:
        free = len(engine.free)
        ids = list(range(1, 41))
        for name in "abcd":  # four sessions, at most three kept
            entry, feed = engine.begin(name, 0, 0, ids)
            engine.forward(name, entry, feed, 1)
            engine.finish(name)
        assert "a" not in engine.caches and len(engine.caches) == 3
        assert len(engine.free) == free - 3  # the evicted one's sequence is free again
        assert engine.release("b")
        engine.finish(())
        assert len(engine.free) == free - 2
        # 256 cells: a 230-token session evicts the two others (40 tokens each) rather than overflow
        entry, feed = engine.begin("big", 0, 0, list(range(1, 231)))
        engine.forward("big", entry, feed, 1)
        engine.finish("big")
        assert list(engine.caches._entries) == ["big"]
        assert engine.caches.total_bytes() == 230 * engine.bytes_per_token
    finally:
        engine.close()
