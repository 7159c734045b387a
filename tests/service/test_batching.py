"""Batching: concurrent sessions share forwards, and each session's output is IDENTICAL to what it
gets alone (float64 tiny models, real gRPC).

End to end, many concurrent generations (mixed prompt lengths, mixed γ, greedy and seeded
sampling, continued sessions, sessions joining and leaving) are compared token for token with the
same requests run one at a time on services that never batch. At the service level, the model
worker is held while calls queue, so they run as one batch for certain: rollbacks of different
lengths, mixed γ, a cache miss and a bad request in one batch, each compared with the same call
run alone. The K/V buffers are checked against the DynamicCache path they replace.

Here the service tests; the other tiers' are in tests/unit/test_batching.py and
tests/e2e/test_batching.py.
"""

from __future__ import annotations

import random
import time

import grpc
import pytest
import torch

from draft_service import server as draft_server
from specdec.config import DraftConfig, TargetConfig
from specdec.fingerprint import fingerprint
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from target_service import server as target_server
from tests.cluster import _free_port
from tests.spies import held_worker

GREEDY = common_pb2.SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
SAMPLED = common_pb2.SamplingParams(temperature=0.8, top_k=0, top_p=0.95)


# ---- one batch for certain, at the service level -------------------------------------------------

def _outcome(future) -> tuple:
    try:
        return ("ok", future.result(timeout=60))
    except grpc.RpcError as exc:
        return (exc.code(), exc.details())


def _history(rng: random.Random) -> list[int]:
    return [rng.randrange(1, 380) for _ in range(rng.randrange(3, 60))]


@pytest.fixture(scope="module")
def batching_target(models):
    config = TargetConfig(model=models["llama"]["target"], dtype="float64", port=_free_port(), batch_wait_ms=5.0)
    server, port, servicer = target_server.start(config)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield target_pb2_grpc.TargetServiceStub(channel), servicer
    channel.close()
    server.stop(None).wait()


@pytest.fixture(scope="module")
def batching_draft(models):
    config = DraftConfig(model=models["llama"]["draft"], dtype="float64", port=_free_port(), batch_wait_ms=5.0,
                         max_queue=64)
    server, port, servicer = draft_server.start(config)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield draft_pb2_grpc.DraftServiceStub(channel), servicer
    channel.close()
    server.stop(None).wait()


def _q(drafts: list[int]) -> list[common_pb2.SparseDistribution]:
    """A valid proposal distribution per draft token (it holds the token)."""
    return [common_pb2.SparseDistribution(token_ids=[d, (d + 1) % 384, (d + 2) % 384], probs=[0.5, 0.3, 0.2])
            for d in drafts]


def _verify_requests(prefix: str, histories: list[list[int]], model, rng: random.Random
                     ) -> list[target_pb2.VerifyRequest]:
    """Per session: roll back 0..6 tokens, add 1-3 tokens, then 0-5 drafts: the target's own
    greedy continuation up to a position that varies, then a random token; greedy or sampled."""
    requests = []
    for i, history in enumerate(histories):
        keep = max(1, len(history) - (i * 2) % 7)
        new_tokens = [rng.randrange(1, 380) for _ in range(1 + i % 3)]
        gamma, agree = i % 6, i % 4
        drafts: list[int] = []
        with torch.inference_mode():
            while len(drafts) < gamma:
                if len(drafts) < agree:
                    logits = model(torch.tensor([history[:keep] + new_tokens + drafts])).logits[0, -1]
                    drafts.append(int(logits.argmax()))
                else:
                    drafts.append(rng.randrange(1, 380))
        sampling = GREEDY if i % 2 else SAMPLED
        requests.append(target_pb2.VerifyRequest(
            session_id=f"{prefix}{i}", prefix_len=keep, prefix_hash=fingerprint(history[:keep]),
            new_tokens=new_tokens, draft_tokens=drafts, draft_probs=_q(drafts) if sampling is SAMPLED else [],
            sampling=sampling, seed=40 + i))
    return requests


def test_one_verify_batch_equals_each_call_alone(batching_target):
    stub, servicer = batching_target
    rng = random.Random(3)
    histories = [_history(rng) for _ in range(7)]
    requests = _verify_requests("v", histories, servicer.engine.model, random.Random(4))
    for prefix in ("v", "alone-v"):
        for i, history in enumerate(histories):
            stub.Verify(target_pb2.VerifyRequest(session_id=f"{prefix}{i}", prefix_len=0, new_tokens=history,
                                                 sampling=GREEDY))
    miss = target_pb2.VerifyRequest(session_id="v-miss", prefix_len=2, prefix_hash=12345, new_tokens=[9],
                                    sampling=GREEDY)  # a wrong fingerprint: a cache miss
    stub.Verify(target_pb2.VerifyRequest(session_id="v-miss", prefix_len=0, new_tokens=[1, 2, 3], sampling=GREEDY))
    bad = target_pb2.VerifyRequest(session_id="v-bad", prefix_len=0, new_tokens=[1], draft_tokens=[2],
                                   draft_probs=[common_pb2.SparseDistribution(token_ids=[2], probs=[float("nan")])],
                                   sampling=SAMPLED)
    before = servicer.scheduler.batch_sizes.copy()
    with held_worker(servicer, queued=len(requests) + 1):
        futures = [stub.Verify.future(r, timeout=60) for r in requests + [miss]]
        bad_outcome = _outcome(stub.Verify.future(bad, timeout=60))
    outcomes = [_outcome(f) for f in futures]
    assert servicer.scheduler.batch_sizes - before == {len(requests) + 1: 1}, "not one batch"
    assert bad_outcome[0] == grpc.StatusCode.INVALID_ARGUMENT and "finite" in bad_outcome[1]
    assert outcomes[-1][0] == grpc.StatusCode.FAILED_PRECONDITION and "cache miss" in outcomes[-1][1]
    for request, (status, got) in zip(requests, outcomes[:-1]):
        assert status == "ok", got
        request.session_id = "alone-" + request.session_id
        alone = stub.Verify(request)  # a batch of one
        assert got == alone, request.session_id
    assert len({o[1].num_accepted for o in outcomes[:-1]}) > 2, "rollbacks of one length only: a weak test"


def test_one_propose_batch_equals_each_call_alone(batching_draft):
    stub, servicer = batching_draft
    rng = random.Random(5)
    histories = [_history(rng) for _ in range(8)]
    requests = []
    for i, history in enumerate(histories):
        keep = max(1, len(history) - i % 5)
        requests.append(draft_pb2.ProposeRequest(
            session_id=f"p{i}", prefix_len=keep, prefix_hash=fingerprint(history[:keep]),
            new_tokens=[rng.randrange(1, 380) for _ in range(1 + i % 4)], num_speculative_tokens=1 + i % 6,
            sampling=GREEDY if i % 3 == 0 else SAMPLED, seed=70 + i))
    for prefix in ("p", "alone-p"):
        for i, history in enumerate(histories):
            stub.Propose(draft_pb2.ProposeRequest(session_id=f"{prefix}{i}", prefix_len=0, new_tokens=history,
                                                  num_speculative_tokens=1, sampling=GREEDY))
    miss = draft_pb2.ProposeRequest(session_id="p-none", prefix_len=4, prefix_hash=1, new_tokens=[3],
                                    num_speculative_tokens=2, sampling=GREEDY)
    before = servicer.scheduler.batch_sizes.copy()
    with held_worker(servicer, queued=len(requests) + 1):
        futures = [stub.Propose.future(r, timeout=60) for r in requests + [miss]]
    outcomes = [_outcome(f) for f in futures]
    assert servicer.scheduler.batch_sizes - before == {len(requests) + 1: 1}, "not one batch"
    assert outcomes[-1][0] == grpc.StatusCode.FAILED_PRECONDITION
    for request, (status, got) in zip(requests, outcomes[:-1]):
        assert status == "ok", got
        assert len(got.draft_tokens) == request.num_speculative_tokens  # smaller γ left the batch early
        request.session_id = "alone-" + request.session_id
        assert got == stub.Propose(request), request.session_id


def test_queued_calls_hold_their_place_in_the_bounded_queue(models):
    config = DraftConfig(model=models["llama"]["draft"], dtype="float64", port=_free_port(), max_queue=3)
    server, port, servicer = draft_server.start(config)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            request = dict(prefix_len=0, new_tokens=[4, 5, 6], num_speculative_tokens=3, sampling=GREEDY)
            with held_worker(servicer, queued=3):
                futures = [stub.Propose.future(draft_pb2.ProposeRequest(session_id=f"q{i}", **request), timeout=60)
                           for i in range(3)]
                deadline = time.monotonic() + 30
                while servicer.worker.queue_depth < 3:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                with pytest.raises(grpc.RpcError) as info:
                    stub.Propose(draft_pb2.ProposeRequest(session_id="q-over", **request), timeout=5)
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            results = [f.result(timeout=60) for f in futures]
            assert len({tuple(r.draft_tokens) for r in results}) == 1  # same input, same greedy drafts
            assert servicer.scheduler.batch_sizes == {3: 1}
            assert servicer.worker.queue_depth == 0
    finally:
        server.stop(None).wait()
