"""The graph engine behind the services (--backend graph), on the CPU: the same code as on CUDA,
without capture.

Here the unit tests; the other tiers' are in tests/e2e/test_graph_backend.py. The tier split shares one description: see tests/e2e/test_graph_backend.py.
"""

from __future__ import annotations

import threading

import pytest
import torch

from specdec.config import DraftConfig, TargetConfig
from specdec.errors import ResourceExhausted
from specdec.runtime.engines import resolve_backend, engine_from_config
from specdec.runtime.graph.engine import GraphEngine
from specdec.runtime.loader import load_model
from specdec.runtime.session_kv import Row
from specdec.tokenizer import ModelLoadError
from specdec.maths.tree import TokenTree
from specdec.types import Backend
from tests.service.test_kv_tier import history
from tests.e2e.test_graph_backend import GRAPH


def graph_engine(model: str, dtype: str = "float64", **fields) -> GraphEngine:
    engine = engine_from_config(TargetConfig(model=model, dtype=dtype, **{**GRAPH, **fields}))
    assert isinstance(engine, GraphEngine)
    return engine


# ---- the engine choice ---------------------------------------------------------------------------


def test_auto_picks_graph_on_cuda_for_the_architectures_it_covers(models):
    llama, gpt2 = models["llama"]["target"], models["gpt2"]["target"]
    assert resolve_backend("auto", llama, device="cuda") == Backend.GRAPH
    assert resolve_backend("auto", llama, device="cuda:1") == Backend.GRAPH
    assert resolve_backend("auto", gpt2, device="cuda") == Backend.TORCH  # not covered: the HF engine
    assert resolve_backend("auto", llama) == Backend.TORCH  # on a CPU, today's choice
    assert resolve_backend("auto", "m.gguf", llama_cpp_available=True, device="cuda") == Backend.LLAMA_CPP
    assert resolve_backend("auto", llama, device="cuda", quantize="int8") == Backend.TORCH  # plain weights only
    assert resolve_backend("graph", llama) == Backend.GRAPH


def test_what_the_graph_engine_does_not_take_is_refused_by_name(models):
    with pytest.raises(ModelLoadError, match="covers llama, qwen2, mistral models, not 'gpt2'"):
        graph_engine(models["gpt2"]["target"])
    with pytest.raises(ModelLoadError, match="--backend graph runs plain weights, not --quantize int8"):
        engine_from_config(DraftConfig(model=models["llama"]["draft"], dtype="float32", quantize="int8", **GRAPH))
    draft = engine_from_config(DraftConfig(model=models["llama"]["draft"], dtype="float32", **GRAPH))
    assert isinstance(draft, GraphEngine)  # --quantize auto: plain weights on this engine
    # a pool sized as a fraction of free memory: the graph engine on CUDA only, a fraction in (0, 1]
    for fraction, backend, message in ((0.5, "graph", "graph backend's pool on a CUDA device; this service runs "
                                        "--backend graph on cpu: give --kv-cache-bytes instead"),
                                       (0.5, "torch", "this service runs --backend torch on cpu"),
                                       (1.5, "graph", r"must be in \(0, 1\] \(0 = off\), got 1.5")):
        with pytest.raises(ModelLoadError, match=message):
            engine_from_config(DraftConfig(model=models["llama"]["draft"], backend=backend,
                                           kv_cache_memory_fraction=fraction))


# ---- the engine: rollback, trees, the pool's bound ------------------------------------------------


def test_rollback_and_a_kept_tree_path_continue_as_the_hf_model(models):
    engine = graph_engine(models["llama"]["target"])
    hf = load_model(models["llama"]["target"], "float64").model
    want = lambda ids: hf(torch.tensor([ids])).logits[0, -1].float()  # noqa: E731
    history = list(range(40, 61))
    entry, feed = engine.begin("s", 0, 0, history)
    engine.forward("s", entry, feed, 1)
    assert entry.crop(12) and len(entry) == 12  # rollback: a length edit
    assert torch.allclose(engine.forward("s", entry, history[12:], 1)[-1], want(history), atol=1e-6)
    tree = TokenTree((70, 71, 72, 73), (0, 0, 1, 2))  # two children of the root, one below each
    out = engine.forward_batch([Row("s", entry, [74, *tree.tokens], 1 + len(tree), tree)])[0]
    for node in range(len(tree)):
        path = [tree.tokens[i] for i in tree.path(node)]
        assert torch.allclose(out[1 + node], want(history + [74] + path), atol=1e-6), node
    engine.keep_path(entry, len(history) + 1, [1, 3])
    assert list(entry.tokens) == history + [74, 71, 73]
    assert torch.allclose(engine.forward("s", entry, [75], 1)[-1], want(history + [74, 71, 73, 75]), atol=1e-6)
    held, fingerprint = engine.prefill_step("s", list(entry.tokens) + [1], len(entry))
    assert held == len(entry) and engine.held_prefix("s", held, fingerprint).tolist() == list(entry.tokens)


def test_a_full_pool_evicts_least_recently_used_sessions_before_refusing(models):
    block = graph_engine(models["llama"]["target"]).kv_spec.bytes_per_block
    engine = GraphEngine(load_model(models["llama"]["target"], "float64"), 8, 10 * block, 16,
                         block_size=16)  # 10 blocks, the null block and 9 for sessions
    assert engine.kv.capacity_tokens == 9 * 16
    for name in "abc":  # 3 blocks each: the pool is full
        entry, feed = engine.begin(name, 0, 0, list(range(1, 41)))
        engine.forward(name, entry, feed, 1)
        engine.finish(name)
    assert engine.kv.free_blocks == 0
    entry, feed = engine.begin("d", 0, 0, list(range(1, 41)))
    engine.forward("d", entry, feed, 1)  # "a", least recently used, makes room
    assert "a" not in engine.caches and {"b", "c", "d"} <= set(engine.caches._entries)
    engine.finish("d")
    assert engine.caches.total_bytes() == 9 * engine.kv_spec.bytes_per_block
    entry, feed = engine.begin("big", 0, 0, list(range(1, 130)))
    engine.forward("big", entry, feed, 1)  # 9 blocks: every other session goes
    assert list(engine.caches._entries) == ["big"]
    entry.crop(0)
    with pytest.raises(ResourceExhausted, match="the paged K/V pool is full"):
        engine.forward("big", entry, list(range(1, 150)), 1)  # more than the whole pool
    assert len(entry) == 0 and engine.kv.length(entry.kv.pool_id) == 0  # nothing appended


def test_a_session_released_from_another_thread_is_freed_on_the_model_thread(models):
    engine = graph_engine(models["llama"]["target"])
    entry, feed = engine.begin("s", 0, 0, list(range(1, 40)))
    engine.forward("s", entry, feed, 1)
    used = engine.kv.used_blocks
    thread = threading.Thread(target=engine.release, args=("s",))
    thread.start()
    thread.join()
    assert engine.kv.used_blocks == used and "s" not in engine.caches  # marked only
    engine.finish(())
    assert engine.kv.used_blocks == 0


def test_kv_chunks_restore_a_prompt_instead_of_prefilling_it(models):
    engine = graph_engine(models["llama"]["target"], kv_chunk_tokens=16, kv_store="memory://")
    prompt = list(range(3, 60))
    entry, feed = engine.begin("a", 0, 0, prompt)
    first = engine.forward("a", entry, feed, 1)
    engine.keep_committed(entry, len(prompt))
    engine.finish("a")
    assert engine.kv_tier.counters.kept_chunks == 3
    entry, feed = engine.begin("b", 0, 0, prompt)  # another session, the same prompt
    assert len(entry) == 48 and engine.take_restored("b") == 48 and len(feed) == len(prompt) - 48
    assert torch.allclose(engine.forward("b", entry, feed, 1), first, atol=1e-9)
