"""Fuzz every field of GenerateRequest: only documented status codes, never INTERNAL, and the
servers stay up."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from specdec.v1 import common_pb2, coordinator_pb2
from tests.cluster import Cluster

DOCUMENTED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}

# protobuf strings must be valid UTF-8: no lone surrogates
texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)
int32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
edge_floats = st.sampled_from([0.0, -0.0, 1e-40, 1e-20, 1e-6, 1e-5, 0.5, 1.0, 1e30, float("inf"), float("nan")])


@st.composite
def generate_requests(draw, known_sessions):
    request = coordinator_pb2.GenerateRequest()
    request.session_id = draw(st.one_of(st.just(""), texts, st.sampled_from(known_sessions)))
    which = draw(st.sampled_from(["prompt", "token_ids", "messages", None]))
    if which == "prompt":
        request.prompt = draw(texts)
    elif which == "token_ids":
        request.token_ids.ids.extend(draw(st.lists(st.one_of(st.integers(0, 400), int32), max_size=20)))
    elif which == "messages":
        for role, content in draw(st.lists(st.tuples(texts, texts), max_size=3)):
            request.messages.messages.append(coordinator_pb2.ChatMessage(role=role, content=content))
    sampling = common_pb2.SamplingParams()
    for name, strategy in (("temperature", st.one_of(edge_floats, floats, st.floats(0, 2))),
                           ("top_k", st.one_of(int32, st.integers(0, 50))),
                           ("top_p", st.one_of(edge_floats, floats, st.floats(0.01, 1))),
                           ("seed", st.integers(0, 2**64 - 1))):
        if draw(st.booleans()):
            setattr(sampling, name, draw(strategy))
    if draw(st.booleans()):
        request.sampling.CopyFrom(sampling)
    if draw(st.booleans()):
        request.max_new_tokens = draw(st.one_of(int32, st.integers(0, 20)))
    if draw(st.booleans()):
        request.num_speculative_tokens = draw(st.one_of(int32, st.integers(-1, 18)))
    if draw(st.booleans()):
        request.proposer = draw(st.one_of(st.integers(0, 4), int32))  # unknown numbers included
    request.stop.extend(draw(st.lists(texts, max_size=3)))
    request.ignore_eos = draw(st.booleans())
    return request


@pytest.fixture(scope="module")
def fuzz_cluster(models):
    with Cluster(models["llama"]["draft"], models["llama"]["target"], dtype="float32",
                 coordinator={"max_new_tokens_limit": 16, "default_max_new_tokens": 8}) as cluster:
        yield cluster


def test_fuzz_generate_request(fuzz_cluster):
    known = [fuzz_cluster.complete(prompt="seed session", max_new_tokens=2).session_id]
    seen = set()
    runs = []

    def valid(**sampling):
        return coordinator_pb2.GenerateRequest(prompt="def f(x):", max_new_tokens=4,
                                               sampling=common_pb2.SamplingParams(**sampling))

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @example(valid(temperature=1e-40))
    @example(valid(temperature=1e-6, top_k=1, top_p=1e-30))
    @example(valid(temperature=1e30, top_p=1.0))
    @example(valid(temperature=float("inf")))
    @example(valid(temperature=0.7, top_k=2**31 - 1, seed=2**64 - 1))
    @given(generate_requests(known))
    def check(request):
        runs.append(request)
        for call in ("Complete", "Generate"):
            try:
                if call == "Complete":
                    fuzz_cluster.stub.Complete(coordinator_pb2.CompleteRequest(request=request), timeout=60)
                else:
                    list(fuzz_cluster.stub.Generate(request, timeout=60))
                seen.add(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                assert exc.code() in DOCUMENTED, (exc.code(), exc.details(), request)
                assert exc.details(), "an error without a message"
                seen.add(exc.code())

    check()
    assert len(runs) >= 200
    assert {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND} <= seen
    for port in (fuzz_cluster.draft_port, fuzz_cluster.target_port, fuzz_cluster.coordinator.port):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
    assert len(fuzz_cluster.complete(prompt="still up", max_new_tokens=4, ignore_eos=True).token_ids) == 4
