"""Surviving faults with real processes: services killed or stalled, Redis stopped, clients
cancelling, caches evicted. Greedy output must equal an uninterrupted run; nothing committed is lost."""

from __future__ import annotations

import time

import grpc
import pytest

from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster
from tests.procs import Coordinator, CoordinatorProcess, ServiceProcess, start_together

PROMPT = "def fibonacci(n):"
LONG = dict(prompt=PROMPT, max_new_tokens=300, num_speculative_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def service_processes(models):
    """One draft and one target process for the module's process tests, started side by side."""
    procs = start_together(ServiceProcess("draft", models["llama"]["draft"]),
                           ServiceProcess("target", models["llama"]["target"]))
    yield procs
    for proc in procs:
        proc.stop()


@pytest.fixture
def services(service_processes):
    """The module's draft and target processes, both running and answering when a test starts
    (one the test before killed, paused or restarted is brought back); each test makes its own
    coordinator and sessions."""
    for proc in service_processes:
        proc.ensure_running()
    return service_processes


def collect(stream, after_first=None):
    """Tokens, text and the last message of a stream; after_first() runs once the first chunk is in."""
    tokens, text, last = [], [], None
    for i, chunk in enumerate(stream):
        tokens.extend(chunk.token_ids)
        text.append(chunk.text)
        last = chunk
        if i == 0 and after_first:
            after_first()
    return tokens, "".join(text), last


@pytest.mark.process
def test_target_killed_and_restarted_mid_stream(services, redis_url):
    draft, target = services
    coordinator = Coordinator(draft.address, target.address, session_store=redis_url)
    try:
        expected = list(coordinator.complete(**LONG).token_ids)

        def kill_and_restart():
            target.pause()  # freeze it mid-round, so the kill lands mid-stream
            target.kill()
            target.start()

        tokens, _, last = collect(coordinator.stream(**LONG), after_first=kill_and_restart)
        assert tokens == expected
        assert last.stats.target_retries + last.stats.cache_misses >= 1
        assert last.stats.cache_misses >= 1  # the restarted target rebuilt the session from the store
    finally:
        coordinator.stop()


@pytest.mark.process
def test_a_killed_coordinators_session_continues_on_another_within_seconds(services, redis_url):
    """SIGKILL a coordinator mid-request: its session's lease outlives it only until its liveness
    key lapses (--session-holder-ttl-s), not for the whole lease; the other coordinator says when
    to retry, then continues the session with every streamed token kept."""
    draft, target = services
    store = ["--session-store", redis_url, "--session-lease-s", "120", "--session-holder-ttl-s", "3"]
    doomed, other = start_together(CoordinatorProcess(draft.address, target.address, store),
                                   CoordinatorProcess(draft.address, target.address, store))
    try:
        streamed, session_id = [], ""

        def kill():
            doomed.pause()  # frozen mid-round, holding the lease
            doomed.kill()

        with pytest.raises(grpc.RpcError) as cut:
            for i, chunk in enumerate(doomed.stub().Generate(_request(prompt=PROMPT, max_new_tokens=400), timeout=60)):
                streamed.extend(chunk.token_ids)
                session_id = session_id or chunk.session_id
                if i == 0:
                    kill()
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
        killed_at, hints, more = time.monotonic(), [], None
        while more is None:
            try:
                more = other.stub().Complete(coordinator_pb2.CompleteRequest(
                    request=_request(session_id=session_id, prompt=" next", max_new_tokens=8)), timeout=60)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc.details()
                assert "generating in another request" in exc.details() and "free in" in exc.details()
                hints.append(int(dict(exc.trailing_metadata())["retry-after-ms"]))
                assert 0 <= hints[-1] <= 3000, hints
                assert time.monotonic() - killed_at < 20, "the session stayed leased to a dead coordinator"
                time.sleep(hints[-1] / 1000 + 0.05)
        assert len(more.token_ids) == 8
        stored = list(other.stub().GetSession(coordinator_pb2.GetSessionRequest(session_id=session_id)).token_ids)
        assert streamed and _contains(stored, streamed), "a streamed token was lost"
        assert len(hints) <= 3, hints  # one hint (maybe two) was enough
    finally:
        doomed.stop()
        other.stop()


def _contains(history: list[int], part: list[int]) -> bool:
    return any(history[i:i + len(part)] == part for i in range(len(history) - len(part) + 1))


@pytest.mark.process
def test_draft_down_falls_back_to_target_only(services):
    draft, target = services
    coordinator = Coordinator(draft.address, target.address, draft_retry_s=0.5)
    try:
        expected = list(coordinator.complete(**LONG).token_ids)
        tokens, _, last = collect(coordinator.stream(**LONG), after_first=draft.kill)
        assert tokens == expected
        assert last.stats.fallback_rounds > 0
        draft.start()
        time.sleep(0.6)
        give_up = time.monotonic() + 20  # a loaded machine may answer the health checks late
        while True:
            again = coordinator.complete(**LONG)
            assert list(again.token_ids) == expected
            if again.stats.fallback_rounds == 0 or time.monotonic() > give_up:
                break
        assert again.stats.fallback_rounds == 0 and again.stats.draft_tokens > 0  # the draft is back in use
    finally:
        coordinator.stop()


@pytest.mark.process
def test_draft_slower_than_budget_falls_back(services):
    draft, target = services
    coordinator = Coordinator(draft.address, target.address, draft_timeout_s=0.3, draft_retry_s=0.2)
    try:
        expected = list(coordinator.complete(**LONG).token_ids)
        draft.pause()  # alive but answering nothing: every Propose overruns its budget
        try:
            response = coordinator.complete(**LONG)
        finally:
            draft.resume()
        assert list(response.token_ids) == expected
        assert response.stats.fallback_rounds > 0
        assert response.stats.rounds > response.stats.generated_tokens // 2  # mostly target-only rounds
        time.sleep(0.3)
        after = coordinator.complete(**LONG)
        assert list(after.token_ids) == expected and after.stats.draft_tokens > 0
    finally:
        coordinator.stop()


@pytest.mark.process
def test_redis_stopped_then_back(models, own_redis):
    paths = models["llama"]
    with Cluster(paths["draft"], paths["target"],
                 coordinator={"session_store": own_redis.url, "session_lease_s": 1.0}) as cluster:
        first = cluster.complete(prompt=PROMPT, max_new_tokens=8, ignore_eos=True)
        stream = cluster.stub.Generate(_request(session_id=first.session_id, token_ids=[5, 6],
                                                max_new_tokens=400), timeout=120)
        received, error = [], None
        try:
            for i, chunk in enumerate(stream):
                received.extend(chunk.token_ids)
                if i == 0:
                    own_redis.stop()
        except grpc.RpcError as exc:
            error = exc
        if error is not None:  # an in-flight stream ends with a clear status...
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert "session store" in error.details() and "unreachable" in error.details()
        # ...and new requests are refused the same way while Redis is down
        with pytest.raises(grpc.RpcError) as info:
            cluster.complete(prompt="new session", max_new_tokens=4)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "retry when it is back" in info.value.details()

        own_redis.start()
        session = cluster.stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=first.session_id))
        stored = list(session.token_ids)
        # every token streamed to the client was committed first
        prompt_ids = stored[: first.stats.prompt_tokens]
        assert stored[len(prompt_ids): len(prompt_ids) + 8] == list(first.token_ids)
        assert stored[len(prompt_ids) + 8: len(prompt_ids) + 10] == [5, 6]
        generated_after = stored[len(prompt_ids) + 10:]
        assert generated_after[: len(received)] == received, (generated_after, received, error)
        time.sleep(1.2)  # the cut-off request's lease expires
        more = cluster.complete(session_id=first.session_id, prompt=" again", max_new_tokens=8, ignore_eos=True)
        assert len(more.token_ids) == 8
        after = cluster.stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=first.session_id))
        assert list(after.token_ids)[: len(stored)] == stored


def _request(**fields):
    from tests.cluster import generate_request

    fields.setdefault("ignore_eos", True)
    fields.setdefault("num_speculative_tokens", 2)
    return generate_request(**fields)


def _wait_released(cluster, session_id, timeout=5.0):
    deadline = time.monotonic() + timeout
    target_caches = cluster.target_servicer.engine.caches
    draft_caches = cluster.draft_servicer.engine.caches
    while time.monotonic() < deadline:
        if session_id not in target_caches and session_id not in draft_caches:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
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
