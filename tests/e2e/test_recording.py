"""Recording what the target committed (coordinator/recording.py, specdec/records.py): off by
default, one record per finished request, never a salted request's text, bounded in bytes and
in stream entries, and readable after the coordinator was killed.

Here the e2e tests; the other tiers' are in tests/unit/test_recording.py and
tests/process/test_recording.py.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import redis

from specdec.records import RequestRecord, read_records, read_stream, stitched
from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster

PROMPT = "def fibonacci(n):"


def _wait_for(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return value


# ---- a coordinator recording ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def recording(models, redis_url, tmp_path_factory):
    """A cluster recording to a directory and to a Redis stream of at most 3 entries."""
    directory = tmp_path_factory.mktemp("records")
    key = f"specdec-test-records-{uuid.uuid4().hex}"
    coordinator = {"record_dir": str(directory), "record_stream": key, "record_max_len": 3,
                   "session_store": redis_url}
    with Cluster(models["llama"]["draft"], models["llama"]["target"], coordinator=coordinator) as cluster:
        yield cluster, directory, key
    redis.Redis.from_url(redis_url).delete(key)


def _records(directory: Path, count: int) -> list[RequestRecord]:
    return _wait_for(lambda: (found := list(read_records(directory))) and len(found) >= count and found)


def test_a_finished_request_is_recorded_with_its_rounds(recording):
    cluster, directory, _ = recording
    before = len(list(read_records(directory)))
    response = cluster.complete(prompt=PROMPT, max_new_tokens=24, num_speculative_tokens=3)
    record = _records(directory, before + 1)[-1]
    assert record.session_id == response.session_id and record.context == 0 and record.request == 1
    assert record.tokens[record.input_tokens:] == list(response.token_ids)
    assert record.finish == "length" and record.draft and record.target
    proposed = sum(r.proposed for r in record.rounds)
    assert proposed == response.stats.draft_tokens > 0
    assert sum(r.accepted for r in record.rounds) == response.stats.accepted_tokens
    for r in record.rounds:  # every round lies within the committed tokens
        assert record.input_tokens <= r.at and r.at + min(r.accepted + 1, r.proposed) <= len(record.tokens)


def test_a_continued_session_is_recorded_as_its_new_tokens_after_its_context(recording):
    cluster, directory, _ = recording
    before = len(list(read_records(directory)))
    first = cluster.complete(prompt=PROMPT, max_new_tokens=8)
    cluster.complete(session_id=first.session_id, prompt=" more", max_new_tokens=8)
    records = [r for r in _records(directory, before + 2) if r.session_id == first.session_id]
    assert [r.request for r in records] == [1, 2] and records[1].context == len(records[0].tokens)
    whole = cluster.stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=first.session_id)).token_ids
    assert stitched(records) == [list(whole)]


def test_a_salted_request_and_its_sessions_later_requests_are_never_recorded(recording):
    cluster, directory, _ = recording
    before = len(list(read_records(directory)))
    salted = cluster.complete(prompt="a tenant's secret", max_new_tokens=8, cache_salt="tenant-a")
    cluster.complete(session_id=salted.session_id, prompt=" then unsalted", max_new_tokens=8)
    marker = cluster.complete(prompt=PROMPT, max_new_tokens=4)  # written after them, in order
    records = _records(directory, before + 1)
    assert records[-1].session_id == marker.session_id
    assert salted.session_id not in {r.session_id for r in records}
    assert cluster.coordinator.round_loop.recorder.counts.skipped >= 2


def test_the_stream_keeps_at_most_its_length(recording, redis_url):
    cluster, directory, key = recording
    for _ in range(4):
        cluster.complete(prompt=PROMPT, max_new_tokens=2)
    _wait_for(lambda: cluster.coordinator.round_loop.recorder.counts.written >= 4)
    client = redis.Redis.from_url(redis_url)
    assert client.xlen(key) == 3
    newest = list(read_stream(redis_url, key))[-1]
    assert newest == list(read_records(directory))[-1]
