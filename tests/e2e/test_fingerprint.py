"""A service notices that its KV holds a different history than the call assumes.

Here the e2e tests; the other tiers' are in tests/unit/test_fingerprint.py.
"""

from __future__ import annotations

import grpc
import pytest

from specdec.fingerprint import fingerprint
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

GREEDY = common_pb2.SamplingParams(temperature=0.0, top_k=0, top_p=1.0)


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
