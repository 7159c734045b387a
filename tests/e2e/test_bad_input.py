"""Bad input gets a precise status and a message a user can act on, never INTERNAL."""

from __future__ import annotations

import grpc
import pytest

from specdec.v1 import common_pb2, coordinator_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def status_of(call, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value.code(), info.value.details()


@pytest.mark.parametrize("fields, code, words", [
    (dict(prompt=""), INVALID, "prompt is empty"),
    (dict(), INVALID, "no input"),
    (dict(token_ids=[]), INVALID, "token_ids is empty"),
    (dict(token_ids=[1, 10**6]), INVALID, "outside the vocabulary"),
    (dict(messages=[]), INVALID, "messages is empty"),
    (dict(messages=[("", "hi")]), INVALID, "role"),
    (dict(messages=[("wizard", "hi")]), INVALID,
     "unknown chat role 'wizard': a message's role is one of system, user, assistant, tool"),
    (dict(prompt="hi", temperature=-0.5), INVALID, "temperature must be a finite number >= 0"),
    (dict(prompt="hi", temperature=1.0, top_p=0.0), INVALID, "top_p must be in (0, 1]"),
    (dict(prompt="hi", temperature=1.0, top_p=1.5), INVALID, "top_p must be in (0, 1]"),
    (dict(prompt="hi", temperature=1.0, top_k=-3), INVALID, "top_k must be in [0, 2147483647]"),
    (dict(prompt="hi", num_speculative_tokens=17), INVALID, "num_speculative_tokens must be in [0, 16]"),
    (dict(prompt="hi", num_speculative_tokens=-1), INVALID, "num_speculative_tokens must be in [0, 16]"),
    (dict(prompt="hi", max_new_tokens=0), INVALID, "max_new_tokens must be in [1, 4096]"),
    (dict(prompt="hi", max_new_tokens=5000), INVALID, "max_new_tokens must be in [1, 4096]"),
    (dict(token_ids=[5] * 600), INVALID, "the limit is 511"),
    (dict(prompt="hi", stop=["x"] * 17), INVALID, "at most 16 stop strings"),
    (dict(prompt="hi", cache_salt="s" * 257), INVALID, "cache_salt must be at most 256 characters"),
    (dict(session_id="no-such-session", prompt="hi"), grpc.StatusCode.NOT_FOUND, "does not exist"),
])
def test_generate_rejects(llama_cluster, fields, code, words):
    for call in (llama_cluster.complete, llama_cluster.stream):
        got, details = status_of(call, **fields)
        assert got == code, details
        assert words in details


def test_unknown_session_lookups(llama_cluster):
    code, details = status_of(llama_cluster.stub.GetSession,
                              coordinator_pb2.GetSessionRequest(session_id="nope"))
    assert code == grpc.StatusCode.NOT_FOUND and "nope" in details
    response = llama_cluster.stub.DeleteSession(coordinator_pb2.DeleteSessionRequest(session_id="nope"))
    assert response.deleted is False
    for call, request in ((llama_cluster.stub.GetSession, coordinator_pb2.GetSessionRequest()),
                          (llama_cluster.stub.DeleteSession, coordinator_pb2.DeleteSessionRequest())):
        code, details = status_of(call, request)
        assert code == INVALID, details
        assert details.startswith("GetSession needs a session_id" if call == llama_cluster.stub.GetSession
                                  else "DeleteSession needs a session_id"), details
        assert "omit" not in details


def test_session_is_leased_by_one_request_at_a_time(llama_cluster):
    first = llama_cluster.complete(prompt="hello", max_new_tokens=2)
    stream = llama_cluster.stub.Generate(
        coordinator_pb2.GenerateRequest(session_id=first.session_id, prompt=" more", max_new_tokens=200,
                                        num_speculative_tokens=1, ignore_eos=True,
                                        sampling=common_pb2.SamplingParams(temperature=0.0)))
    next(stream)  # the first request is now mid-generation
    code, details = status_of(llama_cluster.complete, session_id=first.session_id, prompt=" again")
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "generating in another request" in details
    stream.cancel()


def test_session_too_long_for_context(llama_cluster):
    first = llama_cluster.complete(token_ids=[5] * 500, max_new_tokens=1)
    code, details = status_of(llama_cluster.complete, session_id=first.session_id, token_ids=[5] * 20)
    assert code == INVALID and "no room in the model context" in details


def test_generation_stops_at_context_end(llama_cluster):
    response = llama_cluster.complete(token_ids=[5] * 505, max_new_tokens=50, ignore_eos=True)
    assert response.finish_reason == common_pb2.FINISH_REASON_CONTEXT_LENGTH
    assert len(response.token_ids) == 512 - 505


def _services(cluster):
    draft = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(f"127.0.0.1:{cluster.draft_port}"))
    target = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(f"127.0.0.1:{cluster.target_port}"))
    return draft, target


GREEDY = common_pb2.SamplingParams(temperature=0.0, top_k=0, top_p=1.0)


def test_services_answer_cache_miss_with_failed_precondition(llama_cluster):
    draft, target = _services(llama_cluster)
    code, details = status_of(draft.Propose, draft_pb2.ProposeRequest(
        session_id="never-seen", prefix_len=7, new_tokens=[1], num_speculative_tokens=2, sampling=GREEDY))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "holds 0 tokens" in details and "prefix_len=7" in details
    code, details = status_of(target.Verify, target_pb2.VerifyRequest(
        session_id="never-seen", prefix_len=3, new_tokens=[1], sampling=GREEDY))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "resend with prefix_len=0" in details


@pytest.mark.parametrize("request_fields, words", [
    (dict(session_id="", prefix_len=0, new_tokens=[1]), "session_id is required"),
    (dict(session_id="s", prefix_len=0, new_tokens=[]), "new_tokens must hold at least one token"),
    (dict(session_id="s", prefix_len=-1, new_tokens=[1]), "prefix_len must be >= 0"),
    (dict(session_id="s", prefix_len=0, new_tokens=[10**6]), "outside the vocabulary"),
    (dict(session_id="s", prefix_len=0, new_tokens=[1] * 600), "exceeds the model context"),
    (dict(session_id="s", prefix_len=0, new_tokens=[1], draft_tokens=[2, 3],
          sampling=common_pb2.SamplingParams(temperature=1.0, top_p=1.0)), "need 2 draft_probs"),
    (dict(session_id="s", prefix_len=0, new_tokens=[1], draft_tokens=[1] * 17), "exceed this service's limit"),
    (dict(session_id="s", prefix_len=0, new_tokens=[1], sampling=common_pb2.SamplingParams(temperature=-1)),
     "temperature"),
])
def test_target_rejects_malformed_verify(llama_cluster, request_fields, words):
    _, target = _services(llama_cluster)
    request_fields.setdefault("sampling", GREEDY)
    code, details = status_of(target.Verify, target_pb2.VerifyRequest(**request_fields))
    assert code == INVALID, details
    assert words in details


def test_draft_rejects_bad_gamma(llama_cluster):
    draft, _ = _services(llama_cluster)
    for gamma in (0, 17):
        code, details = status_of(draft.Propose, draft_pb2.ProposeRequest(
            session_id="s", prefix_len=0, new_tokens=[1], num_speculative_tokens=gamma, sampling=GREEDY))
        assert code == INVALID and "num_speculative_tokens must be in [1, 16]" in details


def test_draft_rejects_more_uncommitted_tokens_than_the_history(llama_cluster):
    draft, _ = _services(llama_cluster)
    for uncommitted in (-1, 3):
        code, details = status_of(draft.Propose, draft_pb2.ProposeRequest(
            session_id="s", prefix_len=0, new_tokens=[1, 2], num_speculative_tokens=1, sampling=GREEDY,
            uncommitted_tokens=uncommitted))
        assert code == INVALID and "uncommitted_tokens must be in [0, prefix_len + len(new_tokens)] = [0, 2]" in details
