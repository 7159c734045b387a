"""The target does not trust the draft's distributions: every bad row is INVALID_ARGUMENT naming it.

Straight against a real target service, then the pure validator on the cases a protobuf
message can carry.

Here the e2e tests; the other tiers' are in tests/unit/test_draft_q.py.
"""

from __future__ import annotations

import math

import grpc
import pytest

from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc

SAMPLED = common_pb2.SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
GOOD = common_pb2.SparseDistribution(token_ids=[5, 6], probs=[0.75, 0.25])
VOCAB = 384  # the tiny byte-level models


def _row(ids, probs):
    return common_pb2.SparseDistribution(token_ids=ids, probs=probs)


BAD_ROWS = {
    "nan probability": (_row([5, 6], [math.nan, 1.0]), "finite and >= 0"),
    "negative probability": (_row([5, 6], [1.5, -0.5]), "finite and >= 0"),
    "infinite probability": (_row([5, 6], [math.inf, 0.0]), "finite and >= 0"),
    "duplicated id": (_row([5, 5], [0.5, 0.5]), "unique"),
    "negative id": (_row([5, -1], [0.5, 0.5]), "token ids must be in [0, 384)"),
    "id past the vocabulary": (_row([5, VOCAB], [0.5, 0.5]), "token ids must be in [0, 384)"),
    "does not sum to 1": (_row([5, 6], [0.5, 0.2]), "sum to 0.7"),
    "longer than the vocabulary": (_row(list(range(VOCAB + 1)), [1.0 / (VOCAB + 1)] * (VOCAB + 1)),
                                   "holds 385 entries"),
    "ids and probs differ in length": (_row([5, 6], [1.0]), "2 token_ids but 1 probs"),
    "drafted token has q = 0": (_row([5, 6], [1.0, 0.0]), "has probability 0"),
    "drafted token missing": (_row([7], [1.0]), "has probability 0"),
    "empty row": (_row([], []), "holds 0 entries"),
}


@pytest.fixture
def cluster_target(llama_cluster):
    with grpc.insecure_channel(f"127.0.0.1:{llama_cluster.target_port}") as channel:
        yield target_pb2_grpc.TargetServiceStub(channel)


@pytest.mark.parametrize("case", list(BAD_ROWS), ids=list(BAD_ROWS))
def test_target_rejects_bad_draft_probs_naming_the_row(cluster_target, case):
    bad, words = BAD_ROWS[case]
    request = target_pb2.VerifyRequest(session_id=f"q-{case}", prefix_len=0, new_tokens=[1, 2, 3],
                                       draft_tokens=[5, 6], draft_probs=[GOOD, bad], sampling=SAMPLED, seed=1)
    with pytest.raises(grpc.RpcError) as info:
        cluster_target.Verify(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "draft_probs[1]" in info.value.details() and words in info.value.details(), info.value.details()


def test_target_accepts_good_rows_and_greedy_ignores_them(cluster_target):
    ok = cluster_target.Verify(target_pb2.VerifyRequest(session_id="q-ok", prefix_len=0, new_tokens=[1, 2, 3],
                                                draft_tokens=[5, 6], draft_probs=[GOOD, _row([6], [1.0])],
                                                sampling=SAMPLED, seed=1), timeout=10)
    assert 0 <= ok.num_accepted <= 2
    greedy = common_pb2.SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
    ok = cluster_target.Verify(target_pb2.VerifyRequest(session_id="q-greedy", prefix_len=0, new_tokens=[1, 2, 3],
                                                draft_tokens=[5], sampling=greedy), timeout=10)
    assert ok.num_accepted in (0, 1)
