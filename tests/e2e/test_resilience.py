"""Surviving faults with real processes: services killed or stalled, Redis stopped, clients
cancelling, caches evicted. Greedy output must equal an uninterrupted run; nothing committed is lost.

Here the e2e tests; the other tiers' are in tests/process/test_resilience.py.
"""

from __future__ import annotations

import time

import grpc
import pytest

from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster
from tests.procs import Coordinator
from tests.process.test_resilience import PROMPT, _request


def _wait_released(cluster, session_id, timeout=5.0):
    deadline = time.monotonic() + timeout
    target_caches = cluster.target_servicer.engine.caches
    draft_caches = cluster.draft_servicer.engine.caches
    while time.monotonic() < deadline:
        if session_id not in target_caches and session_id not in draft_caches:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_cancel_or_deadline_releases_everything(models, how):
    paths = models["llama"]
    with Cluster(paths["draft"], paths["target"]) as cluster:
        first = cluster.complete(prompt=PROMPT, max_new_tokens=4, ignore_eos=True)
        sid = first.session_id
        timeout = 0.25 if how == "deadline" else 120
        stream = cluster.stub.Generate(_request(session_id=sid, prompt=" go", max_new_tokens=480), timeout=timeout)
        with pytest.raises(grpc.RpcError) as info:
            for chunk in stream:
                if how == "cancel":
                    stream.cancel()
        expected = grpc.StatusCode.CANCELLED if how == "cancel" else grpc.StatusCode.DEADLINE_EXCEEDED
        assert info.value.code() == expected
        assert _wait_released(cluster, sid), "KV caches of the cancelled request were not released"
        length = len(cluster.stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=sid)).token_ids)
        time.sleep(0.3)
        assert len(cluster.stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=sid)).token_ids) == length
        assert length < first.stats.prompt_tokens + 4 + 2 + 480  # it stopped early
        assert cluster.coordinator.round_loop.active == 0
        # the session is free again and continues from what was committed
        more = cluster.complete(session_id=sid, prompt=" on", max_new_tokens=4, ignore_eos=True)
        assert len(more.token_ids) == 4


@pytest.mark.parametrize("tight", [{"max_sessions": 1}, {"kv_cache_bytes": 40_000}],
                         ids=["max-sessions", "kv-bytes"])
def test_kv_budget_evicts_lru_and_rebuilds_transparently(models, tight):
    paths = models["llama"]
    turns = [" one", " two", " three"]

    def conversation(cluster):
        sessions = [cluster.complete(prompt=p, max_new_tokens=10, ignore_eos=True) for p in ("a b", "c d")]
        outputs = [[list(s.token_ids)] for s in sessions]
        misses = 0
        for turn in turns:  # interleave the two sessions
            for i, s in enumerate(sessions):
                r = cluster.complete(session_id=s.session_id, prompt=turn, max_new_tokens=10, ignore_eos=True)
                outputs[i].append(list(r.token_ids))
                misses += r.stats.cache_misses
        return outputs, misses

    with Cluster(paths["draft"], paths["target"]) as roomy:
        expected, roomy_misses = conversation(roomy)
    with Cluster(paths["draft"], paths["target"], draft=tight, target=tight) as cluster:
        got, misses = conversation(cluster)
        caches = cluster.target_servicer.engine.caches
        assert len(caches) == 1 or caches.total_bytes() <= 40_000
        assert caches.evictions > 0
    assert got == expected
    assert roomy_misses == 0 and misses > 0


def test_too_many_concurrent_generations(models):
    paths = models["llama"]
    with Cluster(paths["draft"], paths["target"], coordinator={"max_concurrent_generations": 1}) as cluster:
        stream = cluster.stub.Generate(_request(prompt=PROMPT, max_new_tokens=480), timeout=120)
        next(stream)
        with pytest.raises(grpc.RpcError) as info:
            cluster.complete(prompt="x", max_new_tokens=2)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "retry" in info.value.details()
        assert dict(info.value.trailing_metadata())["retry-after-ms"] == "1000"
        stream.cancel()


def test_second_coordinator_continues_a_session(models, redis_url):
    paths = models["llama"]
    with Cluster(paths["draft"], paths["target"], coordinator={"session_store": redis_url}) as cluster:
        ref_1 = cluster.complete(prompt=PROMPT, max_new_tokens=12, ignore_eos=True)
        ref_2 = cluster.complete(session_id=ref_1.session_id, prompt=" next", max_new_tokens=12, ignore_eos=True)
        first = cluster.complete(prompt=PROMPT, max_new_tokens=12, ignore_eos=True)
        other = Coordinator(f"127.0.0.1:{cluster.draft_port}", f"127.0.0.1:{cluster.target_port}",
                            session_store=redis_url)
        try:
            second = other.complete(session_id=first.session_id, prompt=" next", max_new_tokens=12,
                                    ignore_eos=True)
            session = other.stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=first.session_id))
        finally:
            other.stop()
        assert list(first.token_ids) == list(ref_1.token_ids)
        assert list(second.token_ids) == list(ref_2.token_ids)
        assert session.requests == 2
        # same replicas: the second coordinator reused the services' KV caches
        assert second.stats.target_prefill_tokens <= second.stats.prompt_tokens + 1
        assert second.stats.cache_misses == 0


def test_message_and_prompt_limits(models):
    paths = models["llama"]
    overrides = {"max_message_bytes": 4096, "max_prompt_tokens": 10}
    with Cluster(paths["draft"], paths["target"], coordinator=overrides) as cluster:
        with pytest.raises(grpc.RpcError) as info:
            cluster.complete(prompt="x" * 10_000, max_new_tokens=2)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as info:
            cluster.complete(token_ids=[5] * 11, max_new_tokens=2)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "the limit is 10" in info.value.details()
        assert len(cluster.complete(token_ids=[5] * 10, max_new_tokens=2).token_ids) == 2
