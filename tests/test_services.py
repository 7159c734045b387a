"""Service tier: health, reflection, model info, KV cache bounds, start-up checks."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from coordinator.server import StartupError, start as start_coordinator
from specdec.checkpoint import checkpoint_id
from specdec_cli import tiny
from specdec.fingerprint import fingerprint
from specdec.config import CoordinatorConfig, TargetConfig
from specdec.runtime.loader import load_model
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from target_service import server as target_server
from tests.cluster import Cluster, _free_port

GREEDY = common_pb2.SamplingParams(temperature=0.0, top_k=0, top_p=1.0)


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.service
def test_kv_caches_are_bounded_lru(models, tmp_path):
    config = TargetConfig(model=models["llama"]["target"], dtype="float64", port=_free_port(), max_sessions=2)
    server, port, servicer = target_server.start(config)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            target = target_pb2_grpc.TargetServiceStub(channel)
            for sid in ("a", "b", "c"):
                target.Verify(target_pb2.VerifyRequest(session_id=sid, prefix_len=0, new_tokens=[1, 2, 3],
                                                       sampling=GREEDY))
            caches = servicer.engine.caches
            assert "a" not in caches and {"b", "c"} <= set(caches._entries)
            assert caches.evictions == 1
            with pytest.raises(grpc.RpcError) as info:
                target.Verify(target_pb2.VerifyRequest(session_id="a", prefix_len=3, new_tokens=[4],
                                                       prefix_hash=fingerprint([1, 2, 3]), sampling=GREEDY))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            # the byte budget evicts too
            caches.max_bytes = caches.total_bytes() // 2
            target.Verify(target_pb2.VerifyRequest(session_id="d", prefix_len=0, new_tokens=[1], sampling=GREEDY))
            assert caches.total_bytes() <= caches.max_bytes or len(caches) == 1
    finally:
        server.stop(None).wait()


@pytest.mark.service
def test_coordinator_startup_error_names_the_difference(models, tmp_path):
    other = tiny.build_model(tmp_path / "other", tiny.word_tokenizer(12), "llama", seed=3)
    cluster = Cluster(str(other), models["llama"]["target"])
    cluster._start_draft(0)
    cluster._start_target(0)
    try:
        config = CoordinatorConfig(draft=f"127.0.0.1:{cluster.draft_port}",
                                   target=f"127.0.0.1:{cluster.target_port}", port=0)
        with pytest.raises(StartupError) as info:
            asyncio.run(start_coordinator(config, startup_timeout_s=10))
        message = str(info.value)
        assert "different tokenizers" in message
        assert "12 tokens" in message and "384 tokens" in message
    finally:
        cluster.draft.stop(None).wait()
        cluster.target.stop(None).wait()
        cluster.loop.close()


@pytest.mark.unit
def test_coordinator_startup_fails_fast_when_services_are_down():
    config = CoordinatorConfig(draft="127.0.0.1:1", target="127.0.0.1:2", port=0)
    with pytest.raises(StartupError) as info:
        asyncio.run(start_coordinator(config, startup_timeout_s=1))
    assert "cannot reach the model services" in str(info.value)
