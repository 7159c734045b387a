"""The graph engine's capture path on a CPU (capture.eager_graph stands in for a CUDA graph):
one shared logits buffer for every bucket, a bucket that fails to capture running eagerly with
the same output, capture turned off by flag and environment, the number of graphs at the
defaults counted without capturing, and the K/V pool's memory fraction net of capture."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from specdec.runtime.graph.batch import BatchShape, RowInput
from specdec.runtime.graph.buckets import (Buckets, count_graphs, logits_buffer_bytes, loop_steps,
                                           per_bucket_logits_bytes, service_buckets)
from specdec.runtime.graph.capture import capture_setting, eager_graph
from specdec.runtime.graph.cuda_graphs import CudaGraphRunner
from specdec.runtime.graph.draft_loop import DraftLoop
from specdec.runtime.graph.model import GraphModel
from specdec.runtime.graph.paged_kv import PagedKV, fraction_of_free
from tests.graph_models import VOCAB, hf_model, run, sequence

pytestmark = pytest.mark.unit

BUCKETS = Buckets(rows=(1, 4), tokens=(1, 5, 16), blocks=(8, 32), window=16)


def eager_runner(capturer=eager_graph, buckets=BUCKETS) -> CudaGraphRunner:
    model = GraphModel.from_hf(hf_model("qwen2"))
    return CudaGraphRunner(model, PagedKV(model.pool_spec(4), 128), buckets, capture=True, capturer=capturer)


def test_every_bucket_writes_its_logits_into_one_shared_buffer():
    runner = eager_runner()
    assert runner.capture() == len(BUCKETS.shapes()) == 12
    buffer = runner.logits_buffer
    assert buffer.numel() == 4 * 16 * VOCAB  # the widest bucket's rows x tokens x vocab, once
    assert buffer.numel() * buffer.element_size() == logits_buffer_bytes(BUCKETS, VOCAB, buffer.element_size())
    for shape, captured in runner.graphs.items():
        assert captured.logits.shape == (shape.rows, shape.tokens, VOCAB)
        assert captured.logits.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert captured.hidden.untyped_storage().data_ptr() == runner.hidden_buffer.untyped_storage().data_ptr()
    # what one output per bucket took: the sum of every bucket's rows x tokens
    assert per_bucket_logits_bytes(BUCKETS, VOCAB, 8) == (1 + 4) * (1 + 5 + 16) * 2 * VOCAB * 8


def test_a_bucket_that_fails_to_capture_runs_eagerly_with_the_same_output(caplog):
    failing = BatchShape(4, 5, 8, 16)
    order = list(reversed(BUCKETS.shapes()))  # capture goes largest first
    calls = []

    def failing_capturer(fn, device, pool):
        calls.append(order[len(calls)])
        if calls[-1] == failing:
            raise RuntimeError("operation not permitted when stream is capturing")
        return eager_graph(fn, device, pool)

    runner = eager_runner(failing_capturer)
    with caplog.at_level(logging.WARNING, logger="specdec.runtime.graph.capture"):
        assert runner.capture() == 11
    assert failing not in runner.graphs and runner.report.failed == 1 and len(runner.graphs) == 11
    assert any("forward bucket BatchShape(rows=4, tokens=5, blocks=8, window=16) failed to capture" in r.message
               and r.levelno == logging.WARNING for r in caplog.records)
    model = GraphModel.from_hf(hf_model("qwen2"))
    eager = CudaGraphRunner(model, PagedKV(model.pool_spec(4), 128), BUCKETS, capture=False)
    seqs = [sequence(n, seed=n) for n in (6, 9, 12)]
    for r in (runner, eager):
        for i, seq in enumerate(seqs):
            run(r, f"s{i}", seq[:-4])
    eager_before, replays_before = runner.eager_runs, runner.replays
    got = runner.forward([RowInput(f"s{i}", seq[-4:], 4) for i, seq in enumerate(seqs)])  # 3 x 4: bucket 4 x 5
    want = eager.forward([RowInput(f"s{i}", seq[-4:], 4) for i, seq in enumerate(seqs)])
    assert runner.eager_runs == eager_before + 1 and runner.replays == replays_before  # the failed bucket
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    decode = runner.forward([RowInput("s0", [3], 1)])  # 1 x 1: a captured bucket, replayed
    assert runner.replays == replays_before + 1
    torch.testing.assert_close(decode[0], eager.forward([RowInput("s0", [3], 1)])[0])


def test_capture_runs_with_the_garbage_collector_frozen_and_off():
    states = []

    def watching(fn, device, pool):
        states.append((gc.isenabled(), gc.get_freeze_count() > 0))
        return eager_graph(fn, device, pool)

    runner = eager_runner(watching, Buckets(rows=(1,), tokens=(1,), blocks=(8,), window=16))
    assert gc.isenabled()
    runner.capture()
    assert states == [(False, True)]
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_the_draft_loop_falls_back_per_bucket_too(caplog):
    model = GraphModel.from_hf(hf_model("qwen2"))
    kv = PagedKV(model.pool_spec(4), 64)
    calls = []

    def capturer(fn, device, pool):
        calls.append(1)
        if len(calls) == 1:  # the largest bucket, captured first
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return eager_graph(fn, device, pool)

    loop = DraftLoop(model, kv, 8, (1, 4), (1, 4), (8,), True, capturer)
    with caplog.at_level(logging.WARNING):
        assert loop.capture() == 3
    assert loop.report.failed == 1 and "draft-loop bucket" in caplog.text


def test_capture_is_turned_off_by_the_flag_or_the_environment():
    assert capture_setting("auto", {}) is None  # on CUDA only
    assert capture_setting("off", {}) is False and capture_setting("on", {}) is True
    assert capture_setting("auto", {"SPECDEC_CUDA_GRAPHS": "off"}) is False
    assert capture_setting("auto", {"SPECDEC_CUDA_GRAPHS": "ON"}) is True
    assert capture_setting("on", {"SPECDEC_CUDA_GRAPHS": "off"}) is True  # the flag wins over the environment
    with pytest.raises(ValueError):
        capture_setting("auto", {"SPECDEC_CUDA_GRAPHS": "sometimes"})


@pytest.mark.parametrize("context, target, draft", [(2048, 32, 64), (32768, 64, 128)], ids=["2k", "32k"])
def test_a_service_at_the_defaults_captures_few_graphs(context, target, draft):
    """bench/gpu.py's services (64 sessions a batch, 16 speculative tokens): counted, not captured."""
    buckets = service_buckets(64, context)
    assert count_graphs(buckets).total == target <= 64
    assert count_graphs(buckets, loop_steps(16)).total == draft
    widest = max(buckets.shapes(), key=lambda s: (s.rows * s.tokens, s.blocks))
    assert widest == BatchShape(64, 16, -(-context // 16), 16)  # every shape the old buckets held is held


def test_the_graph_counts_and_buffers_of_the_bench_shapes():
    from bench.gpu_graphs import figures

    rows = {(row["shape"], row["context"]): row for row in figures()}
    seven = rows[("7b", 2048)]
    assert (seven["before"]["target_graphs"], seven["before"]["draft_graphs"]) == (175, 315)
    assert seven["after"]["target_graphs"] <= 64
    assert seven["before"]["logits_bytes"] == pytest.approx(5.6 * 2 ** 30, rel=0.01)  # the 5.6 GiB
    assert seven["after"]["logits_bytes"] == 64 * 16 * 151936 * 2  # about 0.3 GiB
    assert rows[("7b", 32768)]["before"]["target_graphs"] == 315


def test_the_pool_fraction_is_of_the_memory_capture_leaves():
    assert fraction_of_free(10_000, 0.5, 2_000) == 4_000  # half of what is free once capture's share is set aside
    assert fraction_of_free(10_000, 0.9, 0) == 9_000
    assert fraction_of_free(1_000, 0.9, 2_000) == 0  # nothing left: blocks_for then refuses the start


def test_an_engine_captured_on_the_cpu_drafts_as_the_eager_one(small_vocab_models):
    """The whole capture path of a draft service (forward buckets and the draft loop, shared
    outputs, static inputs) with eager_graph standing in for CUDA graphs: the same greedy drafts,
    with hints and without, as the engine without capture; served by replays."""
    from specdec.runtime.graph.engine import GraphEngine
    from specdec.runtime.loader import load_model
    from specdec.types import SamplingParams

    buckets = Buckets(rows=(1, 4), tokens=(1, 5, 16))
    engines = [GraphEngine(load_model(small_vocab_models["draft"], "float64", "cpu"), 8, 8 << 20, 16,
                                  buckets=buckets, capture=capture, capturer=eager_graph if capture else None)
               for capture in (True, False)]
    proposals = []
    for engine in engines:
        drafting = engine.drafting(8)
        engine.warm_up()
        greedy = SamplingParams(temperature=0.0)
        calls = [drafting.call(f"s{i}", 0, 0, [5, 9, 1, 3, 10, 7, i], 3 + i, greedy, i, hints=[4] * (i % 2))
                 for i in range(3)]
        proposals.append([(p.draft_tokens, p.hints_kept, p.cached_len) for p in drafting.propose_batch(calls)])
    captured, eager = engines
    assert proposals[0] == proposals[1]
    assert len(captured.graph.graphs) == len(captured.graph.shapes) == 6 and len(captured.draft_loop.graphs) == 8
    assert captured.graph.replays > 0 and captured.draft_loop.replays > 0
    assert eager.graph.replays == 0 and eager.draft_loop.replays == 0
