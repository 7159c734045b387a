"""Surviving faults with real processes: services killed or stalled, Redis stopped, clients
cancelling, caches evicted. Greedy output must equal an uninterrupted run; nothing committed is lost.

Here the process tests; the other tiers' are in tests/e2e/test_resilience.py.
"""

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
