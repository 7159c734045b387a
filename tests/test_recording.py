"""Recording what the target committed (coordinator/recording.py, specdec/records.py): off by
default, one record per finished request, never a salted request's text, bounded in bytes and
in stream entries, and readable after the coordinator was killed."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
import redis

from coordinator.recording import DirectorySink, Recorder
from specdec.config import CoordinatorConfig
from specdec.records import ReadCount, RequestRecord, RoundRecord, read_records, read_stream, stitched
from specdec.v1 import coordinator_pb2
from tests.cluster import Cluster
from tests.procs import CoordinatorProcess

PROMPT = "def fibonacci(n):"


def _record(session: str = "s", request: int = 1, context: int = 0, tokens: list[int] | None = None) -> RequestRecord:
    tokens = tokens if tokens is not None else [5, 6, 7, 8, 9, 10]
    return RequestRecord(session, request, context, tokens, 2, [RoundRecord(2, 3, 1, "draft")], "length", "d", "t", 1.0)


def _wait_for(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return value


# ---- the format and its reader -------------------------------------------------------------------


@pytest.mark.unit
def test_a_record_round_trips_and_names_the_positions_the_draft_missed():
    record = RequestRecord("s", 2, 40, [1, 2, 3, 4, 5, 6, 7], 2,
                           [RoundRecord(2, 3, 1, "draft"), RoundRecord(4, 2, 2, "ngram"), RoundRecord(6, 4, 0, "draft", True)],
                           "eos", "d", "t", 5.0)
    assert RequestRecord.from_line(record.to_line()) == record
    assert record.missed_positions() == [3, 6]  # the 2nd of the first round, the first of the tree's


@pytest.mark.unit
def test_the_reader_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "records-1.jsonl"
    whole = _record().to_line()
    path.write_bytes(whole + whole[: len(whole) // 2])  # killed while writing the second
    count = ReadCount()
    assert list(read_records(tmp_path, count)) == [_record()]
    assert (count.records, count.skipped) == (1, 1)


@pytest.mark.unit
def test_stitched_joins_a_sessions_records_while_each_context_is_the_tokens_before_it():
    first, second = _record("a", 1, 0, [1, 2, 3]), _record("a", 2, 3, [4, 5])
    orphan = _record("a", 4, 20, [9, 9])  # request 3 was not recorded
    other = _record("b", 1, 0, [7])
    assert sorted(stitched([second, other, orphan, first])) == [[1, 2, 3, 4, 5], [7], [9, 9]]


# ---- bounds --------------------------------------------------------------------------------------


@pytest.mark.unit
def test_off_by_default():
    assert Recorder.from_config(CoordinatorConfig()) is None


@pytest.mark.unit
def test_the_directory_holds_at_most_max_bytes_across_files_and_restarts(tmp_path, monkeypatch):
    line = _record().to_line()
    cap = 10 * len(line) + 5
    sink = DirectorySink(tmp_path, cap)
    kept = sum(sink.write(line) for _ in range(15))
    sink.close()
    files = sorted(tmp_path.glob("records-*.jsonl"))
    assert kept == 10 and sum(f.stat().st_size for f in files) <= cap
    assert len(files) == 10  # rotated every eighth of the cap (a line each here)
    again = DirectorySink(tmp_path, cap)  # a restarted coordinator counts what is there
    assert not again.write(line)
    monkeypatch.setattr("coordinator.recording.FULL_RECHECK_S", 0.0)
    for file in files[:3]:  # an operator moved some away: recording resumes
        file.unlink()
    assert again.write(line) and again.write(line)
    again.close()
    assert sum(f.stat().st_size for f in tmp_path.glob("records-*.jsonl")) <= cap


@pytest.mark.unit
def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="--record-max-bytes"):
        Recorder.from_config(CoordinatorConfig(record_dir=str(tmp_path), record_max_bytes=0))
    with pytest.raises(ValueError, match="--session-store"):
        Recorder.from_config(CoordinatorConfig(record_stream="k"))  # the memory store has no Redis


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


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_a_continued_session_is_recorded_as_its_new_tokens_after_its_context(recording):
    cluster, directory, _ = recording
    before = len(list(read_records(directory)))
    first = cluster.complete(prompt=PROMPT, max_new_tokens=8)
    cluster.complete(session_id=first.session_id, prompt=" more", max_new_tokens=8)
    records = [r for r in _records(directory, before + 2) if r.session_id == first.session_id]
    assert [r.request for r in records] == [1, 2] and records[1].context == len(records[0].tokens)
    whole = cluster.stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=first.session_id)).token_ids
    assert stitched(records) == [list(whole)]


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_the_stream_keeps_at_most_its_length(recording, redis_url):
    cluster, directory, key = recording
    for _ in range(4):
        cluster.complete(prompt=PROMPT, max_new_tokens=2)
    _wait_for(lambda: cluster.coordinator.round_loop.recorder.counts.written >= 4)
    client = redis.Redis.from_url(redis_url)
    assert client.xlen(key) == 3
    newest = list(read_stream(redis_url, key))[-1]
    assert newest == list(read_records(directory))[-1]


@pytest.mark.process
def test_a_killed_coordinator_leaves_a_readable_record(recording, tmp_path):
    """SIGKILL in the middle of a generation: every request that finished before is there whole,
    and the reader is not upset by whatever the kill cut."""
    cluster, _, _ = recording
    process = CoordinatorProcess(f"127.0.0.1:{cluster.draft_port}", f"127.0.0.1:{cluster.target_port}",
                                 ["--record-dir", str(tmp_path)]).start()
    try:
        stub = process.stub()
        finished = [stub.Complete(coordinator_pb2.CompleteRequest(request=coordinator_pb2.GenerateRequest(
            prompt=f"{PROMPT} {i}", max_new_tokens=6)), timeout=60) for i in range(3)]
        _records(tmp_path, 3)  # written (a record is flushed as its request ends)
        stream = stub.Generate(coordinator_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=400,
                                                               ignore_eos=True), timeout=60)
        next(stream)
        process.kill()
    finally:
        process.stop()
    count = ReadCount()
    records = list(read_records(tmp_path, count))
    assert [r.session_id for r in records] == [f.session_id for f in finished]
    assert [r.tokens[r.input_tokens:] for r in records] == [list(f.token_ids) for f in finished]
    assert count.skipped == 0
    for file in tmp_path.glob("records-*.jsonl"):  # every line whole
        assert all(json.loads(line) for line in file.read_text().splitlines())
