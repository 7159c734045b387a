"""Recording what the target committed (coordinator/recording.py, specdec/records.py): off by
default, one record per finished request, never a salted request's text, bounded in bytes and
in stream entries, and readable after the coordinator was killed.

Here the unit tests; the other tiers' are in tests/e2e/test_recording.py and
tests/process/test_recording.py.
"""

from __future__ import annotations

import pytest

from coordinator.recording import DirectorySink, Recorder
from specdec.config import CoordinatorConfig
from specdec.records import ReadCount, RequestRecord, RoundRecord, read_records, stitched


def _record(session: str = "s", request: int = 1, context: int = 0, tokens: list[int] | None = None) -> RequestRecord:
    tokens = tokens if tokens is not None else [5, 6, 7, 8, 9, 10]
    return RequestRecord(session, request, context, tokens, 2, [RoundRecord(2, 3, 1, "draft")], "length", "d", "t", 1.0)


# ---- the format and its reader -------------------------------------------------------------------


def test_a_record_round_trips_and_names_the_positions_the_draft_missed():
    record = RequestRecord("s", 2, 40, [1, 2, 3, 4, 5, 6, 7], 2,
                           [RoundRecord(2, 3, 1, "draft"), RoundRecord(4, 2, 2, "ngram"), RoundRecord(6, 4, 0, "draft", True)],
                           "eos", "d", "t", 5.0)
    assert RequestRecord.from_line(record.to_line()) == record
    assert record.missed_positions() == [3, 6]  # the 2nd of the first round, the first of the tree's


def test_the_reader_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "records-1.jsonl"
    whole = _record().to_line()
    path.write_bytes(whole + whole[: len(whole) // 2])  # killed while writing the second
    count = ReadCount()
    assert list(read_records(tmp_path, count)) == [_record()]
    assert (count.records, count.skipped) == (1, 1)


def test_stitched_joins_a_sessions_records_while_each_context_is_the_tokens_before_it():
    first, second = _record("a", 1, 0, [1, 2, 3]), _record("a", 2, 3, [4, 5])
    orphan = _record("a", 4, 20, [9, 9])  # request 3 was not recorded
    other = _record("b", 1, 0, [7])
    assert sorted(stitched([second, other, orphan, first])) == [[1, 2, 3, 4, 5], [7], [9, 9]]


# ---- bounds --------------------------------------------------------------------------------------


def test_off_by_default():
    assert Recorder.from_config(CoordinatorConfig()) is None


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


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="--record-max-bytes"):
        Recorder.from_config(CoordinatorConfig(record_dir=str(tmp_path), record_max_bytes=0))
    with pytest.raises(ValueError, match="--session-store"):
        Recorder.from_config(CoordinatorConfig(record_stream="k"))  # the memory store has no Redis
