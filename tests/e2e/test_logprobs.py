"""Log-probabilities of emitted tokens (specdec/maths/logprobs.py): the pure function on hand-built
logits, and end to end through the gRPC API against the target model run alone.

Here the e2e tests; the other tiers' are in tests/unit/test_logprobs.py.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from specdec.runtime.loader import load_model
from specdec.v1 import coordinator_pb2

PROMPT = "def fibonacci(n):"


def reference_logprobs(target_dir: str, prompt_ids: list[int], generated: list[int]) -> torch.Tensor:
    """The target alone, float64: log_softmax of its raw logits at each generated position."""
    loaded = load_model(target_dir, "float64")
    ids = torch.tensor([prompt_ids + generated])
    with torch.no_grad():
        logits = loaded.model(ids).logits[0]  # [len, vocab]
    return torch.log_softmax(logits[len(prompt_ids) - 1: -1], dim=-1)  # [generated, vocab]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("proposer", [coordinator_pb2.PROPOSER_DRAFT, coordinator_pb2.PROPOSER_NGRAM])
def test_logprobs_are_the_target_models_before_the_warp(llama_cluster, models, sampled, proposer):
    sampling = {"temperature": 0.7, "top_k": 5, "seed": 3} if sampled else {}
    response = llama_cluster.complete(prompt=PROMPT, max_new_tokens=16, ignore_eos=True, num_speculative_tokens=3,
                                proposer=proposer, top_logprobs=4, **sampling)
    tokens = list(response.token_ids)
    assert len(response.logprobs) == len(tokens) == 16
    assert [entry.token_id for entry in response.logprobs] == tokens
    prompt_ids = list(llama_cluster.coordinator.round_loop.tokenizer(PROMPT)["input_ids"])
    expected = reference_logprobs(models["llama"]["target"], prompt_ids, tokens)  # [16, vocab]
    for position, entry in enumerate(response.logprobs):
        row = expected[position]
        assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-5), position
        best = torch.topk(row, 4)
        assert list(entry.top_token_ids) == best.indices.tolist()
        assert list(entry.top_logprobs) == pytest.approx(best.values.tolist(), abs=1e-5)
        if not sampled:  # greedy: the emitted token is the most likely one
            assert entry.top_token_ids[0] == entry.token_id
    # the stream carries the same entries, each with its chunk's tokens
    chunks = llama_cluster.stream(prompt=PROMPT, max_new_tokens=16, ignore_eos=True, num_speculative_tokens=3,
                            proposer=proposer, top_logprobs=4, **sampling)
    assert all(len(chunk.logprobs) == len(chunk.token_ids) for chunk in chunks)
    assert [entry for chunk in chunks for entry in chunk.logprobs] == list(response.logprobs)


def test_no_logprobs_unless_asked_and_out_of_range_refused(llama_cluster):
    response = llama_cluster.complete(prompt=PROMPT, max_new_tokens=4, num_speculative_tokens=2)
    assert len(response.token_ids) and not response.logprobs
    only = llama_cluster.complete(prompt=PROMPT, max_new_tokens=4, num_speculative_tokens=2, top_logprobs=0)
    assert len(only.logprobs) == len(only.token_ids)
    assert all(not entry.top_token_ids for entry in only.logprobs)
    for bad in (-1, 21):
        with pytest.raises(grpc.RpcError) as err:
            llama_cluster.complete(prompt=PROMPT, max_new_tokens=4, top_logprobs=bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "top_logprobs must be in [0, 20]" in err.value.details()
