"""Tensor parallelism of the graph model (issue 45): the sharding maps alone, and N = 2 gloo
ranks on the CPU giving the TP 1 logits (float64: to summation-order rounding)."""

from __future__ import annotations

import pytest
import torch

from specdec.runtime.graph.cuda_graphs import CudaGraphRunner
from specdec.runtime.graph.model import GraphModel
from specdec.runtime.graph.paged_kv import PagedKV
from specdec.runtime.graph.parallel import check_tensor_parallel, qkv_rows, shard_layer, shard_plan
from specdec.runtime.graph.shards import decoder_bytes, load_shard
from specdec.tokenizer import ModelLoadError
from tests.graph_models import hf_model
from tests.tp_ranks import forwards, tp_logits

TOL = dict(rtol=1e-9, atol=1e-9)


def test_heads_split_evenly_and_kv_heads_follow_their_queries():
    plans = [shard_plan(8, 4, 64, r, 2) for r in range(2)]
    assert [p.heads for p in plans] == [(0, 4), (4, 8)]
    assert [p.kv_heads for p in plans] == [(0, 2), (2, 4)]
    assert [p.intermediate for p in plans] == [(0, 32), (32, 64)]
    group = 8 // 4  # query head h reads K/V head h // group: every rank holds the ones it reads
    for p in plans:
        assert {h // group for h in range(*p.heads)} == set(range(*p.kv_heads))


def test_fewer_kv_heads_than_ranks_are_replicated():
    plans = [shard_plan(8, 2, 64, r, 4) for r in range(4)]
    assert [p.kv_heads for p in plans] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    for p in plans:
        assert {h // 4 for h in range(*p.heads)} == set(range(*p.kv_heads))


@pytest.mark.parametrize("heads, kv, mlp, n, words", [
    (14, 2, 64, 4, "14 attention heads"), (8, 6, 64, 4, "6 key/value heads"),
    (8, 3, 64, 6, "6 must divide the model's 8"), (8, 3, 64, 4, "multiple of the model's 3"),
    (8, 4, 60, 8, "8 must divide the model's MLP width 60"), (8, 8, 64, 0, ">= 1")])
def test_counts_that_do_not_divide_are_refused_naming_them(heads, kv, mlp, n, words):
    with pytest.raises(ModelLoadError, match=words):
        check_tensor_parallel(heads, kv, mlp, n)


def test_qkv_rows_take_the_rank_s_query_key_and_value_heads():
    plan = shard_plan(4, 2, 8, 1, 2)  # rank 1: query heads 2, 3 and K/V head 1; head_dim 3
    assert qkv_rows(plan, 4, 2, 3) == [(6, 12), (15, 18), (21, 24)]


def mha_model():
    """A tiny float64 Llama whose 4 query heads each have their own K/V head."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                         initializer_range=0.5, tie_word_embeddings=True)
    torch.manual_seed(9)
    return AutoModelForCausalLM.from_config(config).to(torch.float64).eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny float64 checkpoints at N = 2: K/V heads equal to N (2 of 4 heads, qwen2 with biases),
    below it (mistral's 1: replicated) and above it (llama with 4 K/V heads of 4)."""
    out = {}
    for arch in ("qwen2", "mistral", "llama-mha"):
        directory = tmp_path_factory.mktemp(arch)
        model = mha_model() if arch == "llama-mha" else hf_model(arch)
        model.save_pretrained(directory, safe_serialization=True)
        out[arch] = (directory, model)
    return out


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_a_rank_loads_the_shards_of_the_full_model(checkpoints, arch):
    directory, hf = checkpoints[arch]
    full = GraphModel.from_hf(hf)
    for rank in range(2):
        shard = load_shard(directory, torch.float64, "cpu", rank, 2)
        plan = shard_plan(full.arch.heads, full.arch.kv_heads, full.layers[0].gate_up.shape[0] // 2, rank, 2)
        want = shard_layer(full.layers[1], plan, full.arch.heads, full.arch.kv_heads, full.arch.head_dim)
        for name, tensor in vars(want).items():
            got = getattr(shard.layers[1], name)
            assert (got is None) == (tensor is None), name
            if tensor is not None:
                assert torch.equal(got, tensor), name


def test_each_rank_holds_half_the_decoder_bytes(checkpoints):
    directory, hf = checkpoints["qwen2"]
    whole = decoder_bytes(GraphModel.from_hf(hf))
    for rank in range(2):
        assert abs(decoder_bytes(load_shard(directory, torch.float64, "cpu", rank, 2)) / whole - 0.5) <= 0.01


@pytest.fixture(scope="module")
def two_ranks(checkpoints, tmp_path_factory):
    """What ranks 0 and 1 of one gloo group saved, per checkpoint directory."""
    return tp_logits([directory for directory, _ in checkpoints.values()], 2, tmp_path_factory.mktemp("ranks"))


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "llama-mha"])
def test_two_gloo_ranks_give_the_logits_of_one(checkpoints, two_ranks, arch):
    directory, hf = checkpoints[arch]
    graph = GraphModel.from_hf(hf)
    with torch.inference_mode():
        want = forwards(CudaGraphRunner(graph, PagedKV(graph.pool_spec(4), 64), capture=False))
    for by_directory in two_ranks:
        saved = by_directory[str(directory)]
        assert len(saved["logits"]) == len(want)
        for got, expected in zip(saved["logits"], want):
            assert torch.allclose(got, expected, **TOL), f"max difference {(got - expected).abs().max():.3g}"
            assert torch.equal(got.argmax(-1), expected.argmax(-1))
