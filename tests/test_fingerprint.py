"""A service notices that its KV holds a different history than the call assumes."""

from __future__ import annotations

import random

import grpc
import pytest

from specdec.fingerprint import PrefixHashes, extend_hash, fingerprint
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

GREEDY = common_pb2.SamplingParams(temperature=0.0, top_k=0, top_p=1.0)


@pytest.mark.unit
def test_prefix_hashes_extend_truncate_and_agree_with_one_shot():
    tokens = [random.Random(3).randrange(50_000) for _ in range(500)]
    hashes = PrefixHashes(tokens[:200])
    hashes.extend(tokens[200:])
    assert len(hashes) == 500
    for n in (0, 1, 37, 200, 500):
        assert hashes.at(n) == fingerprint(tokens[:n])
    hashes.truncate(100)
    hashes.extend([7, 8])
    assert hashes.at(102) == extend_hash(fingerprint(tokens[:100]), [7, 8]) == fingerprint(tokens[:100] + [7, 8])
    # order and value matter; 0 and the empty sequence are told apart
    assert fingerprint([1, 2]) != fingerprint([2, 1]) and fingerprint([0]) != fingerprint([])


@pytest.mark.e2e
@pytest.mark.parametrize("tier", ["draft", "target"])
def test_wrong_fingerprint_is_a_cache_miss(llama_cluster, tier):
    port = llama_cluster.draft_port if tier == "draft" else llama_cluster.target_port
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        if tier == "draft":
            stub = draft_pb2_grpc.DraftServiceStub(channel)

            def call(sid, prefix_len, prefix_hash, new_tokens):
                return stub.Propose(draft_pb2.ProposeRequest(
                    session_id=sid, prefix_len=prefix_len, prefix_hash=prefix_hash, new_tokens=new_tokens,
                    num_speculative_tokens=2, sampling=GREEDY), timeout=10)
        else:
            stub = target_pb2_grpc.TargetServiceStub(channel)

            def call(sid, prefix_len, prefix_hash, new_tokens):
                return stub.Verify(target_pb2.VerifyRequest(
                    session_id=sid, prefix_len=prefix_len, prefix_hash=prefix_hash, new_tokens=new_tokens,
                    sampling=GREEDY), timeout=10)

        sid = f"fp-{tier}"
        call(sid, 0, 0, [10, 11, 12, 13])
        # another history of the same length (e.g. another coordinator drove the session)
        with pytest.raises(grpc.RpcError) as info:
            call(sid, 4, fingerprint([10, 11, 99, 13]), [14])
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "cache miss" in info.value.details()
        with pytest.raises(grpc.RpcError):  # a missing fingerprint is no fingerprint
            call(sid, 4, 0, [14])
        # the right one is served, a shorter assumed prefix too (a rollback)
        call(sid, 4, fingerprint([10, 11, 12, 13]), [14])
        call(sid, 2, fingerprint([10, 11]), [20])
