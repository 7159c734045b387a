"""Propose and Verify over call streams (ProposeStream / VerifyStream, the coordinator's default
transport) against the same calls as unary RPCs: same output, same errors, same batching; a
stream that breaks fails its calls like a dead server and is opened anew; a server without the
stream methods gets unary calls. Real servers on loopback, tiny float64 models.

Here the e2e tests; the other tiers' are in tests/service/test_stream_transport.py.
"""

from __future__ import annotations

import grpc

from specdec.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tests.cluster import Cluster
from tests.service.test_stream_transport import MethodLog, run


# ---- through the coordinator -----------------------------------------------------------------

def _conversations(cluster: Cluster) -> list[list[int]]:
    """Greedy generations with draft rounds, a continued session, and a continued session whose
    KV caches the services dropped in between (a cache miss, answered by resending)."""
    target = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(f"127.0.0.1:{cluster.target_port}"))
    draft = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(f"127.0.0.1:{cluster.draft_port}"))
    out = []
    for i, prompt in enumerate(([3, 7, 5, 2], [9, 4, 1, 2, 9, 4], [11, 12])):
        first = cluster.complete(token_ids=prompt, max_new_tokens=20, num_speculative_tokens=2 + i,
                                 ignore_eos=True)
        out.append(list(first.token_ids))
        if i == 2:  # the services lose the session: the next turn meets a cache miss
            for stub, request in ((target, target_pb2.TargetServiceReleaseRequest),
                                  (draft, draft_pb2.DraftServiceReleaseRequest)):
                assert stub.Release(request(session_id=first.session_id), timeout=10).released
        second = cluster.complete(token_ids=[5, 6], max_new_tokens=12, session_id=first.session_id,
                                  num_speculative_tokens=3, ignore_eos=True)
        out.append(list(second.token_ids))
        if i == 2:
            assert second.stats.cache_misses >= 1
    return out


def test_greedy_output_is_the_same_over_streams_and_unary_calls(models, run):
    outputs, methods = {}, {}
    for transport in ("stream", "unary"):
        log = MethodLog()
        with Cluster(models["llama"]["draft"], models["llama"]["target"], interceptors=[log],
                     coordinator={"rpc_transport": transport}) as cluster:
            log.take()  # start-up's model info
            outputs[transport] = _conversations(cluster)
            methods[transport] = log.take()
    assert outputs["stream"] == outputs["unary"]
    stream, unary = methods["stream"], methods["unary"]
    assert stream.count("ProposeStream") == 1 and stream.count("VerifyStream") == 1, stream
    assert "Propose" not in stream and "Verify" not in stream
    assert "ProposeStream" not in unary and unary.count("Verify") > 6 and "Propose" in unary
