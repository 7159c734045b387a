"""The graph runner's buckets, and its CUDA-graph capture where CUDA is present."""

from __future__ import annotations

import pytest
import torch

from specdec.runtime.graph.batch import BatchShape, RowInput
from specdec.runtime.graph.cuda_graphs import Buckets, CudaGraphRunner, context_blocks
from specdec.runtime.graph.model import GraphModel
from specdec.runtime.graph.paged_kv import PagedKV
from tests.graph_models import hf_model, reference, run, sequence

pytestmark = pytest.mark.unit

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="CUDA graphs need a CUDA device; none here (the CPU runs the same buckets eagerly)")


def test_buckets_cover_decode_verification_and_contexts():
    assert context_blocks(100) == (8, 16, 32, 64, 100)
    assert context_blocks(5) == (5,)
    shapes = Buckets(rows=(1, 4), tokens=(1, 16), blocks=(8, 32), window=16).shapes()
    assert len(shapes) == 8 and shapes[0] == BatchShape(1, 1, 8, 16) and shapes[-1] == BatchShape(4, 16, 32, 16)


def test_default_buckets_reach_the_models_context():
    model = GraphModel.from_hf(hf_model("llama"))  # context 512
    runner = CudaGraphRunner(model, PagedKV(model.pool_spec(16), 1000))
    assert runner.buckets.blocks == (8, 16, 32)  # 512 tokens = 32 blocks of 16
    assert runner.shapes[-1] == BatchShape(64, 16, 32, 16)


def test_no_capture_without_cuda():
    model = GraphModel.from_hf(hf_model("llama"))
    kv = PagedKV(model.pool_spec(4), 16)
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert CudaGraphRunner(model, kv).capture() == 0
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device; the model is on cpu"):
        CudaGraphRunner(model, kv, capture=True)


def cuda_runner(dtype=torch.float32, buckets=None):
    hf = hf_model("qwen2", dtype)
    model = GraphModel.from_hf(hf.to("cuda"))
    runner = CudaGraphRunner(model, PagedKV(model.pool_spec(16), 256),
                             buckets or Buckets(rows=(1, 2, 4), tokens=(1, 4, 16), blocks=(4, 32), window=16))
    return hf, runner


@needs_cuda
def test_captured_graphs_replay_the_eager_logits():
    hf, runner = cuda_runner()
    assert runner.capture() == 3 * 3 * 2
    seqs = [sequence(n, seed=n) for n in (6, 21, 40)]
    for i, seq in enumerate(seqs):
        run(runner, f"s{i}", seq[:-3])
    before = runner.replays
    got = runner.forward([RowInput(f"s{i}", seq[-3:], 3) for i, seq in enumerate(seqs)])
    assert runner.replays == before + 1
    for seq, logits in zip(seqs, got):
        want = reference(hf, seq)[-3:]  # hf is on cuda with the graph model's weights
        assert torch.allclose(logits, want, rtol=1e-3, atol=1e-3)


@needs_cuda
def test_captured_greedy_decoding_equals_hf_generate_for_128_tokens():
    hf, runner = cuda_runner(buckets=Buckets(rows=(1,), tokens=(1, 16), blocks=(16,), window=16))
    runner.capture()
    prompt = sequence(9, seed=3)
    want = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=128,
                       do_sample=False)[0, len(prompt):].tolist()
    tokens, logits = [], run(runner, "s", prompt, keep=1)
    for _ in range(128):
        tokens.append(int(logits[-1].argmax()))
        logits = run(runner, "s", tokens[-1:])
    assert tokens == want
    assert runner.replays >= 128


@needs_cuda
def test_the_captured_draft_loop_replays_the_eager_loop():
    """Greedy and sampled rows in one batch of 3 (a bucket of 4 rows, 4 steps for γ 3): the
    captured loop draws what the same loop draws eagerly, and is replayed."""
    from specdec.runtime.graph.batched_proposal import RowWarps
    from specdec.runtime.graph.draft_loop import DraftLoop
    from specdec.types import SamplingParams

    hf, runner = cuda_runner()
    seqs = [sequence(n, seed=n) for n in (6, 21, 40)]
    for i, seq in enumerate(seqs):
        run(runner, f"s{i}", seq[:-1])
    first = torch.cat(runner.forward([RowInput(f"s{i}", seq[-1:], 1) for i, seq in enumerate(seqs)]))
    warps = RowWarps.of([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=5),
                         SamplingParams(temperature=0.8, top_p=0.9)])
    uniforms = torch.rand((3, 3), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    drawn = []
    for capture in (False, True):
        loop = DraftLoop(runner.model, runner.kv, 8, (1, 4), (1, 4), (4, 32), capture)
        loop.capture()
        lengths = [runner.kv.length(f"s{i}") for i in range(3)]
        slots = [runner.kv.append(f"s{i}", 2) for i in range(3)]
        out = loop.run(first.float(), lengths, slots, [runner.kv.block_table(f"s{i}") for i in range(3)],
                       uniforms, warps)
        drawn.append(out.to_host(3, 3))
        for i, length in enumerate(lengths):
            runner.kv.truncate(f"s{i}", length)
        assert loop.replays == int(capture)
    assert [[step[0] for step in row] for row in drawn[0]] == [[step[0] for step in row] for row in drawn[1]]


def grow_with_tree_loop(runner: CudaGraphRunner, first: torch.Tensor, depths: int) -> list:
    """The tree loop over sessions s0.. (their roots' logits `first` [C, vocab]): its slots
    appended, then dropped -> per tree, depth and slot (valid, pool index, token), on the host."""
    from specdec.maths.tree import TREE_WIDTH
    from specdec.runtime.graph.batched_proposal import RowWarps
    from specdec.runtime.graph.tree_loop import TreeLoopInputs, run_tree_loop
    from specdec.types import SamplingParams

    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=5),
              SamplingParams(temperature=0.8, top_p=0.9)][:first.shape[0]]
    device = first.device
    names = [f"s{i}" for i in range(len(params))]
    bases = [runner.kv.length(name) for name in names]
    slots = [runner.kv.append(name, TREE_WIDTH * (depths - 1)) for name in names]
    tables = [runner.kv.block_table(name) for name in names]
    width = max(len(table) for table in tables)
    inputs = TreeLoopInputs(first.float(), torch.tensor(bases, device=device),
                            torch.tensor(slots, device=device).view(len(names), depths - 1, TREE_WIDTH),
                            torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device),
                            RowWarps.of(params).to(device), params)
    kept = run_tree_loop(runner.forward_on_device, inputs, depths)[..., :3].tolist()
    for name, length in zip(names, bases):
        runner.kv.truncate(name, length)
    return kept


@needs_cuda
def test_the_tree_loop_replays_captured_forwards_and_grows_the_eager_trees():
    """Greedy and sampled trees 4 deep in one batch of 3 (a bucket of 4 rows × 4 tokens, a
    12-node window): the loop's forwards replay captured graphs and grow the trees the same
    forwards grow eagerly."""
    hf, runner = cuda_runner()
    seqs = [sequence(n, seed=n) for n in (6, 21, 40)]
    for i, seq in enumerate(seqs):
        run(runner, f"s{i}", seq[:-1])
    first = torch.cat(runner.forward([RowInput(f"s{i}", seq[-1:], 1) for i, seq in enumerate(seqs)]))
    eager = grow_with_tree_loop(runner, first, 4)
    assert runner.replays == 0
    runner.capture()
    replayed = grow_with_tree_loop(runner, first, 4)
    assert runner.replays == 3  # one forward per depth but the last
    assert replayed == eager
    assert all(depth[0][0] for tree in eager for depth in tree)  # every depth kept a child
