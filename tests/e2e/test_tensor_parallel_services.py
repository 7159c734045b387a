"""--tensor-parallel-size through the services (issue 45): refused where it cannot run, naming
what to do; at N = 2 (gloo ranks on the CPU started by the target service) greedy output through
the three services equals the HF model alone, chains, trees and concurrent sessions."""

from __future__ import annotations

import concurrent.futures

import pytest
import redis

from specdec.config import TargetConfig
from specdec.runtime.engines import engine_from_config
from specdec.runtime.graph import ranks
from specdec.tokenizer import ModelLoadError
from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster
from tests.e2e.test_e2e_greedy import reference
from tests.service.test_kv_tier import history
from tests.e2e.test_sources import target_only

GRAPH = {"backend": "graph", "kv_cache_bytes": 8 << 20}
PROMPTS = ["def fibonacci(n):", "The quick brown fox"]
NEW_TOKENS = 16
DRAFT = coordinator_pb2.PROPOSER_DRAFT


@pytest.mark.parametrize("backend", ["torch", "llama.cpp"])
def test_the_flag_on_another_engine_names_the_graph_backend(models, backend):
    model = models["llama"]["target"] + ("/missing.gguf" if backend == "llama.cpp" else "")
    with pytest.raises(ModelLoadError, match="--tensor-parallel-size 2 .*--backend graph"):
        engine_from_config(TargetConfig(model=model, backend=backend, tensor_parallel_size=2))


def test_heads_that_do_not_divide_are_refused_before_any_rank_starts(models):
    with pytest.raises(ModelLoadError, match="--tensor-parallel-size 3 must divide the model's 4 attention heads"):
        engine_from_config(TargetConfig(model=models["llama"]["target"], tensor_parallel_size=3, **GRAPH))
    assert not ranks.LEADERS


@pytest.fixture(scope="module")
def tp_redis(redis_url):
    """Redis DB 12 of the suite's server, emptied of K/V chunks."""
    url = redis_url.rsplit("/", 1)[0] + "/12" if redis_url.rsplit("/", 1)[-1].isdigit() else redis_url + "/12"
    client = redis.Redis.from_url(url)
    for key in client.scan_iter("specdec:kv:*"):
        client.delete(key)
    return url


@pytest.fixture(scope="module")
def tp_cluster(models, tp_redis):
    """A graph draft, and the llama target at TP 2 (4 heads, 2 K/V heads: one each) keeping its
    K/V chunks in Redis."""
    target = models["llama"]["target"]
    tp = {**GRAPH, "tensor_parallel_size": 2, "prefix_cache_bytes": 0, "kv_store": tp_redis, "kv_chunk_tokens": 16}
    try:
        with Cluster(models["llama"]["draft"], target, draft=GRAPH, target=tp) as cluster:
            yield cluster
    finally:
        ranks.stop_all()  # the rank processes end with the test, passed or failed


@pytest.fixture(scope="module")
def expected(models):
    return reference(models["llama"]["target"], PROMPTS, NEW_TOKENS)


def test_greedy_chains_and_trees_at_tp_2_equal_the_hf_model(tp_cluster, expected):
    engine = tp_cluster.target_servicer.engine
    assert isinstance(engine.model, ranks.LeaderModel) and engine.model.parallel.size == 2
    assert engine.model.arch.heads == 2 and engine.kv_spec.kv_heads == 1  # rank 0's half
    for gamma, nodes in ((1, 0), (4, 0), (3, 6)):
        for prompt in PROMPTS:
            response = tp_cluster.complete(prompt=prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                           num_speculative_tokens=gamma, tree_nodes=nodes, proposer=DRAFT)
            assert list(response.token_ids) == expected[prompt], (gamma, nodes, prompt)
            assert response.stats.acceptance_rate < 1.0  # an unrelated draft: rejections rolled back


def test_concurrent_sessions_at_tp_2_each_get_their_own_output(tp_cluster, expected):
    jobs = [(prompt, gamma, nodes) for prompt in PROMPTS for gamma, nodes in ((2, 0), (4, 0), (3, 6), (2, 4))]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        done = list(pool.map(lambda job: tp_cluster.complete(
            prompt=job[0], max_new_tokens=NEW_TOKENS, num_speculative_tokens=job[1], tree_nodes=job[2],
            proposer=DRAFT, ignore_eos=True), jobs))
    for job, response in zip(jobs, done):
        assert list(response.token_ids) == expected[job[0]], job


def test_up_passes_the_size_to_the_target_only():
    from specdec.config import TargetConfig, from_sources
    from specdec_cli import up
    from specdec_cli.main import build_parser

    addresses = {"draft": "127.0.0.1:6001", "target": "127.0.0.1:6002"}
    argvs = up.commands(build_parser().parse_args(["up", "--tensor-parallel-size", "2"]), "D", "T", addresses)
    assert "--tensor-parallel-size" not in argvs["draft"]
    target = build_parser().parse_args(argvs["target"][argvs["target"].index("serve"):])
    assert from_sources(TargetConfig, "target", vars(target), env={}).tensor_parallel_size == 2
    plain = up.commands(build_parser().parse_args(["up"]), "D", "T", addresses)["target"]
    assert "--tensor-parallel-size" not in plain


def test_a_prompt_s_k_v_restored_from_redis_at_tp_2_continues_as_the_hf_model(tp_cluster, models):
    engine = tp_cluster.target_servicer.engine
    prompt = history(70, seed=7)
    fields = dict(max_new_tokens=8, ignore_eos=True, proposer=DRAFT, num_speculative_tokens=3)
    first = tp_cluster.complete(token_ids=prompt, **fields)
    assert engine.kv_tier.writer.flush(10)
    again = tp_cluster.complete(token_ids=prompt, **fields)  # a new session: its prompt's chunks are in Redis
    assert again.stats.target_restored_tokens >= 64
    assert list(first.token_ids) == list(again.token_ids) == target_only(models["llama"]["target"], prompt, 8)


def test_a_session_continued_at_tp_2_continues_as_the_hf_model(tp_cluster, models):
    fields = dict(max_new_tokens=8, ignore_eos=True, proposer=DRAFT, num_speculative_tokens=4)
    prompt = history(20, seed=3)
    turn1 = tp_cluster.complete(token_ids=prompt, **fields)
    turn2 = tp_cluster.complete(session_id=turn1.session_id, token_ids=[4, 5, 6], **fields)
    full = prompt + list(turn1.token_ids) + [4, 5, 6]
    assert list(turn2.token_ids) == target_only(models["llama"]["target"], full, 8)
