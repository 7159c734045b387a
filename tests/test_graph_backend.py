"""The graph engine behind the services (--backend graph), on the CPU: the same code as on CUDA,
without capture.

Greedy output through the three services equals the HF model alone, token for token (float64
and float32), for chains and trees, concurrent sessions batched, continuations and resends
after lost caches; sampled output follows the target's distribution (chi-square); a graph draft
beside an HF target and the other way round; the pool's LRU bound and its K/V chunks.
"""

from __future__ import annotations

import concurrent.futures
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
from specdec.types import Backend, SamplingParams
from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster
from tests.test_e2e_greedy import reference
from tests.test_e2e_sampling import assert_follows, exact_first_two, sampled_first_two
from tests.test_kv_tier import history, namespace_db  # noqa: F401 - a fixture
from tests.test_sources import target_only

GRAPH = {"backend": "graph", "kv_cache_bytes": 8 << 20}
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "Le café est très chaud", "for i in range(10):"]
NEW_TOKENS = 24
DRAFT, NONE = coordinator_pb2.PROPOSER_DRAFT, coordinator_pb2.PROPOSER_NONE
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA graphs are captured on a CUDA device; none here (the CPU runs "
                                       "the same buckets eagerly, which the other tests prove)")


def graph_engine(model: str, dtype: str = "float64", **fields) -> GraphEngine:
    engine = engine_from_config(TargetConfig(model=model, dtype=dtype, **{**GRAPH, **fields}))
    assert isinstance(engine, GraphEngine)
    return engine


@pytest.fixture(scope="module")
def graph_cluster(models):
    with Cluster(models["llama"]["draft"], models["llama"]["target"], draft=GRAPH, target=GRAPH) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def expected(models):
    return reference(models["llama"]["target"], PROMPTS, NEW_TOKENS)


# ---- the engine choice ---------------------------------------------------------------------------


@pytest.mark.unit
def test_auto_picks_graph_on_cuda_for_the_architectures_it_covers(models):
    llama, gpt2 = models["llama"]["target"], models["gpt2"]["target"]
    assert resolve_backend("auto", llama, device="cuda") == Backend.GRAPH
    assert resolve_backend("auto", llama, device="cuda:1") == Backend.GRAPH
    assert resolve_backend("auto", gpt2, device="cuda") == Backend.TORCH  # not covered: the HF engine
    assert resolve_backend("auto", llama) == Backend.TORCH  # on a CPU, today's choice
    assert resolve_backend("auto", "m.gguf", llama_cpp_available=True, device="cuda") == Backend.LLAMA_CPP
    assert resolve_backend("auto", llama, device="cuda", quantize="int8") == Backend.TORCH  # plain weights only
    assert resolve_backend("graph", llama) == Backend.GRAPH


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
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


# ---- through the services --------------------------------------------------------------------------


@pytest.mark.e2e
def test_greedy_chains_through_graph_services_equal_the_hf_model(graph_cluster, expected):
    assert graph_cluster.coordinator.round_loop.target_info.verifies_trees
    for engine in (graph_cluster.draft_servicer.engine, graph_cluster.target_servicer.engine):
        assert isinstance(engine, GraphEngine)
    for gamma in (0, 1, 3, 5):
        for prompt in PROMPTS:
            response = graph_cluster.complete(prompt=prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                              num_speculative_tokens=gamma, proposer=DRAFT if gamma else NONE)
            assert list(response.token_ids) == expected[prompt], (gamma, prompt)
            assert (response.stats.draft_tokens > 0) == (gamma > 0)
            if gamma:
                assert response.stats.acceptance_rate < 1.0  # an unrelated draft: rejections rolled back


@pytest.mark.e2e
def test_greedy_trees_grown_and_verified_on_the_graph_engine(graph_cluster, expected):
    drafting = graph_cluster.draft_servicer.drafting
    loops = drafting.tree_loops
    decided = dict(graph_cluster.target_servicer.verification.decided)
    for gamma, nodes in ((2, 4), (3, 6), (4, 8)):
        for prompt in PROMPTS[:2]:
            response = graph_cluster.complete(prompt=prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                              num_speculative_tokens=gamma, tree_nodes=nodes, proposer=DRAFT)
            assert list(response.token_ids) == expected[prompt], (gamma, nodes, prompt)
            assert response.stats.tree_rounds > 0
    assert drafting.tree_loops > loops  # grown by the device loop (graph/tree_loop.py)
    # every tree was decided on the device (batched_tree_acceptance.py), not by the host walk
    assert graph_cluster.target_servicer.verification.decided["trees"] > decided["trees"]


@pytest.mark.e2e
def test_concurrent_sessions_batched_each_get_their_own_output(graph_cluster, expected):
    jobs = [(prompt, gamma, nodes) for prompt in PROMPTS for gamma, nodes in ((2, 0), (4, 0), (3, 6), (2, 4))]
    loops = graph_cluster.draft_servicer.drafting.tree_loops
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        done = list(pool.map(lambda job: graph_cluster.complete(
            prompt=job[0], max_new_tokens=NEW_TOKENS, num_speculative_tokens=job[1], tree_nodes=job[2],
            proposer=DRAFT, ignore_eos=True), jobs))
    for job, response in zip(jobs, done):
        assert list(response.token_ids) == expected[job[0]], job
    target = graph_cluster.target_servicer.engine
    assert target.graph.eager_runs > 0 and target.tokens_run > 0
    assert graph_cluster.draft_servicer.drafting.tree_loops > loops  # trees grown by the device loop


@pytest.mark.e2e
def test_a_continued_session_and_a_resend_after_lost_caches(models, expected):
    prompt = PROMPTS[1]
    with Cluster(models["llama"]["draft"], models["llama"]["target"], draft=GRAPH, target=GRAPH) as cluster:
        first = cluster.complete(prompt=prompt, max_new_tokens=8, num_speculative_tokens=3, ignore_eos=True)
        more = cluster.complete(session_id=first.session_id, max_new_tokens=8, num_speculative_tokens=3,
                                ignore_eos=True)
        assert more.stats.cache_misses == 0  # the caches held the session
        cluster.restart_target()  # every target and draft cache is gone: the services miss, the coordinator resends
        cluster.restart_draft()
        rest = cluster.complete(session_id=first.session_id, max_new_tokens=NEW_TOKENS - 16,
                                num_speculative_tokens=3, ignore_eos=True)
        assert rest.stats.cache_misses > 0
        assert list(first.token_ids) + list(more.token_ids) + list(rest.token_ids) == expected[prompt]


@pytest.mark.e2e
def test_a_session_moved_to_fresh_graph_replicas_restores_its_chunks_from_redis(models, namespace_db):  # noqa: F811
    paths = models["llama"]
    services = {**GRAPH, "kv_store": namespace_db, "kv_chunk_tokens": 16, "prefix_cache_bytes": 0}
    fields = dict(max_new_tokens=16, ignore_eos=True, proposer=DRAFT, num_speculative_tokens=3)
    prompt = history(70, seed=5)
    with Cluster(paths["draft"], paths["target"], draft=services, target=services,
                 coordinator={"session_store": namespace_db}) as first:
        turn1 = first.complete(token_ids=prompt, **fields)
        for engine in (first.target_servicer.engine, first.draft_servicer.engine):
            assert engine.kv_tier.writer.flush(10)
    with Cluster(paths["draft"], paths["target"], draft=services, target=services,
                 coordinator={"session_store": namespace_db}) as fresh:
        turn2 = fresh.complete(session_id=turn1.session_id, token_ids=[4, 5, 6], **fields)
        assert turn2.stats.target_restored_tokens >= 64 and turn2.stats.draft_restored_tokens >= 48
    full = prompt + list(turn1.token_ids) + [4, 5, 6]
    assert list(turn2.token_ids) == target_only(paths["target"], full, 16)


@pytest.mark.e2e
def test_float32_greedy_equals_the_hf_model_in_float32(models):
    target = models["llama"]["target"]
    hf = load_model(target, "float32")
    hf.model.generation_config.eos_token_id = None
    with Cluster(models["llama"]["draft"], target, dtype="float32", draft=GRAPH, target=GRAPH) as cluster:
        for prompt in PROMPTS[:2]:
            ids = torch.tensor([hf.tokenizer(prompt)["input_ids"]])
            want = hf.model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                     pad_token_id=0)[0, ids.shape[1]:].tolist()
            for gamma in (0, 4):
                response = cluster.complete(prompt=prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                            num_speculative_tokens=gamma, proposer=DRAFT if gamma else NONE)
                assert list(response.token_ids) == want, (prompt, gamma)


@pytest.mark.e2e
@pytest.mark.parametrize("params, nodes", [(SamplingParams(temperature=0.7), 0),
                                           (SamplingParams(temperature=1.5, top_k=6), 0),
                                           (SamplingParams(temperature=0.9), 4)], ids=["t0.7", "t1.5-topk6", "tree"])
def test_sampled_tokens_follow_the_graph_target(small_vocab_models, params, nodes):
    p1, p2 = exact_first_two(small_vocab_models["target"], params)
    with Cluster(small_vocab_models["draft"], small_vocab_models["target"], draft=GRAPH, target=GRAPH) as cluster:
        counts1, counts2, accepted = sampled_first_two(cluster, params, 600, proposer=DRAFT, tree_nodes=nodes)
        assert cluster.target_servicer.verification.decided["trees" if nodes else "chains"] > 0  # on the device
    assert 0 < accepted < 2 * 600  # a different draft: some drafts accepted, some rejected
    assert_follows((counts1, p1), (counts2, p2))


@pytest.mark.e2e
@pytest.mark.parametrize("draft, target", [(GRAPH, None), (None, GRAPH)], ids=["graph-draft", "graph-target"])
def test_a_graph_engine_beside_the_hf_engine(models, expected, draft, target):
    with Cluster(models["llama"]["draft"], models["llama"]["target"], draft=draft, target=target) as cluster:
        for prompt in PROMPTS[:2]:
            for gamma, nodes in ((3, 0), (3, 6)):
                response = cluster.complete(prompt=prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                            num_speculative_tokens=gamma, tree_nodes=nodes, proposer=DRAFT)
                assert list(response.token_ids) == expected[prompt], (prompt, gamma, nodes)
                assert response.stats.draft_tokens > 0


# ---- CUDA: graphs captured at start ----------------------------------------------------------------


@pytest.mark.e2e
@needs_cuda
def test_cuda_services_capture_their_graphs_before_serving_and_stay_exact(models):
    cuda = {**GRAPH, "device": "cuda", "max_batch_size": 4}
    target = models["llama"]["target"]
    want = reference(target, PROMPTS[:2], NEW_TOKENS)
    with Cluster(models["llama"]["draft"], target, dtype="float32", draft=cuda, target=cuda) as cluster:
        engine = cluster.target_servicer.engine
        assert engine.graph.graphs  # captured at start
        for prompt in PROMPTS[:2]:
            for gamma in (0, 3):
                response = cluster.complete(prompt=prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                            num_speculative_tokens=gamma, proposer=DRAFT if gamma else NONE)
                assert list(response.token_ids) == want[prompt], (prompt, gamma)
        assert engine.graph.replays > 0

