"""The heads' proposal vocabulary (runtime/heads.py): heads saved with one propose only its ids,
each with the probability a softmax over those ids gives — computed apart from the engines, from
the HF model's hidden state, the heads and the model's output layer — on the torch engine
(float64, and bfloat16 with its rows packed like the model's) and the graph engine; the ids a run
keeps are the training data's commonest; a vocabulary that does not match heads.json or the
model is refused at load."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.config import TargetConfig
from specdec.distill.heads_training import HeadsData, proposal_vocabulary, vocab_coverage
from specdec.distill.objectives import TopK
from specdec.runtime.engines import engine_from_config
from specdec.runtime.heads import (META_FILE, PROPOSAL_VOCAB_KEY, WEIGHTS_FILE, HeadsMeta, HeadsMismatch,
                                   load_heads, save_heads, target_identity)
from specdec.runtime.loader import load_model
from specdec.types import SamplingParams
from tests.test_target_heads import HISTORY, NUM_HEADS, greedy, random_heads, wrong

pytestmark = pytest.mark.unit

VOCAB_IDS = list(range(3, 200, 3)) + [255]  # 67 of the byte-level model's ids, its last row among them


@pytest.fixture(scope="module")
def vocab_heads(models, tmp_path_factory) -> str:
    """The llama target's random heads (seed 7) proposing from VOCAB_IDS."""
    hf = load_model(models["llama"]["target"], "float32").model
    meta = HeadsMeta(NUM_HEADS, hf.config.hidden_size, target_identity(hf), models["llama"]["target"])
    return str(save_heads(tmp_path_factory.mktemp("vocab-heads"), random_heads(hf.config.hidden_size, seed=7),
                          meta, torch.tensor(list(reversed(VOCAB_IDS)))))


@torch.inference_mode()
def expected(hf, heads, tokens: list[int], n: int) -> list[tuple[list[int], list[float]]]:
    """Per head, its n most likely tokens among VOCAB_IDS and their probabilities over those ids,
    read at the last position of `tokens`."""
    hidden = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0, -1]  # [hidden]
    logits = hf.lm_head(heads(hidden[None]))[:, 0].float()  # [heads, vocab]
    ids = torch.tensor(VOCAB_IDS)
    top = torch.topk(torch.softmax(logits[:, ids], dim=-1), n, dim=-1)
    return list(zip(ids[top.indices].tolist(), top.values.tolist()))


@pytest.mark.parametrize("backend, dtype", [("torch", "float64"), ("graph", "float64"), ("torch", "bfloat16")])
def test_heads_propose_from_their_vocabulary_only(models, vocab_heads, backend, dtype):
    engine = engine_from_config(TargetConfig(model=models["llama"]["target"], dtype=dtype, backend=backend,
                                             kv_cache_bytes=8 << 20, heads=vocab_heads))
    engine.warm_up()
    assert engine.heads.vocab_ids.tolist() == VOCAB_IDS  # saved unsorted, kept sorted
    if backend == "torch":  # the vocabulary's rows are packed (or not) like the model's output layer
        assert type(engine.heads.output_layer.layer) is type(engine.model.get_output_embeddings())
    hf = load_model(models["llama"]["target"], dtype).model
    heads = random_heads(hf.config.hidden_size, seed=7).to(hf.dtype)
    g1, g2 = greedy(hf, HISTORY, 2)
    verification = engine.verification()
    calls = [verification.call("v0", 0, 0, HISTORY, [g1, wrong(g2)], [], SamplingParams(0.0), 0, head_candidates=8),
             verification.call("v1", 0, 0, HISTORY[:6], [], [], SamplingParams(0.0), 0, head_candidates=3)]
    tolerance = 1e-6 if dtype == "float64" else 2e-2
    for verdict, path, n in zip(verification.verify_batch(calls), (HISTORY + [g1], HISTORY[:6]), (8, 3)):
        got = [list(d.token_ids) for d in verdict.head_proposals]
        assert all(token in VOCAB_IDS for ids in got for token in ids)
        want = expected(hf, heads, path, n)
        if dtype == "float64":  # bfloat16 may swap near ties
            assert got == [ids for ids, _ in want]
        for dist, (_, probs) in zip(verdict.head_proposals, want):
            assert list(dist.probs) == pytest.approx(probs, abs=tolerance)
            assert sum(dist.probs) <= 1 + 1e-6
    # the full layer would propose ids outside the vocabulary: the restriction is what made them so
    full = torch.softmax(hf.lm_head(heads(torch.zeros(1, hf.config.hidden_size, dtype=hf.dtype))).float(), -1)
    assert not set(full.topk(8, dim=-1).indices.flatten().tolist()) <= set(VOCAB_IDS)


def _data(tokens: list[int], top1: list[int], vocab: int, held: list[int]) -> HeadsData:
    n = len(tokens)
    return HeadsData(hidden=torch.zeros(n, 4), top=TopK(torch.tensor(top1)[:, None], torch.ones(n, 1)),
                     tokens=torch.tensor(tokens), window_end=torch.full((n,), n), held_hidden=[torch.zeros(len(held), 4)],
                     held_greedy=[torch.tensor(held)], vocab=vocab)


def test_a_run_keeps_the_datas_commonest_ids_then_the_lowest():
    data = _data(tokens=[9, 9, 9, 7, 7, 5, 9], top1=[7, 7, 7, 8, 8, 2, 2], vocab=12, held=[9, 7, 1, 11])
    # counts: 9 → 4, 7 → 5, 8 → 2, 2 → 2, 5 → 1; then unseen ids lowest first
    assert proposal_vocabulary(data, 2).tolist() == [7, 9]
    assert proposal_vocabulary(data, 4).tolist() == [2, 7, 8, 9]  # 2 and 8 tie: both kept
    assert proposal_vocabulary(data, 7).tolist() == [0, 1, 2, 5, 7, 8, 9]
    assert proposal_vocabulary(data, 0) is None and proposal_vocabulary(data, 12) is None
    assert vocab_coverage(data, proposal_vocabulary(data, 2)) == 0.5
    assert vocab_coverage(data, None) == 1.0


def test_a_vocabulary_that_does_not_fit_is_refused(models, vocab_heads, tmp_path):
    model = load_model(models["llama"]["target"], "float32").model
    heads, meta, _, ids = load_heads(vocab_heads, model, "cpu", torch.float32)
    assert meta.proposal_vocab == len(VOCAB_IDS) and ids.tolist() == VOCAB_IDS
    vocab_size = model.get_output_embeddings().weight.shape[0]
    for name, vocab, count, why in (
            ("beyond", torch.tensor([1, vocab_size]), 2, "below this model's vocabulary"),
            ("unsorted", torch.tensor([5, 2]), 2, "distinct sorted ids"),
            ("miscounted", torch.tensor([1, 2, 3]), 4, "not 4 int64 ids"),
            ("missing", None, 3, "holds no proposal_vocab")):
        folder = tmp_path / name
        save_heads(folder, heads, meta)
        tensors = load_file(str(folder / WEIGHTS_FILE))
        if vocab is not None:
            tensors[PROPOSAL_VOCAB_KEY] = vocab
        save_file(tensors, str(folder / WEIGHTS_FILE))
        raw = json.loads((folder / META_FILE).read_text())
        (folder / META_FILE).write_text(json.dumps({**raw, "proposal_vocab": count}))
        with pytest.raises(HeadsMismatch, match=why):
            load_heads(folder, model, "cpu", torch.float32)
