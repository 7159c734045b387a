"""The graph engine behind the services (--backend graph), on the CPU: the same code as on CUDA,
without capture.

Greedy output through the three services equals the HF model alone, token for token (float64
and float32), for chains and trees, concurrent sessions batched, continuations and resends
after lost caches; sampled output follows the target's distribution (chi-square); a graph draft
beside an HF target and the other way round; the pool's LRU bound and its K/V chunks.

Here the e2e tests; the other tiers' are in tests/unit/test_graph_backend.py.
"""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from specdec.runtime.graph.engine import GraphEngine
from specdec.runtime.loader import load_model
from specdec.types import SamplingParams
from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster
from tests.e2e.test_e2e_greedy import reference
from tests.e2e.test_e2e_sampling import assert_follows, exact_first_two, sampled_first_two
from tests.service.test_kv_tier import history, namespace_db  # noqa: F401 - a fixture
from tests.e2e.test_sources import target_only

GRAPH = {"backend": "graph", "kv_cache_bytes": 8 << 20}
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "Le café est très chaud", "for i in range(10):"]
NEW_TOKENS = 24
DRAFT, NONE = coordinator_pb2.PROPOSER_DRAFT, coordinator_pb2.PROPOSER_NONE
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA graphs are captured on a CUDA device; none here (the CPU runs "
                                       "the same buckets eagerly, which the other tests prove)")


@pytest.fixture(scope="module")
def graph_cluster(models):
    with Cluster(models["llama"]["draft"], models["llama"]["target"], draft=GRAPH, target=GRAPH) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def expected(models):
    return reference(models["llama"]["target"], PROMPTS, NEW_TOKENS)


# ---- through the services --------------------------------------------------------------------------


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
