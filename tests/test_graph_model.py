"""The graph engine's model over the paged pool gives the HF model's logits (float64: to rounding)."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import InvalidArgument
from specdec.runtime.graph.batch import BatchShape, RowInput
from specdec.runtime.graph.cuda_graphs import Buckets, CudaGraphRunner
from specdec.runtime.graph.model import GraphModel
from specdec.runtime.graph.paged_kv import PagedKV
from specdec.tokenizer import ModelLoadError
from specdec.maths.tree import TokenTree
from tests.graph_models import ARCHS, hf_model, reference, run, runner_for, sequence

pytestmark = pytest.mark.unit

TOL = dict(rtol=1e-9, atol=1e-9)  # float64: differences are summation-order rounding only


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return hf_model(request.param)


def close(got: torch.Tensor, want: torch.Tensor, **tol) -> None:
    tol = tol or TOL
    assert got.shape == want.shape
    assert torch.allclose(got, want, **tol), f"max difference {(got - want).abs().max().item():.3g}"


def test_prefill_and_decode_steps(model):
    runner = runner_for(model)
    seq = sequence(30, seed=1)
    want = reference(model, seq)
    close(run(runner, "s", seq[:21]), want[:21])
    for i in range(21, 30):  # decode steps, crossing block boundaries
        close(run(runner, "s", [seq[i]]), want[i:i + 1])
    assert runner.kv.length("s") == 30


def test_sessions_of_different_lengths_in_one_batch(model):
    runner = runner_for(model)
    seqs = [sequence(n, seed=n) for n in (3, 17, 40)]
    news = (1, 5, 2)  # a decode step, a chain verification of γ+1 = 5 tokens, two tokens
    for i, (seq, new) in enumerate(zip(seqs, news)):
        run(runner, f"s{i}", seq[:len(seq) - new])
    rows = [RowInput(f"s{i}", seq[len(seq) - new:], new) for i, (seq, new) in enumerate(zip(seqs, news))]
    for seq, new, got in zip(seqs, news, runner.forward(rows)):
        close(got, reference(model, seq)[len(seq) - new:])


def test_keep_logits_gives_the_last_positions(model):
    runner = runner_for(model)
    seq = sequence(12, seed=3)
    close(run(runner, "s", seq, keep=3), reference(model, seq)[-3:])


def tree_and_paths():
    """A tree of 6 nodes: a, b under the root; c, d under a; e under c; f under b."""
    tree = TokenTree(tokens=(11, 12, 13, 14, 15, 16), parents=(0, 0, 1, 1, 3, 2))
    return tree, [tree.path(i) for i in range(len(tree))]


def test_tree_nodes_see_only_their_ancestors(model):
    runner = runner_for(model)
    history = sequence(9, seed=4)
    tree, paths = tree_and_paths()
    run(runner, "s", history[:-1])
    got = runner.forward([RowInput("s", [history[-1], *tree.tokens], len(tree) + 1, tree)])[0]
    close(got[0], reference(model, history)[-1])  # the root's row
    for node, path in enumerate(paths):
        close(got[node + 1], reference(model, history + [tree.tokens[k] for k in path])[-1])


def test_a_tree_grown_depth_by_depth(model):
    """The draft's way: the first depth in one forward, the next one with the first cached."""
    runner = runner_for(model)
    history = sequence(10, seed=5)
    run(runner, "s", history)
    first = TokenTree(tokens=(21, 22), parents=(0, 0))
    runner.forward([RowInput("s", list(first.tokens), 2, first)])
    grown = TokenTree(tokens=(21, 22, 23, 24, 25), parents=(0, 0, 1, 1, 2))
    got = runner.forward([RowInput("s", [23, 24, 25], 3, grown)])[0]
    for row, node in enumerate((2, 3, 4)):
        path = [grown.tokens[k] for k in grown.path(node)]
        close(got[row], reference(model, history + path)[-1])


def test_rollback_then_continue(model):
    runner = runner_for(model)
    seq = sequence(26, seed=6)
    run(runner, "s", seq[:14])
    run(runner, "s", sequence(9, seed=60))  # drafts that are rejected
    runner.kv.truncate("s", 14)
    close(run(runner, "s", seq[14:]), reference(model, seq)[14:])


def test_keep_path_then_continue(model):
    runner = runner_for(model)
    history = sequence(13, seed=7)
    tree, _ = tree_and_paths()
    run(runner, "s", history[:-1])
    runner.forward([RowInput("s", [history[-1], *tree.tokens], 1, tree)])
    path = tree.path(4)  # a, c, e: nodes 0, 2, 4
    runner.kv.keep_path("s", len(history), path)
    kept = history + [tree.tokens[k] for k in path]
    assert runner.kv.length("s") == len(kept)
    following = sequence(3, seed=70)
    close(run(runner, "s", following), reference(model, kept + following)[len(kept):])


def test_greedy_decoding_equals_hf_generate(model):
    runner = runner_for(model, buckets=Buckets(rows=(1, 2), tokens=(1, 4, 16), window=4))
    prompt = sequence(7, seed=8)
    want = model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)[0, len(prompt):].tolist()
    tokens, logits = [], run(runner, "s", prompt, keep=1)
    for _ in range(30):
        tokens.append(int(logits[-1].argmax()))
        logits = run(runner, "s", tokens[-1:])
    assert tokens == want
    assert runner.eager_runs == 31 and runner.replays == 0  # CPU: the same buckets, run eagerly


def test_float32_within_its_rounding():
    model = hf_model("qwen2", torch.float32)
    runner = runner_for(model)
    seqs = [sequence(n, seed=n) for n in (5, 19)]
    for i, seq in enumerate(seqs):
        run(runner, f"s{i}", seq[:-2])
    got = runner.forward([RowInput(f"s{i}", seq[-2:], 2) for i, seq in enumerate(seqs)])
    for seq, logits in zip(seqs, got):
        assert logits.dtype == torch.float32
        close(logits, reference(model, seq)[-2:], rtol=1e-4, atol=1e-4)


def test_padding_to_a_bucket_changes_nothing(model):
    padded = runner_for(model, buckets=Buckets(rows=(4,), tokens=(8,), blocks=(16,), window=8))
    exact = runner_for(model, buckets=Buckets(rows=(1,), tokens=(1,), blocks=(1,), window=1))
    seq = sequence(20, seed=9)
    for runner in (padded, exact):
        run(runner, "s", seq[:15])
    close(run(padded, "s", seq[15:]), run(exact, "s", seq[15:]))
    needed = BatchShape(rows=1, tokens=5, blocks=5, window=1)
    assert padded.bucket_for(needed) == BatchShape(4, 8, 16, 8)  # padded rows, tokens and blocks
    assert exact.bucket_for(needed) is None  # past the largest bucket: its exact shape


def test_a_model_loaded_from_its_directory(tmp_path):
    from specdec_cli import tiny

    path = tiny.build_model(tmp_path / "m", tiny.word_tokenizer(12), "qwen2", seed=3, dtype=torch.float64)
    graph, tokenizer = GraphModel.load(str(path), "float64")
    hf = hf_from(path)
    runner = CudaGraphRunner(graph, PagedKV(graph.pool_spec(4), 32))
    seq = [1, 5, 3, 7, 2, 9, 11, 4]
    close(run(runner, "s", seq), reference(hf, seq))
    assert tokenizer.eos_token_id == 0


def hf_from(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()


def test_other_architectures_are_refused_by_name():
    from specdec_cli import tiny
    from transformers import AutoModelForCausalLM

    gpt2 = AutoModelForCausalLM.from_config(tiny.model_config("gpt2", 32, 0))
    with pytest.raises(ModelLoadError, match="covers llama, qwen2, mistral models, not 'gpt2'"):
        GraphModel.from_hf(gpt2)


def test_a_sliding_window_caps_the_context():
    runner = runner_for(hf_model("mistral"), blocks=80)  # window 256 of a 512-token context
    assert runner.model.arch.max_context == 256
    run(runner, "s", sequence(250, seed=10))
    with pytest.raises(InvalidArgument, match="would hold 257 tokens, past the model's context of 256"):
        run(runner, "s", sequence(7, seed=11))
    assert runner.kv.length("s") == 250


def test_sessions_decoded_together_each_equal_hf_generate(model):
    """Three sessions of different prompt lengths decoded in one batch per step (padded to a
    bucket of 4 rows), each token for token what HF's greedy generate gives it alone."""
    runner = runner_for(model, buckets=Buckets(rows=(4,), tokens=(1,), blocks=(8,), window=1))
    prompts = [sequence(n, seed=20 + n) for n in (2, 9, 15)]
    wants = [model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
             for p in prompts]
    outs = [[int(run(runner, f"s{i}", p, keep=1)[-1].argmax())] for i, p in enumerate(prompts)]
    for _ in range(11):
        logits = runner.forward([RowInput(f"s{i}", out[-1:]) for i, out in enumerate(outs)])
        for out, row in zip(outs, logits):
            out.append(int(row[-1].argmax()))
    assert outs == wants
