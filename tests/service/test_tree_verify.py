"""A token tree verified in one target forward (engine, verifier, Verify over gRPC): each node's
logits are those of its own path run alone, only the accepted path's K/V stay, and greedy
output is the target's own (float64).

Here the service tests; the other tiers' are in tests/unit/test_tree_verify.py.
"""

from __future__ import annotations

import grpc
import pytest

from specdec.fingerprint import fingerprint
from tests.unit.test_tree_verify import HISTORY


def test_verify_over_grpc_takes_a_tree(models):
    from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
    from tests.cluster import Cluster

    with Cluster(models["llama"]["draft"], models["llama"]["target"]) as cluster, \
            grpc.insecure_channel(f"127.0.0.1:{cluster.target_port}") as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        info = stub.GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest()).info
        assert info.verifies_trees
        greedy = common_pb2.SamplingParams(temperature=0.0)
        first = stub.Verify(target_pb2.VerifyRequest(session_id="v", new_tokens=HISTORY, sampling=greedy))
        history, argmax = HISTORY + [first.next_token], None
        # the next argmax, from a plain step on a second session with the same history
        probe = stub.Verify(target_pb2.VerifyRequest(session_id="p", new_tokens=history, sampling=greedy))
        argmax = probe.next_token
        wrong = (argmax + 1) % info.vocab_size
        # two children of the root, the argmax second: it is accepted, reported as node 1
        reply = stub.Verify(target_pb2.VerifyRequest(
            session_id="v", prefix_len=len(HISTORY), prefix_hash=fingerprint(HISTORY),
            new_tokens=[first.next_token], draft_tokens=[wrong, argmax], draft_parents=[0, 0], sampling=greedy))
        assert reply.num_accepted == 1 and list(reply.accepted_nodes) == [1] and reply.is_bonus
        assert reply.cached_len == len(history) + 1
        # the session holds the accepted path: a plain step after it needs no resend
        after = history + [argmax]
        step = stub.Verify(target_pb2.VerifyRequest(
            session_id="v", prefix_len=len(after), prefix_hash=fingerprint(after), new_tokens=[reply.next_token],
            sampling=greedy))
        assert step.cached_len == len(after) + 1
        with pytest.raises(grpc.RpcError) as err:
            stub.Verify(target_pb2.VerifyRequest(session_id="bad", new_tokens=HISTORY, draft_tokens=[1, 2],
                                                 draft_parents=[1, 0], sampling=greedy))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "draft_parents[0] is 1" in err.value.details()
