"""The model services never block on the model: health, Release and new calls are answered
while a long forward runs; queued calls past their deadline are dropped; the queue is bounded."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.config import TargetConfig
from specdec.rpc.status import RETRY_AFTER_KEY
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service import server as target_server
from tests.cluster import _free_port

pytestmark = pytest.mark.service

GREEDY = common_pb2.SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
BUSY_S = 4.0


@pytest.fixture
def target(models):
    config = TargetConfig(model=models["llama"]["target"], dtype="float64", port=_free_port(), max_queue=2)
    server, port, servicer = target_server.start(config)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield target_pb2_grpc.TargetServiceStub(channel), health_pb2_grpc.HealthStub(channel), servicer
    channel.close()
    server.stop(None).wait()


def _hold_the_model(servicer) -> threading.Event:
    """Occupy the model worker (as a long forward would) for BUSY_S seconds."""
    started = threading.Event()

    def long_forward():
        started.set()
        time.sleep(BUSY_S)

    servicer.worker.submit(long_forward)
    assert started.wait(5)
    return started


def test_health_and_release_answer_while_the_model_is_busy(target):
    stub, health, servicer = target
    stub.Verify(target_pb2.VerifyRequest(session_id="held", prefix_len=0, new_tokens=[1, 2, 3], sampling=GREEDY))
    _hold_the_model(servicer)
    t0 = time.monotonic()
    status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5).status
    health_s = time.monotonic() - t0
    assert status == health_pb2.HealthCheckResponse.SERVING
    released = stub.Release(target_pb2.TargetServiceReleaseRequest(session_id="held"), timeout=0.5)
    assert released.released and "held" not in servicer.engine.caches
    assert time.monotonic() - t0 < BUSY_S / 2, "answered only after the model was free"
    print(f"health answered in {health_s * 1000:.1f} ms while the model was busy")


def test_calls_past_their_deadline_are_dropped_and_the_queue_is_bounded(target):
    stub, _, servicer = target
    engine = servicer.engine
    _hold_the_model(servicer)
    before = engine.tokens_run
    request = target_pb2.VerifyRequest(session_id="late", prefix_len=0, new_tokens=[4, 5], sampling=GREEDY)
    with pytest.raises(grpc.RpcError) as info:
        stub.Verify(request, timeout=0.3)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # two calls wait (the limit, max_queue=2); a third is refused at once with a retry hint
    waiting = [stub.Verify.future(target_pb2.VerifyRequest(session_id=f"w{i}", prefix_len=0, new_tokens=[6],
                                                           sampling=GREEDY), timeout=30) for i in range(2)]
    time.sleep(0.2)
    with pytest.raises(grpc.RpcError) as info:
        stub.Verify(target_pb2.VerifyRequest(session_id="third", prefix_len=0, new_tokens=[7], sampling=GREEDY),
                    timeout=1)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "queued" in info.value.details()
    assert int(dict(info.value.trailing_metadata())[RETRY_AFTER_KEY]) > 0
    assert [w.result().num_accepted for w in waiting] == [0, 0]
    # the late call never ran: only the two waiting one-token calls did
    assert engine.tokens_run - before == 2
    assert "late" not in engine.caches
