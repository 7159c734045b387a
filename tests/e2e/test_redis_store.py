"""The Redis session store against a real redis-server: leases (one per request, renewed, taken over),
versioned appends, long sessions, TTL, auth, TLS.

Here the e2e tests; the other tiers' are in tests/unit/test_redis_store.py and
tests/service/test_redis_store.py and tests/process/test_redis_store.py.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import redis

from coordinator.sessions.redis_store import RedisSessionStore, _keys
from specdec_cli import tiny
from specdec.errors import FailedPrecondition
from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster
from tests.service.test_redis_store import run


@pytest.fixture(scope="module")
def long_context_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    tokenizer = tiny.byte_level_tokenizer()
    target = tiny.build_model(root / "target", tokenizer, "llama", seed=41, context=16384)
    draft = tiny.build_model(root / "draft", tokenizer, "llama", seed=42, layers=1, context=16384)
    return str(draft), str(target)


def test_long_prompt_end_to_end_through_redis(long_context_models, redis_url):
    draft, target = long_context_models
    prompt = [1 + (i * 7919) % 383 for i in range(10_500)]
    with Cluster(draft, target, dtype="float32", coordinator={"session_store": redis_url}) as cluster:
        response = cluster.complete(token_ids=prompt, max_new_tokens=8, num_speculative_tokens=3,
                                    ignore_eos=True)
        assert len(response.token_ids) == 8 and response.stats.prompt_tokens == len(prompt)
        session = cluster.stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=response.session_id))
        assert list(session.token_ids) == prompt + list(response.token_ids)
        more = cluster.complete(session_id=response.session_id, token_ids=[5, 6], max_new_tokens=4,
                                ignore_eos=True)
        assert len(more.token_ids) == 4 and more.stats.target_prefill_tokens <= 4


# ---- the engine renews its lease and stops when it is taken over ------------------------------

def _in_thread(call):
    """Run call() in a thread; returns (thread, outcome dict with 'result' or 'error')."""
    outcome: dict = {}

    def body():
        try:
            outcome["result"] = call()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, outcome


def _wait_for(predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _stuck_request(cluster, redis_client):
    """A continued session whose request is stuck waiting for the (stopped) target; returns
    (session id, tokens stored before it, thread, outcome) once its input is committed."""
    first = cluster.complete(prompt="def fibonacci(n):", max_new_tokens=4, ignore_eos=True)
    sid = first.session_id
    tokens_key = _keys(sid)[1]
    before = redis_client.llen(tokens_key)
    cluster.target.stop(None).wait()
    thread, outcome = _in_thread(lambda: cluster.complete(session_id=sid, token_ids=[5, 6], max_new_tokens=8,
                                                          num_speculative_tokens=2, ignore_eos=True))
    _wait_for(lambda: redis_client.llen(tokens_key) == before + 2, "the request to commit its input")
    return sid, before, thread, outcome


def test_renewal_keeps_a_long_request_lease_alive(models, redis_url):
    """A request waiting for its target far longer than the lease keeps its session."""
    lease_s = 1.0
    paths = models["llama"]
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with Cluster(paths["draft"], paths["target"],
                 coordinator={"session_store": redis_url, "session_lease_s": lease_s}) as cluster:
        sid, before, thread, outcome = _stuck_request(cluster, client)
        time.sleep(3 * lease_s)  # three lease lifetimes without a round finishing
        assert thread.is_alive(), outcome

        async def other_replica_acquires():
            store = RedisSessionStore(redis_url, lease_ttl_s=lease_s)
            try:
                await store.acquire(sid)
            finally:
                await store.close()
        with pytest.raises(FailedPrecondition, match="generating in another request"):
            run(other_replica_acquires())
        cluster._start_target(cluster.target_port)
        thread.join(120)
        assert "error" not in outcome, outcome
        assert len(outcome["result"].token_ids) == 8
        assert client.llen(_keys(sid)[1]) == before + 2 + 8
    client.close()


def test_request_whose_session_was_taken_over_stops(models, redis_url):
    paths = models["llama"]
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with Cluster(paths["draft"], paths["target"],
                 coordinator={"session_store": redis_url, "session_lease_s": 1.0}) as cluster:
        sid, before, thread, outcome = _stuck_request(cluster, client)
        stored = client.lrange(_keys(sid)[1], 0, -1)
        # another replica took the session over (as after a lapse of this request's lease)
        client.set(_keys(sid)[2], "another-request", px=60_000)
        cluster._start_target(cluster.target_port)
        thread.join(120)
        error = outcome.get("error")
        assert isinstance(error, grpc.RpcError), outcome
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "was taken over" in error.details() and sid in error.details()
        # the tokens it committed stay; nothing after the takeover was written; the new holder keeps its lease
        assert client.lrange(_keys(sid)[1], 0, -1) == stored and len(stored) == before + 2
        assert client.get(_keys(sid)[2]) == "another-request"
    client.close()
