"""Service tier: health, reflection, model info, KV cache bounds, start-up checks.

Here the e2e tests; the other tiers' are in tests/unit/test_services.py and
tests/service/test_services.py.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specdec.checkpoint import checkpoint_id
from specdec.fingerprint import fingerprint
from specdec.runtime.loader import load_model
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc


def test_health_and_reflection_on_every_server(llama_cluster):
    ports = {
        "specdec.v1.DraftService": llama_cluster.draft_port,
        "specdec.v1.TargetService": llama_cluster.target_port,
        "specdec.v1.Coordinator": llama_cluster.coordinator.port,
    }
    for service, port in ports.items():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", service):
                status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
                assert status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            responses = reflection.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
            names = {s.name for r in responses for s in r.list_services_response.service}
            assert service in names and "grpc.health.v1.Health" in names


def test_model_info_matches_between_tiers(llama_cluster):
    with grpc.insecure_channel(f"127.0.0.1:{llama_cluster.draft_port}") as channel:
        draft = draft_pb2_grpc.DraftServiceStub(channel).GetModelInfo(
            draft_pb2.DraftServiceGetModelInfoRequest()).info
    with grpc.insecure_channel(f"127.0.0.1:{llama_cluster.target_port}") as channel:
        target = target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(
            target_pb2.TargetServiceGetModelInfoRequest()).info
    assert draft.tokenizer_fingerprint == target.tokenizer_fingerprint
    assert len(target.tokenizer_fingerprint) == 64
    assert target.vocab_size == 384 and target.max_context_length == 512
    assert target.dtype == "float64" and target.device == "cpu"
    assert list(target.eos_token_ids) == [0]
    assert target.checkpoint_id == checkpoint_id(llama_cluster.target_config.model) != draft.checkpoint_id


def test_propose_returns_truncated_distribution_it_sampled_from(llama_cluster):
    with grpc.insecure_channel(f"127.0.0.1:{llama_cluster.draft_port}") as channel:
        draft = draft_pb2_grpc.DraftServiceStub(channel)
        sampling = common_pb2.SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
        response = draft.Propose(draft_pb2.ProposeRequest(
            session_id="dist", prefix_len=0, new_tokens=[5, 6, 7], num_speculative_tokens=4,
            sampling=sampling, seed=3))
        assert len(response.draft_tokens) == 4 and len(response.draft_probs) == 4
        for token, dist in zip(response.draft_tokens, response.draft_probs):
            assert len(dist.token_ids) == 32  # proposal_top_k
            assert token in dist.token_ids
            assert abs(sum(dist.probs) - 1.0) < 1e-5
            assert list(dist.probs) == sorted(dist.probs, reverse=True)
        assert response.cached_len == 3 + 4 - 1
        again = draft.Propose(draft_pb2.ProposeRequest(
            session_id="dist", prefix_len=3, prefix_hash=fingerprint([5, 6, 7]), new_tokens=[8],
            num_speculative_tokens=4, sampling=sampling, seed=3))
        assert again.cached_len == 4 + 3  # rolled back to 3, appended one, fed three drafts
        draft.Release(draft_pb2.DraftServiceReleaseRequest(session_id="dist"))


def reference_proposal(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                       proposal_top_k: int = 32) -> dict[int, float]:
    """The draft's q at one position, computed independently in float64: temperature, top-k,
    top-p, then the K most likely kept and renormalised. logits [vocab] -> {token id: prob}."""
    z = logits / temperature
    if 0 < top_k < len(z):
        z = np.where(z < np.sort(z)[-top_k], -np.inf, z)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        mass_before = np.cumsum(probs[order]) - probs[order]
        probs[order[mass_before >= top_p]] = 0.0
        probs /= probs.sum()
    kept = [int(i) for i in np.argsort(-probs, kind="stable")[:proposal_top_k] if probs[i] > 0]
    total = probs[kept].sum()
    return {i: float(probs[i] / total) for i in kept}


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (0.5, 0, 1.0), (1.7, 0, 1.0), (0.5, 20, 1.0), (1.7, 0, 0.9), (0.7, 50, 0.8),
])
def test_propose_returns_q_of_the_requested_warp(models, llama_cluster, temperature, top_k, top_p):
    """q at every drafted position is the request's warp (not temperature 1), top-K truncated."""
    prompt = [5, 6, 7, 8, 9]
    with grpc.insecure_channel(f"127.0.0.1:{llama_cluster.draft_port}") as channel:
        draft = draft_pb2_grpc.DraftServiceStub(channel)
        sampling = common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        session = f"warp-{temperature}-{top_k}-{top_p}"
        response = draft.Propose(draft_pb2.ProposeRequest(
            session_id=session, prefix_len=0, new_tokens=prompt, num_speculative_tokens=4,
            sampling=sampling, seed=11))
        draft.Release(draft_pb2.DraftServiceReleaseRequest(session_id=session))
    model = load_model(models["llama"]["draft"], "float64").model
    drafts = list(response.draft_tokens)
    assert len(drafts) == len(response.draft_probs) == 4
    with torch.inference_mode():
        for i, dist in enumerate(response.draft_probs):
            logits = model(torch.tensor([prompt + drafts[:i]])).logits[0, -1].numpy()  # [vocab]
            expected = reference_proposal(logits, temperature, top_k, top_p)
            got = dict(zip(dist.token_ids, dist.probs))
            assert set(got) == set(expected), f"position {i}: other token ids than the warp keeps"
            assert drafts[i] in got
            for token, prob in expected.items():
                assert abs(got[token] - prob) < 1e-5, (i, token, got[token], prob)
