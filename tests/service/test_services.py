"""Service tier: health, reflection, model info, KV cache bounds, start-up checks.

Here the service tests; the other tiers' are in tests/unit/test_services.py and
tests/e2e/test_services.py.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator.server import StartupError, start as start_coordinator
from specdec_cli import tiny
from specdec.fingerprint import fingerprint
from specdec.config import CoordinatorConfig, TargetConfig
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service import server as target_server
from tests.cluster import Cluster, _free_port

GREEDY = common_pb2.SamplingParams(temperature=0.0, top_k=0, top_p=1.0)


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
