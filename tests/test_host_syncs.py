"""Host synchronisations and per-call work of the services' calls on the torch engine, counted
with bench/launches.py's profiler proxy: a target-only Verify (what every round of proposer
`none`, and every round of prompt lookup that found nothing, sends) reads its verdict back once
and does no more work at a long history than at a short one; host data reaches the device
without blocking."""

from __future__ import annotations

import pytest
import torch

from bench import launches
from specdec.runtime import transfer
from specdec.runtime.torch import batch_cache
from specdec.maths.tree import TokenTree

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def engine():
    model, _ = launches.build_model("tiny")
    return launches.make_engine(model)


def _counts(engine, history: int, drafts: int = 0, tree: bool = False, service: str = "target",
            temperature: float = 0.0):
    rows = launches.Rows(engine, history)
    spec = launches.RowSpec(f"{service}-{drafts}-{tree}-{temperature}", service, drafts, temperature, tree)
    return launches.measure_row(rows, spec, repeats=1, warmup=1)


def test_a_target_only_verify_synchronises_once(engine):
    counts = _counts(engine, 32)
    assert counts.syncs == 1, counts  # the verdict's token read back; no upload, no item()
    assert counts.reads == 1


def test_a_sampled_target_only_verify_synchronises_once(engine):
    counts = _counts(engine, 32, temperature=1.0)
    assert counts.syncs == 1, counts  # the drawn token; no check of an empty q


@pytest.mark.parametrize("drafts,tree", [(4, False), (6, True)])
def test_a_verification_synchronises_once(engine, drafts, tree):
    assert _counts(engine, 32, drafts, tree).syncs == 1


def test_a_greedy_draft_step_synchronises_once(engine):
    assert _counts(engine, 32, 1, service="draft").syncs == 1


def test_no_per_call_work_grows_with_the_history(engine):
    short, long = _counts(engine, 24), _counts(engine, 600)
    assert (long.aten_ops, long.launches, long.syncs) == (short.aten_ops, short.launches, short.syncs)


def test_uploads_carry_the_values_and_the_tree_mask_its_ancestors():
    rows = [[1, 2, 3], [4, 5, 6]]
    assert torch.equal(transfer.upload(rows, torch.long, "cpu"), torch.tensor(rows))
    tree = TokenTree((5, 6, 7, 8), (0, 1, 0, 3))  # two chains of two under the root
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(batch_cache.ancestor_mask(tree), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the pinned, asynchronous copy")
def test_an_upload_to_a_gpu_is_asynchronous_and_exact():
    data = [[7, 8, 9]] * 3
    tensor = transfer.upload(data, torch.long, "cuda")
    assert tensor.is_cuda and tensor.cpu().tolist() == data


def test_a_draft_q_stays_on_the_host_until_the_model_thread_moves_it():
    from specdec.maths.draft_q import DraftQ
    from specdec.types import SparseDist

    q = DraftQ.from_sparse([SparseDist((3, 5), (0.25, 0.75))], [5], vocab=8)
    assert q.of_drafts.device.type == "cpu" and q.to("cpu") is q
    if torch.cuda.is_available():
        moved = q.to("cuda")
        assert moved.of_drafts.is_cuda and moved.of_drafts.cpu().tolist() == [0.75]
        assert moved.ids[0].cpu().tolist() == [3, 5]
