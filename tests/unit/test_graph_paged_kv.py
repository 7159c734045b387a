"""The paged K/V pool: block tables, free-list reuse, rollback, kept paths, a full pool."""

from __future__ import annotations

import grpc
import pytest
import torch

from specdec.errors import InvalidArgument, NotFound, ResourceExhausted
from specdec.rpc.status import code_for
from specdec.runtime.graph.batch import RowInput
from specdec.runtime.graph.paged_kv import NULL_BLOCK, PagedKV, PoolSpec, blocks_for, budget_bytes
from tests.graph_models import hf_model, reference, run, runner_for, sequence

SPEC = PoolSpec(layers=2, kv_heads=2, head_dim=4, dtype=torch.float64, device=torch.device("cpu"), block_size=4)


def test_blocks_come_from_the_budget():
    assert SPEC.bytes_per_token == 2 * 2 * 2 * 4 * 8
    assert blocks_for(SPEC, 10 * SPEC.bytes_per_block + 5) == 10
    assert budget_bytes(1 << 20, "cpu") == 1 << 20
    with pytest.raises(InvalidArgument, match="needs a CUDA device; on cpu give it in bytes"):
        budget_bytes(0.5, "cpu")
    with pytest.raises(InvalidArgument, match="at least 2 are needed"):
        PagedKV.from_budget(SPEC, SPEC.bytes_per_block)
    pool = PagedKV.from_budget(SPEC, 8 * SPEC.bytes_per_block)
    assert pool.num_blocks == 8 and pool.free_blocks == 7  # block 0 is the null block
    assert pool.pools[0].shape == (2, 8, 4, 2, 4)


def test_sessions_share_the_pool_and_blocks_are_reused():
    pool = PagedKV(SPEC, 9)
    pool.new_session("a")
    pool.new_session("b")
    assert pool.append("a", 6) == [4, 5, 6, 7, 8, 9]  # blocks 1 and 2 (block 0 is the null block)
    pool.append("b", 3)
    pool.append("a", 3)  # a's second block has room for two, then a third block
    assert len(pool.block_table("a")) == 3 and pool.used_blocks == 4
    assert NULL_BLOCK not in pool.block_table("a") + pool.block_table("b")
    freed = pool.block_table("a")
    assert pool.drop("a") and not pool.drop("a")
    assert pool.used_blocks == 1
    pool.new_session("c")
    pool.append("c", 12)
    assert sorted(pool.block_table("c")) == sorted(freed)  # the freed blocks, reused
    with pytest.raises(NotFound, match="no K/V for session 'a'"):
        pool.length("a")


def test_truncate_frees_whole_blocks_past_the_length():
    pool = PagedKV(SPEC, 9)
    pool.new_session("a")
    pool.append("a", 10)  # 3 blocks
    pool.truncate("a", 5)  # 2 blocks still needed
    assert pool.length("a") == 5 and len(pool.block_table("a")) == 2 and pool.free_blocks == 6
    pool.truncate("a", 8)  # past the length: nothing
    assert pool.length("a") == 5
    pool.truncate("a", 0)
    assert pool.block_table("a") == [] and pool.free_blocks == 8


def test_a_full_pool_is_resource_exhausted_and_changes_nothing():
    pool = PagedKV(SPEC, 4)  # 3 usable blocks: 12 tokens
    pool.new_session("a")
    pool.new_session("b")
    pool.append("a", 7)
    with pytest.raises(ResourceExhausted, match="pool is full: 6 more tokens need 2 blocks .* 1 of 3 are free") as err:
        pool.append("b", 6)
    assert code_for(err.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert pool.length("b") == 0 and pool.free_blocks == 1
    pool.append("b", 4)
    assert pool.free_blocks == 0


def test_a_full_pool_in_a_forward_appends_to_no_row():
    runner = runner_for(hf_model("llama"), block_size=4, blocks=5)  # 16 tokens
    run(runner, "a", sequence(6, 1))
    runner.kv.new_session("b")
    with pytest.raises(ResourceExhausted, match="pool is full"):
        runner.forward([RowInput("a", [1, 2]), RowInput("b", sequence(9, 2))])
    assert runner.kv.length("a") == 6 and runner.kv.length("b") == 0


def test_keep_path_moves_the_nodes_rows():
    pool = PagedKV(SPEC, 9)
    pool.new_session("a")
    slots = pool.append("a", 11)
    for layer in pool.pools:
        flat = layer.view(2, -1, 2, 4)
        flat[:, slots] = torch.arange(11, dtype=torch.float64)[None, :, None, None].expand(2, 11, 2, 4)
    pool.keep_path("a", 5, [1, 3, 4])  # nodes at 6, 8, 9 move to 5, 6, 7
    assert pool.length("a") == 8 and len(pool.block_table("a")) == 2
    kept = pool.read("a", 0, 8)  # [layers, 2, kv_heads, n, dim]
    assert kept.shape == (2, 2, 2, 8, 4)
    assert torch.equal(kept, torch.tensor([0., 1, 2, 3, 4, 6, 8, 9], dtype=torch.float64)[:, None].expand_as(kept))
    with pytest.raises(InvalidArgument, match="not ascending nodes"):
        pool.keep_path("a", 5, [2, 1])


def test_chunks_read_and_extend_round_trip():
    model = hf_model("qwen2")
    runner = runner_for(model)
    seq = sequence(14, 3)
    run(runner, "a", seq[:10])
    chunk = runner.kv.read("a", 0, 10)  # [layers, 2, kv_heads, 10, dim]
    runner.kv.new_session("b")
    runner.kv.extend("b", chunk)
    assert torch.equal(runner.kv.read("b", 0, 10), chunk)
    got = run(runner, "b", seq[10:])
    assert torch.allclose(got, reference(model, seq)[10:], rtol=1e-9, atol=1e-9)


def test_rows_a_forward_cannot_take_are_named():
    from specdec.maths.tree import TokenTree

    runner = runner_for(hf_model("llama"))
    run(runner, "a", [1, 2])
    cases = [([RowInput("a", [3]), RowInput("a", [4])], "distinct sessions"),
             ([RowInput("a", [])], "row of session 'a' has no tokens"),
             ([RowInput("a", [3], keep_logits=2)], "keep_logits 2 is outside 1..1"),
             ([RowInput("a", [3], tree=TokenTree((3, 4, 5), (0, 1, 2)))], "needs a root before it"),
             ([RowInput("z", [3])], "no K/V for session 'z'")]
    for rows, message in cases:
        with pytest.raises((InvalidArgument, NotFound), match=message):
            runner.forward(rows)
    assert runner.kv.length("a") == 2
